"""Choosing where an AR stage's ``EngineCore`` runs: ``make_stage_engine``.

``EngineOptions.backend`` picks one of three engines with one surface (``StageBackend``, what
the orchestrator uses of them):

* ``"inprocess"`` — ``StageEngine``, in the orchestrator's process (the default);
* ``"multiprocess"`` — ``MPStageEngine``, in its own process through vLLM's ``SyncMPClient``;
* ``"ray"`` — ``RayStageEngine``, in a Ray actor placed by the stage's ``ray_resources``.

All give bit-identical outputs (``tests/test_mp_stage.py``, ``tests/test_ray_stage.py``); what
the out-of-process engines share is in ``engine.remote``. How each works, and what each costs
(``benchmarks/test_bench_backends.py``): docs/design.md, "A stage in its own process, or on
another machine".
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
