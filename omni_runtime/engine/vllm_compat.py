"""The engine's single seam to vLLM internals (written against vLLM 0.33.0).

Every read or write the engine layer makes of an ``EngineCore`` field, the scheduler's private
state, the executor's worker chain or the batch queue's entries lives here, so a vLLM upgrade is
reviewed for the engine in this file alone; other engine modules use vLLM's public surface.
``TrackedEngineCore`` knows the steps in flight (C-61), learned through subclasses rather than by
patching a live scheduler. The worker's seam is ``omni_runtime.worker.vllm_compat`` (workers must
not import engine code). See docs/design.md, "Inside the layers" (vLLM seams).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequestType
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.core_client import SyncMPClient
from vllm.v1.executor.uniproc_executor import UniProcExecutor
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.serial_utils import MsgpackDecoder

logger = logging.getLogger(__name__)

__all__ = [
    "FaultContainingExecutor",
    "OmniSyncMPClient",
    "TrackedEngineCore",
    "add_request",
    "block_hasher",
    "cached_prompt_tokens",
    "call_child_scheduler",
    "call_child_scheduler_nowait",
    "client_engine_dead",
    "client_outputs_queue",
    "client_processes",
    "has_queued_steps",
    "model_runner",
    "num_free_blocks",
    "num_queued_steps",
    "num_waiting",
    "pending_finished_ids",
    "resend_finished_ids",
    "running_request_ids",
    "scheduler_of",
    "scheduler_requests",
    "step",
    "step_outputs",
    "worker",
]


# ---- in-flight tracking ----------------------------------------------------------------------


class _RecordingExecutor(UniProcExecutor):
    """vLLM's uni executor that remembers every ``SchedulerOutput`` it is asked to execute.

    ``EngineCore.step`` and ``step_with_batch_queue`` call ``execute_model`` right after
    ``Scheduler.schedule``, so "handed to the executor" is "scheduled". The output is recorded
    before the call: a worker that raises inline (vLLM 0.33 re-raises a failed non-blocking
    call at once) still leaves its step on record.
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.handed_out: list[SchedulerOutput] = []
        super().__init__(vllm_config)

    def execute_model(  # type: ignore[override]
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | None | Future[ModelRunnerOutput | None]:
        self.handed_out.append(scheduler_output)
        return super().execute_model(scheduler_output, non_block)


class _ContainedFuture(Future):  # type: ignore[type-arg]
    """A step's future whose fault becomes the step's failed output (``FaultContainingExecutor``).

    vLLM only calls ``done`` and ``result`` on it; ``result`` is where a background build's
    error surfaces (``AsyncModelRunnerOutput.get_output``), so that is where it is caught.
    """

    def __init__(self, inner: Future[Any], on_fault: Callable[[Exception], Any]) -> None:
        super().__init__()
        self._inner = inner
        self._on_fault = on_fault

    def done(self) -> bool:
        return self._inner.done()

    def result(self, timeout: float | None = None) -> Any:
        try:
            return self._inner.result(timeout)
        except Exception as exc:
            return self._on_fault(exc)


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class FaultContainingExecutor(UniProcExecutor):
    """vLLM's uni executor for a stage in its own process: a step the worker raises out of
    fails that step's requests instead of the engine process.

    vLLM's engine process treats an exception out of a step as fatal, which would fail every
    request the stage holds; in process, ``StageEngine`` fails only the requests of the step
    (C-61). This executor gives the process the in-process outcome: the step's output becomes
    an ``OmniModelRunnerOutput`` whose ``omni_failed`` names every request of the step with the
    cause, which the omni scheduler fails exactly as a fault the worker pinned on them. The
    failed step's finished ids may never have reached the worker, so they go again with the
    next step (an unknown id is a no-op for the runner). Without an omni stage there is nowhere
    to report that, and the fault propagates as in vLLM.
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        from omni_runtime.config import OmniStageConfig

        stage = OmniStageConfig.from_vllm_config(vllm_config)
        self._stage_id = stage.stage_id if stage is not None else None
        # The step whose ``sample_tokens`` comes next, and its failed output if it failed.
        self._sampling: SchedulerOutput | None = None
        self._sampling_failed: ModelRunnerOutput | None = None
        self._resend: set[str] = set()
        super().__init__(vllm_config)

    def _failed_output(self, so: SchedulerOutput | None, exc: Exception) -> ModelRunnerOutput:
        if self._stage_id is None or so is None:
            raise exc
        from omni_runtime.payload import OmniModelRunnerOutput

        ids = list(so.num_scheduled_tokens)
        cause = f"{self._stage_id}: {type(exc).__name__}: {exc}"
        logger.warning("stage %s: step fault %r fails requests %s", self._stage_id, exc, ids)
        self._resend |= set(so.finished_req_ids)
        return OmniModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[[] for _ in ids],
            omni_failed=dict.fromkeys(ids, cause),
        )

    def execute_model(  # type: ignore[override]
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | None | Future[ModelRunnerOutput | None]:
        if self._resend:
            scheduler_output.finished_req_ids |= self._resend
            self._resend = set()
        self._sampling, self._sampling_failed = scheduler_output, None
        try:
            out = super().execute_model(scheduler_output, non_block)
        except Exception as exc:
            failed = self._sampling_failed = self._failed_output(scheduler_output, exc)
            return _done(failed) if non_block else failed
        if isinstance(out, Future):
            return _ContainedFuture(out, lambda e: self._failed_output(scheduler_output, e))
        return out

    def sample_tokens(  # type: ignore[override]
        self, grammar_output: Any, non_block: bool = False
    ) -> ModelRunnerOutput | None | Future[ModelRunnerOutput | None]:
        so, failed = self._sampling, self._sampling_failed
        if failed is not None:
            # The step already failed in execute_model (vLLM's batch queue still asks).
            return _done(failed) if non_block else failed
        try:
            out = super().sample_tokens(grammar_output, non_block)
        except Exception as exc:
            failed = self._failed_output(so, exc)
            return _done(failed) if non_block else failed
        if isinstance(out, Future):
            return _ContainedFuture(out, lambda e: self._failed_output(so, e))
        return out


class TrackedEngineCore(EngineCore):
    """An in-process ``EngineCore`` (uni executor) that tracks its in-flight steps.

    A step is in flight from the moment its ``SchedulerOutput`` reaches the executor until a
    step call returns without it in the batch queue (vLLM applies a step's output with
    ``update_from_output`` inside the step call that pops it). When a step call raises, the
    outputs it was working on are the in-flight ones that are not queued:
    ``take_failed_steps`` hands them over; the queued ones stay in flight.

    Overrides ``EngineCore.step`` and ``step_with_batch_queue`` (vLLM 0.33 binds one of them to
    ``step_fn`` in ``__init__``, after our subclass methods exist, so the overrides are used).
    """

    model_executor: _RecordingExecutor

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config, executor_class=_RecordingExecutor, log_stats=False)

    @property
    def in_flight(self) -> list[SchedulerOutput]:
        """Scheduled and not yet applied, oldest first (a view; do not mutate)."""
        return self.model_executor.handed_out

    def step(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        result = super().step()
        self._settle()
        return result

    def step_with_batch_queue(self) -> tuple[dict[int, EngineCoreOutputs] | None, bool]:
        result = super().step_with_batch_queue()
        self._settle()
        return result

    def take_failed_steps(self) -> list[SchedulerOutput]:
        """After a step call raised: the in-flight outputs it failed, removed from the record."""
        queued = {id(so) for so in _queued_scheduler_outputs(self)}
        record = self.model_executor.handed_out
        failed = [so for so in record if id(so) not in queued]
        record[:] = [so for so in record if id(so) in queued]
        return failed

    def _settle(self) -> None:
        # A step call that returned applied every output it popped; what is left in flight is
        # exactly what is still queued (nothing, without a batch queue).
        queued = {id(so) for so in _queued_scheduler_outputs(self)}
        record = self.model_executor.handed_out
        record[:] = [so for so in record if id(so) in queued]


# ---- EngineCore fields -----------------------------------------------------------------------


def step(core: EngineCore) -> tuple[dict[int, EngineCoreOutputs] | None, bool]:
    """One engine step: ``EngineCore.step_fn`` (``step``, or ``step_with_batch_queue`` when the
    engine has a batch queue, i.e. under async scheduling). Returns (outputs, executed)."""
    return core.step_fn()


def _queued_scheduler_outputs(core: EngineCore) -> Iterator[SchedulerOutput]:
    # ``EngineCore.batch_queue``: None without async scheduling, else a deque of
    # ``(sample future, SchedulerOutput, execute future)``. Releases up to 0.10 kept a
    # ``queue.Queue`` of ``(future, SchedulerOutput)`` pairs instead.
    for entry in core.batch_queue or ():
        yield entry[1]


def has_queued_steps(core: EngineCore) -> bool:
    """Whether ``EngineCore.batch_queue`` holds steps not yet applied."""
    return bool(core.batch_queue)


def num_queued_steps(core: EngineCore) -> int:
    """``len(EngineCore.batch_queue)`` (0 without a batch queue)."""
    return len(core.batch_queue or ())


def block_hasher(core: EngineCore) -> Any:
    """``EngineCore.request_block_hasher``: what a ``Request`` built outside the engine must
    carry for prefix caching (None when prefix caching is off). Releases before 0.10.2 hashed
    blocks in the KV cache manager and have no such field."""
    return core.request_block_hasher


def add_request(core: EngineCore, request: Request) -> None:
    """``EngineCore.add_request(request, request_wave=0)`` with a ready ``Request`` (the
    ``preprocess_add_request`` path starts from an ``EngineCoreRequest``, which has no room for
    the omni slot). A structured request's grammar starts compiling first, as that path does:
    without it the request would wait for a grammar nobody compiles."""
    if request.use_structured_output:
        core.structured_output_manager.grammar_init(request)
    core.add_request(request, request_wave=0)


def scheduler_of(core: EngineCore) -> Any:
    """``EngineCore.scheduler``: the instance of the configured ``scheduler_cls``."""
    return core.scheduler


def worker(core: EngineCore) -> Any:
    """The worker object of an in-process engine: ``model_executor.driver_worker.worker``
    (the uni executor's ``WorkerWrapperBase`` and the worker it wraps)."""
    return core.model_executor.driver_worker.worker  # type: ignore[attr-defined]


def model_runner(core: EngineCore) -> Any:
    """The worker's model runner: ``model_executor.driver_worker.worker.model_runner``."""
    return worker(core).model_runner


def step_outputs(outputs: Mapping[int, EngineCoreOutputs] | None) -> Iterator[EngineCoreOutput]:
    """Every ``EngineCoreOutput`` of one step's result, client by client."""
    for eco in (outputs or {}).values():
        yield from eco.outputs


def cached_prompt_tokens(output: EngineCoreOutput) -> int | None:
    """Prompt tokens the prefix cache served: ``EngineCoreOutput.prefill_stats.num_cached_tokens``
    (set on a request's first output only). Older releases carried ``num_cached_tokens`` on the
    output itself."""
    stats = getattr(output, "prefill_stats", None)
    return None if stats is None else int(stats.num_cached_tokens)


# ---- scheduler internals ---------------------------------------------------------------------


def scheduler_requests(scheduler: Any) -> Mapping[str, Request]:
    """``Scheduler.requests``: the live dict of every request the scheduler holds (the object
    itself, so a caller may keep it and see later changes)."""
    return scheduler.requests  # type: ignore[no-any-return]


def running_request_ids(scheduler: Any) -> list[str]:
    """Ids in ``Scheduler.running``, in order."""
    return [r.request_id for r in scheduler.running]


def num_waiting(scheduler: Any) -> int:
    """``len(Scheduler.waiting)`` (a request queue)."""
    return len(scheduler.waiting)


def pending_finished_ids(scheduler: Any) -> set[str]:
    """``Scheduler.finished_req_ids``: ids finished since the last ``schedule()``, which the
    next ``SchedulerOutput`` tells the worker to drop."""
    return set(scheduler.finished_req_ids)


def resend_finished_ids(scheduler: Any, failed_steps: Iterable[SchedulerOutput]) -> None:
    """Put the ``SchedulerOutput.finished_req_ids`` of steps that may never have reached the
    worker back into ``Scheduler.finished_req_ids``, so the next step sends them again (the
    runner drops an unknown id as a no-op)."""
    for so in failed_steps:
        scheduler.finished_req_ids.update(so.finished_req_ids)


def num_free_blocks(scheduler: Any) -> int:
    """Free KV blocks: ``Scheduler.kv_cache_manager.block_pool.get_num_free_blocks()``."""
    return int(scheduler.kv_cache_manager.block_pool.get_num_free_blocks())


# ---- a stage engine in its own process (``engine.mp_stage``) ---------------------------------


class OmniSyncMPClient(SyncMPClient):
    """vLLM's ``SyncMPClient`` (the client ``vllm.LLM`` uses) decoding the omni output type.

    ``MPClient.__init__`` assigns ``self.decoder = MsgpackDecoder(EngineCoreOutputs)`` and
    ``SyncMPClient.__init__`` hands that object to its output thread; msgspec would drop the
    trailing omni fields on that type. ``decoder`` is therefore a property here: vLLM's
    assignment is ignored and the thread gets a decoder of ``outputs_type`` (a trailing-field
    subclass of ``EngineCoreOutputs``) that also calls ``on_message`` after each decode (to
    wake a waiting orchestrator without polling). Its engine process executes with
    ``FaultContainingExecutor``.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        outputs_type: type[EngineCoreOutputs],
        on_message: Callable[[], None] | None = None,
    ) -> None:
        self._omni_decoder = _NotifyingDecoder(outputs_type, on_message)
        # The engine process runs vLLM's uni executor, containing step faults as in process.
        super().__init__(vllm_config, FaultContainingExecutor, log_stats=False)

    @property  # type: ignore[override]
    def decoder(self) -> MsgpackDecoder:
        return self._omni_decoder

    @decoder.setter
    def decoder(self, value: MsgpackDecoder) -> None:
        # vLLM's own ``MsgpackDecoder(EngineCoreOutputs)``: replaced by ours (class docstring).
        pass


class _NotifyingDecoder(MsgpackDecoder):
    def __init__(self, t: type, on_message: Callable[[], None] | None) -> None:
        super().__init__(t)
        self._on_message = on_message

    def decode(self, bufs: Any) -> Any:
        out = super().decode(bufs)
        if self._on_message is not None:
            self._on_message()
        return out


def client_outputs_queue(client: SyncMPClient) -> Any:
    """``SyncMPClient.outputs_queue``: the ``queue.Queue`` the client's output thread fills with
    decoded ``EngineCoreOutputs`` (or the exception that stopped it); read without blocking."""
    return client.outputs_queue


def client_engine_dead(client: SyncMPClient) -> bool:
    """``MPClient.resources.engine_dead``: set by vLLM's monitor thread when the engine process
    exits unexpectedly, or when its output thread received ``ENGINE_CORE_DEAD``."""
    return bool(client.resources.engine_dead)


def client_processes(client: SyncMPClient) -> list[Any]:
    """The engine's ``multiprocessing.Process`` objects:
    ``MPClient.resources.engine_manager.processes`` (empty once the manager is gone)."""
    manager = client.resources.engine_manager
    return list(getattr(manager, "processes", None) or [])


def call_child_scheduler_nowait(client: SyncMPClient, *args: Any) -> Future[Any]:
    """``call_child_scheduler`` without waiting for the answer: ``SyncMPClient.call_utility``'s
    own two steps (a ``Future`` registered in ``MPClient.utility_results`` under a fresh call
    id, which the output thread resolves, then ``SyncMPClient._send_input`` of the UTILITY
    message), returning the future instead of blocking on it."""
    call_id = uuid.uuid1().int >> 64
    future: Future[Any] = Future()
    client.utility_results[call_id] = future
    client._send_input(EngineCoreRequestType.UTILITY, (0, call_id, "scheduler", args))
    return future


def call_child_scheduler(client: SyncMPClient, *args: Any) -> Any:
    """Call the scheduler object inside the engine process and return its result.

    vLLM's utility path (``SyncMPClient.call_utility(name, *args)``) runs, in the engine
    process, ``getattr(engine_core, name)(*args)``; ``EngineCore.scheduler`` is our scheduler
    instance, which answers when called (``sched.process_stage.ProcessStageScheduler``).
    """
    return client.call_utility("scheduler", *args)
