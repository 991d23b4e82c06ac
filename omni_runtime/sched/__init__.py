"""Omni schedulers (subclasses of vLLM's) and the scheduler-side chunk transfer path."""

from omni_runtime.sched.scheduler import OmniARAsyncScheduler, OmniARScheduler
from omni_runtime.sched.transfer import (
    ChunkSink,
    ChunkTransferAdapter,
    OutboxSink,
    accepts_new_token_ids,
    requires_token_updates,
)

__all__ = [
    "ChunkSink",
    "ChunkTransferAdapter",
    "OmniARAsyncScheduler",
    "OmniARScheduler",
    "OutboxSink",
    "accepts_new_token_ids",
    "requires_token_updates",
]
