"""Drivers: how one scheduler is stepped, exactly as vLLM's ``EngineCore`` steps it.

``SyncDriver`` mirrors ``EngineCore.step``: schedule, execute, update. ``AsyncDriver`` mirrors
``EngineCore.step_with_batch_queue`` with a queue of ``max_concurrent_batches`` (2 for async
scheduling): it schedules and submits a new batch while the queue has room, and only updates the
scheduler from the oldest batch when the queue is full or nothing more can be scheduled. Aborts
and other operations happen between driver steps, which is where ``EngineCore`` processes them.

An executor turns a ``SchedulerOutput`` into a ``ModelRunnerOutput``: the deterministic token
source, or a real worker (anything with ``execute_model``/``sample_tokens``) via
``WorkerExecutor``. Executors run at submission time, in submission order, as a worker does.
An executor may also ``submit`` a step: its output is then collected only when the driver needs
it (``collect``), as vLLM's uni executor resolves a worker's ``AsyncModelRunnerOutput`` only when
``EngineCore`` takes the batch's future off its queue. Under async scheduling a worker therefore
finishes step N+1 before step N's output is collected, as it does in vLLM.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from conformance._core import vllm_compat as vc
from conformance._core.observe import observe_schedule

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.outputs import ModelRunnerOutput


class Executor(Protocol):
    # Optional: ``receive_grammar(grammar_output)``, the bitmask the next step samples under.
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput: ...


def collect(out: Any) -> ModelRunnerOutput:
    """A step's output as the engine reads it: an uncollected output (anything with
    ``get_output``, vLLM's ``AsyncModelRunnerOutput`` or a ``Deferred``) is resolved now."""
    get_output = getattr(out, "get_output", None)
    return get_output() if get_output is not None else out


def submit(executor: Executor, so: SchedulerOutput, grammar: GrammarOutput | None = None) -> object:
    """Run ``so`` on ``executor``, leaving its output uncollected where the executor can; a
    step with structured requests samples under ``grammar`` (``get_grammar_bitmask``'s), which
    the executor receives first (``receive_grammar``; wrappers pass it on as any attribute)."""
    receive = getattr(executor, "receive_grammar", None)
    if grammar is not None and receive is not None:
        receive(grammar)
    method = getattr(executor, "submit", None)
    return method(so) if method is not None else executor.execute(so)


def grammar_output(sched: Scheduler, so: SchedulerOutput, scheduled: dict[str, Any]) -> Any:
    """``EngineCore``'s ``get_grammar_bitmask`` before sampling ``so``; its facts (and the
    step's other grammar facts) join the step's observed ``scheduled``."""
    grammar = sched.get_grammar_bitmask(so)
    scheduled.update(vc.grammar_fields(so, grammar))
    return grammar


class Deferred:
    """An output that ``resolve`` produces when it is collected (once)."""

    def __init__(self, resolve: Callable[[], ModelRunnerOutput]) -> None:
        self._resolve: Callable[[], ModelRunnerOutput] | None = resolve
        self._value: ModelRunnerOutput | None = None

    def get_output(self) -> ModelRunnerOutput | None:
        if self._resolve is not None:
            resolve, self._resolve = self._resolve, None
            self._value = resolve()
        return self._value


class WorkerExecutor:
    """Drives a ``WorkerBase``-like object the way the uni executor does."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self._grammar: GrammarOutput | None = None

    def receive_grammar(self, grammar: GrammarOutput) -> None:
        """The grammar output the next step samples under."""
        self._grammar = grammar

    def submit(self, so: SchedulerOutput) -> object:
        """Execute and sample; the output is returned as the worker gave it (an async output
        stays uncollected, like the uni executor's non-blocking future)."""
        grammar, self._grammar = self._grammar, None
        out = self.worker.execute_model(so)
        if out is None:
            out = self.worker.sample_tokens(grammar)
        return out

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return collect(self.submit(so))


@dataclass
class StepObservation:
    scheduled: dict[str, Any] | None
    outputs: dict[int, EngineCoreOutputs] | None
    updated: bool


def post_step_drafts(sched: Scheduler, executor: Executor) -> None:
    """``EngineCore.post_step`` of a sync scheduler after a step that ran the model: the
    drafts for the next step, taken from the executor after the update."""
    if sched.vllm_config.speculative_config is None:
        return
    take = getattr(executor, "take_draft_token_ids", None)
    drafts = take() if take is not None else None
    if drafts is not None:
        sched.update_draft_token_ids(drafts)


class SyncDriver:
    mode = "sync"

    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor

    def step(self) -> StepObservation:
        sched = self.scheduler
        if not sched.has_requests():
            return StepObservation(None, None, False)
        vc.settle_grammars(sched)
        so = sched.schedule()
        scheduled = observe_schedule(so)
        grammar = grammar_output(sched, so, scheduled)
        mro = collect(submit(self.executor, so, grammar))
        outputs = sched.update_from_output(so, mro)
        if so.total_num_scheduled_tokens:
            post_step_drafts(sched, self.executor)
        return StepObservation(scheduled, outputs, True)

    def in_flight(self) -> int:
        return 0


class AsyncDriver:
    """The batch queue: async scheduling, pipeline parallelism (a sync scheduler with
    ``pipeline_parallel_size`` steps in flight, mode ``pipelined``), or both."""

    def __init__(self, scheduler: Scheduler, executor: Executor, depth: int | None = None) -> None:
        async_ = bool(scheduler.vllm_config.scheduler_config.async_scheduling)
        self.mode = "async" if async_ else "pipelined"
        self.scheduler = scheduler
        self.executor = executor
        self.depth = depth or max(2, scheduler.vllm_config.max_concurrent_batches)
        self.queue: deque[tuple[SchedulerOutput, object]] = deque()

    def step(self) -> StepObservation:
        observed, executed = self._step()
        if self.mode == "pipelined" and executed:
            # ``EngineCore.post_step`` after the batch queue's step: a sync scheduler takes the
            # drafts then (an async one never: its runner keeps them).
            post_step_drafts(self.scheduler, self.executor)
        return observed

    def _step(self) -> tuple[StepObservation, bool]:
        """One batch-queue step, and whether it submitted a batch that ran the model."""
        sched = self.scheduler
        scheduled = None
        deferred = None
        executed = False
        if sched.has_requests():
            vc.settle_grammars(sched)
            so = sched.schedule()
            scheduled = observe_schedule(so)
            executed = so.total_num_scheduled_tokens > 0
            if executed and vc.defers_sampling(so):
                # A structured request's grammar still lacks the tokens of the step in flight:
                # ``EngineCore`` samples this one after processing that step's output.
                deferred = so
            else:
                # Collected when the batch leaves the queue (``EngineCore.step_with_batch_queue``
                # calls the future's ``result()`` there), not now.
                grammar = grammar_output(sched, so, scheduled) if executed else None
                self.queue.appendleft((so, submit(self.executor, so, grammar)))
                if len(self.queue) < self.depth and (executed or sched.has_requests()):
                    return StepObservation(scheduled, None, False), executed
        elif not self.queue:
            return StepObservation(None, None, False), executed
        so, pending = self.queue.pop()
        mro = collect(pending)
        outputs = sched.update_from_output(so, mro)
        if deferred is not None:
            assert scheduled is not None
            self._sample_deferred(deferred, scheduled)
        return StepObservation(scheduled, outputs, True), executed

    def _sample_deferred(self, so: SchedulerOutput, scheduled: dict[str, Any]) -> None:
        """``step_with_batch_queue``'s deferred sampling: the drafts the runner proposed meanwhile
        are checked against the grammars (invalid ones become placeholders), then the step is
        sampled under the bitmask and queued."""
        sched = self.scheduler
        take = getattr(self.executor, "take_draft_token_ids", None)
        if sched.vllm_config.speculative_config is not None and take is not None:
            drafts = take()
            if drafts is not None:
                sched.update_draft_token_ids_in_output(drafts, so)
        grammar = grammar_output(sched, so, scheduled)
        self.queue.appendleft((so, submit(self.executor, so, grammar)))

    def in_flight(self) -> int:
        return len(self.queue)


def make_driver(scheduler: Scheduler, executor: Executor) -> SyncDriver | AsyncDriver:
    if scheduler.vllm_config.max_concurrent_batches > 1:
        return AsyncDriver(scheduler, executor)
    return SyncDriver(scheduler, executor)
