"""Pausing the scheduler, per vLLM release: the engine's pause states and how they are set.

vLLM's engine pauses its scheduler (``pause_scheduler``, ``resume_scheduler``, a sleep at level
0) through ``Scheduler.set_pause_state``: ``PAUSED_NEW`` schedules only requests already running
(from 0.32 also waiting requests that hold KV blocks), ``PAUSED_ALL`` schedules nothing,
``UNPAUSED`` resumes. ``pause_state`` reads it back for the snapshot (only while paused, so
snapshots of runs that never pause are unchanged). The names are the same in 0.28-0.33.
"""

from __future__ import annotations

from typing import Any

# The workload's pause states (``conformance._core.workload.Pause``) -> vLLM's ``PauseState``.
_STATES = {"off": "UNPAUSED", "new": "PAUSED_NEW", "all": "PAUSED_ALL"}


def set_pause(scheduler: Any, state: str) -> None:
    """``scheduler.set_pause_state`` with the ``PauseState`` named by ``state``."""
    from vllm.v1.core.sched.interface import PauseState

    scheduler.set_pause_state(PauseState[_STATES[state]])


def pause_state(scheduler: Any) -> str | None:
    """The scheduler's pause state as the snapshot shows it (None: not paused)."""
    state = scheduler.pause_state
    return None if not state else str(state.name)
