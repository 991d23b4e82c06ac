"""Omni schedulers (subclasses of vLLM's) and the scheduler-side chunk transfer path."""

from omni_runtime.sched.scheduler import OmniARAsyncScheduler, OmniARScheduler
from omni_runtime.sched.transfer import (
    ChunkSink,
    ChunkTransferAdapter,
    OutboxSink,
    accepts_new_token_ids,
    requires_token_updates,
)

# Attributes the omni schedulers add to upstream's (C-12); the invariant audit compares a live
# scheduler's attribute set against upstream's plus exactly these.
DECLARED_SCHEDULER_ATTRIBUTES: tuple[str, ...] = (
    "omni_stage",
    "transfer",
    "_freed_in_update",
    "_in_update",
    "_last_failed",
    "_dropping",
)

__all__ = [
    "DECLARED_SCHEDULER_ATTRIBUTES",
    "ChunkSink",
    "ChunkTransferAdapter",
    "OmniARAsyncScheduler",
    "OmniARScheduler",
    "OutboxSink",
    "accepts_new_token_ids",
    "requires_token_updates",
]
