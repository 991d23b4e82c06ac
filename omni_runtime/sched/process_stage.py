"""The omni schedulers as they run inside a stage process (``engine.mp_stage``).

``ProcessStageScheduler`` / ``ProcessStageAsyncScheduler`` are ``OmniARScheduler`` /
``OmniARAsyncScheduler`` plus what only a stage in its own process needs; every decision
(admission, transfer, EOF, errors) is still the parent classes' code:

* ``add_request`` attaches the omni slot the parent put in ``SamplingParams.extra_args``
  (``attach_slot_from_extra_args``, C-10) and stages the request until the parent's
  ``"release"``, so batch shapes do not depend on timing;
* the transfer adapter's sink is a ``ShmChunkWriter``: each update's chunks leave on the step's
  own message (``ShmEngineCoreOutputs.omni_chunks``); the EOFs of aborts are dropped here;
* calling the scheduler answers the parent: ``"release"`` and ``"audit"``.

The shared-memory prefix comes from ``additional_config["omni_process_stage"]``. Why and how:
docs/design.md, "A stage in its own process, or on another machine".
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from omni_runtime.adapters.input import attach_slot_from_extra_args
from omni_runtime.adapters.shm_wire import ChunkDescriptor, ShmChunkWriter, ShmEngineCoreOutputs
from omni_runtime.sched.scheduler import OmniARAsyncScheduler, OmniARScheduler

__all__ = [
    "PARENT_CLIENT",
    "PROCESS_STAGE_KEY",
    "ProcessStageAsyncScheduler",
    "ProcessStageScheduler",
]

PROCESS_STAGE_KEY = "omni_process_stage"
# The client index of every request in a stage process: its engine's one client (its one
# output socket) is the parent's ``MPStageEngine``.
PARENT_CLIENT = 0


class ProcessStageScheduler(OmniARScheduler):
    """``OmniARScheduler`` inside a stage process; see the module docstring."""

    writer: ShmChunkWriter | None = None
    _in_step_update: bool = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        additional: Any = self.vllm_config.additional_config or {}
        extra = additional.get(PROCESS_STAGE_KEY) or {}
        self.writer = None
        self._in_step_update = False
        # Admitted by the parent, not yet released into upstream's queue (arrival order).
        self._staged: dict[str, Request] = {}
        if self.transfer is not None:
            prefix = str(extra.get("shm_prefix") or f"omni-{self.transfer.stage_id}")
            self.writer = ShmChunkWriter(prefix)
            self.transfer.sink = self.writer

    def add_request(self, request: Request) -> None:
        attach_slot_from_extra_args(request)
        self._staged[request.request_id] = request

    def _release(self) -> int:
        staged, self._staged = self._staged, {}
        for request in staged.values():
            super().add_request(request)
        return len(staged)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        self._in_step_update = True
        try:
            outputs = super().update_from_output(scheduler_output, model_runner_output)
        finally:
            self._in_step_update = False
        if self.writer is None or not len(self.writer):
            return outputs
        return _with_chunks(outputs, self.writer.flush())

    def finish_requests(self, request_ids: Any, finished_status: RequestStatus) -> list[Request]:
        # An abort can reach a request that is still staged: it never entered upstream's queue.
        if request_ids is None:
            self._staged.clear()
        else:
            for rid in [request_ids] if isinstance(request_ids, str) else list(request_ids):
                self._staged.pop(rid, None)
        finished = super().finish_requests(request_ids, finished_status)
        if self.writer is not None and not self._in_step_update:
            self.writer.discard()
        return finished

    def __call__(self, query: str) -> Any:
        """The parent's calls: ``"release"`` (admit the staged requests; how many) and
        ``"audit"`` (everything that still holds a request)."""
        if query == "release":
            return self._release()
        if query != "audit":
            raise ValueError(f"unknown query {query!r}")
        transfer = self.transfer
        processor = transfer.processor if transfer is not None else None
        pending = getattr(processor, "pending_request_ids", None)
        return {
            "staged": sorted(self._staged),
            "scheduler_requests": sorted(self.requests),
            "running": [r.request_id for r in self.running],
            "waiting": len(self.waiting),
            "finished_unsent": sorted(self.finished_req_ids),
            "free_blocks": int(self.kv_cache_manager.block_pool.get_num_free_blocks()),
            "transfer_progress": sorted(transfer.progress) if transfer is not None else [],
            "processor_buffers": sorted(pending()) if callable(pending) else [],
            "outbox": len(self.writer) if self.writer is not None else 0,
        }


class ProcessStageAsyncScheduler(ProcessStageScheduler, OmniARAsyncScheduler):
    """``OmniARAsyncScheduler`` inside a stage process."""


def _with_chunks(
    outputs: dict[int, EngineCoreOutputs], descriptors: list[ChunkDescriptor]
) -> dict[int, EngineCoreOutputs]:
    """The step's outputs with the chunk descriptors on one message (this stage's one client)."""
    client = next(iter(outputs), 0)
    eco = outputs.get(client)
    fields = {} if eco is None else {n: getattr(eco, n) for n in eco.__struct_fields__}
    fields["outputs"] = list(fields.get("outputs", ()))
    fields["omni_chunks"] = descriptors
    rebuilt = dict(outputs)
    rebuilt[client] = ShmEngineCoreOutputs(**fields)
    return rebuilt
