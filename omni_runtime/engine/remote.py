"""What the out-of-process stage engines (``mp_stage``, ``ray_stage``) share: the errors a stage
that cannot run or has died reports, handing a stage's returned chunks to its connector, and
turning refused or lost requests into one error outcome each."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from omni_runtime.engine.stage import StageOutput
from omni_runtime.payload import StageChunk
from omni_runtime.sched.transfer import ChunkSink

logger = logging.getLogger(__name__)


class BackendUnavailable(RuntimeError):
    """The chosen backend cannot run here (Ray not installed, its cluster unreachable)."""


class StageProcessDied(RuntimeError):
    """A stage's engine process (or actor) exited while holding requests."""


def route_chunks(
    stage_id: str, sink: ChunkSink | None, chunks: Iterable[StageChunk]
) -> dict[str, str]:
    """Hand a stage's returned chunks to its connector, in order; returns refused requests.

    A connector fault fails only its own request (C-61): that request's later chunks are not
    sent, and the caller aborts it and reports the cause this returns (request id -> message).
    """
    refused: dict[str, str] = {}
    if sink is None:
        return refused
    for chunk in chunks:
        if chunk.request_id in refused:
            continue
        try:
            sink.send(chunk)
        except Exception as exc:
            refused[chunk.request_id] = f"{stage_id}: {type(exc).__name__}: {exc}"
    return refused


def fail_held(stage_id: str, held: set[str], cause: str) -> list[StageOutput]:
    """One error outcome for every request a dead stage process held; ``held`` is emptied."""
    failed = sorted(held)
    held.clear()
    logger.warning("stage %s: %s; failing %s and restarting", stage_id, cause, failed)
    message = f"{stage_id}: {StageProcessDied.__name__}: {cause}"
    return [StageOutput(rid, [], "error", message) for rid in failed]


def refused_as_errors(outputs: list[StageOutput], refused: dict[str, str]) -> list[StageOutput]:
    """The step's outputs with each refused request's replaced by one error outcome."""
    kept = [o for o in outputs if o.request_id not in refused]
    return kept + [StageOutput(rid, [], "error", why) for rid, why in refused.items()]
