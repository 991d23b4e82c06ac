"""Streaming input sessions, per vLLM release: which releases have them, and a session's state.

From vLLM 0.28 a request may be resumable (``Request.resumable``): it stops at its
``max_tokens``, keeps its KV cache and waits (``WAITING_FOR_STREAMING_REQ``) for the client's
next input under the same id, which ``add_request`` folds into its prompt (or queues, in
``Request.streaming_queue``, while a turn runs). ``session_state`` is what the per-request
snapshot (C-01) compares for such a request beside the common fields: its prompt, which each
input extends by the turn's kept output and the new chunk, and the inputs still queued.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

from conformance._core.vllm_compat.versions import ByRelease, Change

HAS_SESSIONS: ByRelease[bool] = ByRelease(
    "streaming input sessions",
    False,
    [Change("0.28.0", True, "Request.resumable: streaming input sessions under one request id")],
)

NO_SESSIONS = "this release has no streaming input sessions (Request.resumable is new in 0.28)"


def _state(request: Any) -> tuple[int, int, bool] | None:
    queue = request.streaming_queue  # set by add_request for a resumable request, else None
    if queue is None:
        return None
    return request.num_prompt_tokens, len(queue), request.resumable


def _none(request: Any) -> None:
    return None


@cache
def session_reader() -> Callable[[Any], tuple[int, int, bool] | None]:
    """A reader of one request's session state: (prompt length, inputs queued, still
    resumable), or None for a request that is no session (and on releases without them)."""
    return _state if HAS_SESSIONS.value() else _none


def session_fields(request: Any) -> dict[str, Any] | None:
    """``session_reader``'s tuple as named snapshot fields (None: no session)."""
    state = session_reader()(request)
    if state is None:
        return None
    prompt, queued, resumable = state
    return {"num_prompt_tokens": prompt, "queued_inputs": queued, "resumable": resumable}
