"""Drivers: how one scheduler is stepped, exactly as vLLM's ``EngineCore`` steps it.

``SyncDriver`` mirrors ``EngineCore.step``: schedule, execute, update. ``AsyncDriver`` mirrors
``EngineCore.step_with_batch_queue`` with a queue of ``max_concurrent_batches`` (2 for async
scheduling): it schedules and submits a new batch while the queue has room, and only updates the
scheduler from the oldest batch when the queue is full or nothing more can be scheduled. Aborts
and other operations happen between driver steps, which is where ``EngineCore`` processes them.

An executor turns a ``SchedulerOutput`` into a ``ModelRunnerOutput``: the deterministic token
source, or a real worker (anything with ``execute_model``/``sample_tokens``) via
``WorkerExecutor``. Executors run at submission time, in submission order, as a worker does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from conformance.observe import observe_schedule


class Executor(Protocol):
    def execute(self, so: Any) -> Any: ...


class WorkerExecutor:
    """Drives a ``WorkerBase``-like object the way the uni executor does."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def execute(self, so: Any) -> Any:
        out = self.worker.execute_model(so)
        if out is None:
            out = self.worker.sample_tokens(None)
        get_output = getattr(out, "get_output", None)
        return get_output() if get_output is not None else out


@dataclass
class StepObservation:
    scheduled: dict[str, Any] | None
    outputs: dict[int, Any] | None
    updated: bool


class SyncDriver:
    mode = "sync"

    def __init__(self, scheduler: Any, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor

    def step(self) -> StepObservation:
        sched = self.scheduler
        if not sched.has_requests():
            return StepObservation(None, None, False)
        so = sched.schedule()
        scheduled = observe_schedule(so)
        mro = self.executor.execute(so)
        return StepObservation(scheduled, sched.update_from_output(so, mro), True)

    def in_flight(self) -> int:
        return 0


class AsyncDriver:
    mode = "async"

    def __init__(self, scheduler: Any, executor: Executor, depth: int | None = None) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.depth = depth or max(2, scheduler.vllm_config.max_concurrent_batches)
        self.queue: deque[tuple[Any, Any]] = deque()

    def step(self) -> StepObservation:
        sched = self.scheduler
        scheduled = None
        if sched.has_requests():
            so = sched.schedule()
            scheduled = observe_schedule(so)
            mro = self.executor.execute(so)
            executed = so.total_num_scheduled_tokens > 0
            self.queue.appendleft((so, mro))
            if len(self.queue) < self.depth and (executed or sched.has_requests()):
                return StepObservation(scheduled, None, False)
        elif not self.queue:
            return StepObservation(None, None, False)
        so, mro = self.queue.pop()
        return StepObservation(scheduled, sched.update_from_output(so, mro), True)

    def in_flight(self) -> int:
        return len(self.queue)


def make_driver(scheduler: Any, executor: Executor) -> SyncDriver | AsyncDriver:
    if scheduler.vllm_config.max_concurrent_batches > 1:
        return AsyncDriver(scheduler, executor)
    return SyncDriver(scheduler, executor)
