"""``OmniARScheduler`` and ``OmniARAsyncScheduler``: vLLM's v1 schedulers, extended for omni stages.

Every upstream transition (queues, statuses, computed tokens, blocks, prefix caching,
preemption, stop handling, async placeholders) is upstream's code, reached through ``super()``
(AR-INV-001). After upstream's pass these classes add only: the chunk-transfer decision for the
step's requests, in one call to ``sched.transfer`` (C-40..C-45); the EOF of requests that leave
outside a model step (C-43); omni fields on ``EngineCoreOutput`` for requests whose step sent a
chunk (``omni_runtime.payload``); and failing only the requests whose processor or connector
raised or on which the worker pinned a step fault (``OmniModelRunnerOutput.omni_failed``, C-61).
With no ``omni_stage``, or no downstream, ``update_from_output`` is upstream's call alone.

See docs/design.md, "One stage step" and "Inside the layers"; every difference from upstream is
declared in ``omni_runtime/differences.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from operator import attrgetter
from typing import Any

import msgspec
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from omni_runtime.adapters.input import OmniRequestState, omni_state_of
from omni_runtime.adapters.output import payloads_by_request
from omni_runtime.config import OmniStageConfig
from omni_runtime.payload import (
    OmniEngineCoreOutput,
    OmniEngineCoreOutputs,
    StageChunk,
    omni_output_from,
)
from omni_runtime.sched.transfer import ChunkTransferAdapter, load_processor

_request_id = attrgetter("request_id")


class OmniARScheduler(Scheduler):
    """vLLM's ``Scheduler`` plus the omni chunk-transfer decision; see the module docstring."""

    # Class-level defaults for what ``__init__`` sets: vLLM's own tests (0.33.0's
    # ``test_abort_request_when_structured_output_fsm_cannot_advance``) and tools build a
    # scheduler with ``object.__new__`` and set upstream's attributes by hand. Such a scheduler
    # has no omni stage, so it must behave as upstream's does, not raise AttributeError.
    omni_stage: OmniStageConfig | None = None
    transfer: ChunkTransferAdapter | None = None
    _in_update: bool = False
    _last_failed: AbstractSet[str] = frozenset()
    _dropping: dict[str, Request] = {}  # never written: instances get their own in __init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.omni_stage = OmniStageConfig.from_vllm_config(self.vllm_config)
        self.transfer = None
        if self.omni_stage is not None and self.omni_stage.has_downstream:
            self.transfer = ChunkTransferAdapter(
                self.omni_stage.stage_id, load_processor(self.omni_stage.chunk_processor)
            )
        # Omni slots of requests freed during the current update_from_output, whose terminal
        # delivery is decided after upstream has finished its pass.
        self._freed_in_update: dict[str, tuple[OmniRequestState, str]] = {}
        self._in_update = False
        # Ids failed by the send path in the most recent update or finish call: per-step facts
        # for audits (OMNI-ERR-001's condition), never per-request state kept past the step.
        self._last_failed = set()
        # Requests whose in-flight output upstream will drop as stale, by id: see _mark_dropping.
        self._dropping = {}

    # ---- request lifecycle -------------------------------------------------------------

    def _free_request(self, request: Request, delay_free_blocks: bool = False) -> Any:
        result = super()._free_request(request, delay_free_blocks)
        if self._dropping:
            self._dropping.pop(request.request_id, None)
        if self.transfer is not None:
            state = omni_state_of(request)
            if state is not None and state.has_downstream:
                reason = str(request.get_finished_reason())
                if self._in_update:
                    self._freed_in_update[request.request_id] = (state, reason)
                else:
                    self.transfer.on_terminated(request.request_id, state, reason)
        return result

    # Upstream drops a step's output as stale (``update_from_output``: a positive
    # ``num_stale_output_tokens`` with ``drop_stale_output`` set) only for requests it marked so
    # in one of these two transitions: a preemption in drop mode (a prefix-cache reset, a KV
    # hand-off pending) or the stop of a resumable request with steps in flight. Noting them here
    # lets each update find the dropped steps among a handful of requests instead of scanning
    # every held one (~35 us at 1,024 requests, a third of the transfer pass).
    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super()._preempt_request(request, *args, **kwargs)
        self._mark_dropping(request)

    def _handle_stopped_request(self, request: Request) -> bool:
        finished = super()._handle_stopped_request(request)
        self._mark_dropping(request)
        return finished

    def _mark_dropping(self, request: Request) -> None:
        if (
            self.transfer is not None
            and request.drop_stale_output
            and request.num_stale_output_tokens > 0
        ):
            self._dropping[request.request_id] = request

    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> list[Request]:
        finished = super().finish_requests(request_ids, finished_status)
        if self.transfer is not None and not self._in_update:
            self._fail_requests_of(self.transfer.take_failures())
        return finished

    # ---- the step ----------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        pinned = getattr(model_runner_output, "omni_failed", None)
        errored = self.fail_unwritten(pinned) if pinned else []
        outputs = self._update_with_transfer(scheduler_output, model_runner_output)
        return self._report_errors(outputs, errored) if errored else outputs

    def _update_with_transfer(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        transfer = self.transfer
        if transfer is None:
            return super().update_from_output(scheduler_output, model_runner_output)
        self._last_failed = set()

        # Steps upstream is about to drop as stale: their payload must be dropped too. Read
        # before upstream's pass, which drains the stale counts. Everything else the decision
        # needs is known after the pass: an emitted output means the request was live before
        # it, and the slot of one upstream frees is captured at the free (C-42).
        scheduled = scheduler_output.num_scheduled_tokens
        dropped: set[str] = set()
        dropping = self._dropping
        if dropping:
            requests = self.requests
            dropped = {
                rid
                for rid, request in dropping.items()
                if rid in scheduled
                and requests.get(rid) is request
                and request.num_stale_output_tokens > 0
                and request.drop_stale_output
            }

        self._in_update = True
        try:
            outputs = super().update_from_output(scheduler_output, model_runner_output)
        finally:
            self._in_update = False
        if dropping:  # forget those whose stale share is drained (marked again if re-stale)
            for rid in [r for r, q in dropping.items() if not q.num_stale_output_tokens]:
                del dropping[rid]
        freed = self._freed_in_update
        if not scheduled and not freed:
            return outputs

        payloads = payloads_by_request(model_runner_output)
        aligned = _aligned_outputs(scheduled, outputs)
        if aligned is not None:
            sent = transfer.on_aligned_steps(*aligned, payloads, freed, dropped, self._live_slot)
        else:
            sent = transfer.on_steps(
                _with_outputs(scheduled, outputs), payloads, freed, dropped, self._live_slot
            )
        freed.clear()

        failures = transfer.take_failures()
        if sent:
            outputs = self._attach_chunk_refs(outputs, sent)
        if failures:
            self._fail_requests_of(failures, outputs)
        return outputs

    def _live_slot(self, request_id: str) -> OmniRequestState | None:
        """The omni slot of a request that is live (known and not finished), else None."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished():
            return None
        return omni_state_of(request)

    def fail_unwritten(self, causes: dict[str, str]) -> list[tuple[Request, str]]:
        """Finish, with an error reason, live requests whose scheduled step never wrote its KV:
        those the worker pinned a fault on (called before upstream's pass over the step, which
        skips finished requests, as for an abort that lands while a step executes), and those
        of a step that raised out of the engine (``engine.stage``). Their blocks leave the
        prefix cache: vLLM hashed them when it scheduled the step (C-61: no hit on KV that does
        not exist). Blocks other requests share stay allocated. Returns (request, cause) pairs.
        """
        live = [rid for rid in causes if rid in self.requests]
        if not live:
            return []
        kv = self.kv_cache_manager
        suspect: set[int] = set()
        for rid in live:
            for group in kv.get_block_ids(rid):
                suspect.update(group)
        finished = self.finish_requests(live, RequestStatus.FINISHED_ERROR)
        if suspect:
            kv.evict_blocks(suspect)
        return [(request, causes[request.request_id]) for request in finished]

    @staticmethod
    def _report_errors(
        outputs: dict[int, EngineCoreOutputs], errored: list[tuple[Request, str]]
    ) -> dict[int, EngineCoreOutputs]:
        """Give each request failed outside upstream's pass its one terminal output (C-62),
        with the cause on ``omni_error``."""
        for request, cause in errored:
            client = request.client_index
            eco = outputs.get(client)
            if not isinstance(eco, OmniEngineCoreOutputs):
                eco = outputs[client] = (
                    OmniEngineCoreOutputs() if eco is None else _omni_outputs(eco, eco.outputs)
                )
            eco.outputs.append(
                OmniEngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.get_finished_reason(),
                    trace_headers=request.trace_headers,
                    omni_error=cause,
                )
            )
        return outputs

    @staticmethod
    def _attach_chunk_refs(
        outputs: dict[int, EngineCoreOutputs], sent: dict[str, StageChunk]
    ) -> dict[int, EngineCoreOutputs]:
        """``outputs`` with each output of a request in ``sent`` in its omni form, carrying the
        chunk's ref; a client's container is rebuilt only when one of its outputs changed."""
        rebuilt: dict[int, EngineCoreOutputs] = {}
        for client, eco in outputs.items():
            if sent.keys().isdisjoint(map(_request_id, eco.outputs)):
                rebuilt[client] = eco
                continue
            new_outputs = []
            for out in eco.outputs:
                chunk = sent.get(out.request_id)
                new_outputs.append(
                    out if chunk is None else omni_output_from(out, [chunk.ref], chunk.is_final)
                )
            rebuilt[client] = _omni_outputs(eco, new_outputs)
        return rebuilt

    def _fail_requests_of(
        self,
        failures: dict[str, BaseException],
        outputs: dict[int, EngineCoreOutputs] | None = None,
    ) -> dict[int, EngineCoreOutputs] | None:
        """Finish, with an error reason, the requests whose processor or connector raised (C-61).

        A live request is finished as upstream finishes any errored request (its EOF, with the
        processor given the chance to release its buffers, goes out through ``_free_request``).
        One that already ended on this very step (its terminal delivery is what failed) keeps the
        bare EOF the adapter sent, and its output's finish reason becomes an error.
        """
        assert self.transfer is not None
        if not failures:
            return outputs
        self._last_failed = set(failures)
        stage = self.omni_stage.stage_id if self.omni_stage is not None else "?"
        causes = {
            rid: f"{stage}: send path: {type(e).__name__}: {e}" for rid, e in failures.items()
        }
        live = [rid for rid in failures if rid in self.requests]
        errored = super().finish_requests(live, RequestStatus.FINISHED_ERROR)
        # The error EOF itself may fail on a broken connector; it is not retried.
        self.transfer.take_failures()
        if outputs is None:
            return None
        outputs = self._report_errors(outputs, [(r, causes[r.request_id]) for r in errored])
        ended = set(failures) - set(live)
        for client, eco in list(outputs.items()):
            if ended.isdisjoint(out.request_id for out in eco.outputs):
                continue
            if not isinstance(eco, OmniEngineCoreOutputs):
                eco = outputs[client] = _omni_outputs(eco, eco.outputs)
            for i, out in enumerate(eco.outputs):
                if out.request_id in ended and out.finish_reason is not None:
                    if not isinstance(out, OmniEngineCoreOutput):
                        out = omni_output_from(out, None, False)
                    eco.outputs[i] = msgspec.structs.replace(
                        out, finish_reason=FinishReason.ERROR, omni_error=causes[out.request_id]
                    )
        return outputs

    # ---- introspection for audits ------------------------------------------------------

    def omni_failed_request_ids(self) -> set[str]:
        """Requests the send path failed in the most recent update or finish call (C-61)."""
        return set(self._last_failed)

    def omni_request_ids(self) -> set[str]:
        """Ids that any omni per-request structure still holds (C-04: empty once all are gone)."""
        if self.transfer is None:
            return set()
        return self.transfer.live_request_ids() | self._dropping.keys()


def _aligned_outputs(
    scheduled: Mapping[str, int], outputs: dict[int, EngineCoreOutputs]
) -> tuple[list[str], list[EngineCoreOutput]] | None:
    """The scheduled ids and the step's outputs, when there is one client whose outputs are
    exactly the scheduled requests in order (every request emitted once, as in steady decode):
    they pair as they are, without a lookup per request. Else None."""
    if len(outputs) != 1:
        return None
    (eco,) = outputs.values()
    ids = list(scheduled)
    return (ids, eco.outputs) if list(map(_request_id, eco.outputs)) == ids else None


def _with_outputs(
    scheduled: Mapping[str, int], outputs: dict[int, EngineCoreOutputs]
) -> Iterable[tuple[str, EngineCoreOutput | None]]:
    """Each scheduled request id, in scheduler order, with its output of the step (None when it
    emitted none; the last one when it emitted two, a step and then an error)."""
    emitted = {out.request_id: out for eco in outputs.values() for out in eco.outputs}
    return zip(scheduled, map(emitted.get, scheduled), strict=True)


def _omni_outputs(eco: EngineCoreOutputs, outputs: list[Any]) -> OmniEngineCoreOutputs:
    """``eco`` as the omni container (whose element type carries the trailing omni fields),
    holding ``outputs`` (a new list: the caller may append to it)."""
    fields = {name: getattr(eco, name) for name in eco.__struct_fields__}
    fields["outputs"] = list(outputs)
    return OmniEngineCoreOutputs(**fields)


class OmniARAsyncScheduler(OmniARScheduler, AsyncScheduler):
    """The omni scheduler with vLLM's async (batch-queue) placeholders and ordering."""
