"""Choosing where an AR stage's ``EngineCore`` runs: ``make_stage_engine``.

``EngineOptions.backend`` picks one of two engines with the same surface (the ``StageBackend``
protocol below is what the orchestrator uses of them):

* ``"inprocess"`` — ``StageEngine``: the ``EngineCore`` in the orchestrator's process, stepped
  by the orchestrator (the default: on this runtime's small CPU models it is the faster one, see
  ``benchmarks/test_bench_backends.py``);
* ``"multiprocess"`` — ``MPStageEngine``: the ``EngineCore`` in its own process through vLLM's
  ``SyncMPClient``, stepping on its own; chunks come back on vLLM's output messages with their
  tensors in shared memory;
* ``"ray"`` — ``RayStageEngine``: the ``EngineCore`` in a Ray actor placed by the stage's
  ``ray_resources``, on this host or another; chunks come back with each step, through shared
  memory on the same host and Ray's object store across hosts.

All give bit-identical outputs for the same requests (``tests/test_mp_stage.py``,
``tests/test_ray_stage.py``). What the out-of-process engines share is in ``engine.remote``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from omni_runtime.adapters.input import StageInput
from omni_runtime.engine.config import BACKENDS, EngineOptions
from omni_runtime.engine.graph import ARStageSpec
from omni_runtime.engine.stage import StageEngine, StageStep
from omni_runtime.sched.transfer import ChunkSink

__all__ = ["StageBackend", "make_stage_engine"]


class StageBackend(Protocol):
    """What the orchestrator calls on an AR stage engine."""

    stage_id: str
    initial_free_blocks: int

    def set_sink(self, sink: ChunkSink) -> None: ...

    def add(self, item: StageInput) -> None: ...

    def abort(self, request_ids: Iterable[str]) -> list[str]: ...

    def has_work(self) -> bool: ...

    def num_requests(self) -> int:
        """Requests the stage holds now (progress display)."""

    def step(self) -> StageStep: ...

    def num_free_blocks(self) -> int: ...

    def call_worker(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(worker, *args)`` on each of the stage's workers, wherever they run (vLLM's
        ``collective_rpc``): inspection and fault injection. Out of process, ``fn`` and its
        results are pickled (multiprocess: needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``)."""

    def leftovers(self) -> dict[str, Any]: ...

    def is_clean(self) -> bool: ...

    def shutdown(self) -> None: ...


def make_stage_engine(
    spec: ARStageSpec, stages: tuple[str, ...], options: EngineOptions
) -> StageBackend:
    """The stage engine ``options.backend`` names, for AR stage ``spec`` of pipeline ``stages``."""
    if options.backend == "inprocess":
        return StageEngine(spec, stages, options)
    if options.backend == "multiprocess":
        # Imported here: the in-process path never needs the multiprocess client.
        from omni_runtime.engine.mp_stage import MPStageEngine

        return MPStageEngine(spec, stages, options)
    if options.backend == "ray":
        # Imported here: Ray is an optional extra.
        from omni_runtime.engine.ray_stage import RayStageEngine

        return RayStageEngine(spec, stages, options)
    raise ValueError(f"backend: unknown {options.backend!r}; known {list(BACKENDS)}")
