"""One side of a lock-step session in this process: a subject's scheduler, driver and executor,
and the questions a session asks of it between operations (``Side``, built by ``make_side``).
The oracle process (``oracle_process``) serves the same sides to a parent across a pipe."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from conformance._core import vllm_compat as vc
from conformance._core.config import HarnessConfig
from conformance._core.driver import AsyncDriver, Executor, SyncDriver, WorkerExecutor, make_driver
from conformance._core.ec_connectors import runner_report
from conformance._core.harness_faults import HarnessError, forget_pending, raise_pending
from conformance._core.observe import Observation
from conformance._core.subjects import Subject
from conformance._core.tokens import DeterministicTokenSource
from conformance._core.vllm_compat.aux_outputs import runner_flavour
from conformance._core.workload import (
    Abort,
    AddRequest,
    ChunkArrives,
    DeliverChunks,
    Op,
    Pause,
    ResetEncoderCache,
    ResetPrefixCache,
    Shutdown,
    Step,
)

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler


class ClientNotCarried(Exception):
    """The subject built a request for another client than the operation's: its
    ``make_request`` hook, or the input adapter behind it, did not carry ``op.client_index``."""


@dataclass
class Side:
    """One side of a session in this process: a subject's scheduler, driver and executor.

    ``apply`` runs one operation and returns the snapshot; the remaining methods answer what the
    session asks of a side between operations. ``conformance._core.oracle_process.ProcessSide`` answers
    the same questions for an oracle that runs in another process.
    """

    subject: Subject
    scheduler: Scheduler
    driver: SyncDriver | AsyncDriver
    executor: Executor
    chunks: list[Any] = field(default_factory=list)
    # The state each id of the last ``Abort`` was in just before it applied (``abort_state``).
    last_abort_states: dict[str, str] = field(default_factory=dict)
    # The observation of the last operation: expired when the next one runs (its snapshot, if
    # never built, would read the later state).
    last_observation: Observation | None = None
    # The harness's own code (the token source) raised during the last operation: the
    # ``HarnessError``, its cause also observed as the side's exception (``Lockstep.apply``).
    harness_error: HarnessError | None = None

    @property
    def mode(self) -> str:
        return self.driver.mode

    def apply(self, op: Op, prompt: list[int] | None, cfg: HarnessConfig, arrival: float) -> dict:
        """Run one operation; its snapshot."""
        return self.observe(op, prompt, cfg, arrival).snapshot()

    def observe(
        self, op: Op, prompt: list[int] | None, cfg: HarnessConfig, arrival: float
    ) -> Observation:
        """Run one operation; its observation (the snapshot is built when asked for)."""
        if self.last_observation is not None:
            self.last_observation.expire()
        self.harness_error = None
        sched = self.scheduler
        extra: dict[str, Any] = {}
        outputs = None
        if isinstance(op, Abort):
            self.last_abort_states = {rid: self.abort_state(rid) for rid in op.request_ids}
        try:
            if isinstance(op, Step):
                obs = self.driver.step()
                extra["sched_out"] = obs.scheduled
                extra["outputs"] = None  # normalised from ``outputs`` with the snapshot
                # What the engine's caller receives (a subject whose outputs cross a process
                # boundary decodes them here), so that is what is compared.
                outputs = self.subject.receive_outputs(sched, obs.outputs)
                finished = vc.finished_sets(outputs)
                if finished:  # a data-parallel rank's only: other snapshots are unchanged
                    extra["finished_sets"] = finished
                extra["updated"] = obs.updated
                if cfg.log_stats:
                    extra["stats"] = vc.scheduler_stats(outputs)
            elif isinstance(op, AddRequest):
                assert prompt is not None
                request = self.subject.make_request(op, prompt, cfg, sched, arrival)
                self.subject.admit(sched, request)
                client = getattr(request, "client_index", op.client_index)
                if client != op.client_index:
                    # Said here, in the hook's terms (after the admission, so that this is the
                    # step's first difference): as an output difference it would read as the
                    # scheduler misrouting outputs, which it may not be doing.
                    raise ClientNotCarried(
                        f"make_request built request {op.request_id} for client {client}, not "
                        f"{op.client_index}: the subject's hook (and its input adapter) must "
                        "carry op.client_index as the engine carries EngineCoreRequest.client_index"
                    )
            elif isinstance(op, Abort):
                from vllm.v1.request import RequestStatus

                sched.finish_requests(list(op.request_ids), RequestStatus.FINISHED_ABORTED)
            elif isinstance(op, ResetPrefixCache):
                extra["result"] = sched.reset_prefix_cache(
                    op.reset_running_requests, op.reset_connector
                )
            elif isinstance(op, Pause):
                vc.set_pause(sched, op.state)
            elif isinstance(op, ResetEncoderCache):
                sched.reset_encoder_cache()
            elif isinstance(op, DeliverChunks):
                self.chunks.extend(self.subject.drain_chunks(sched))
            elif isinstance(op, Shutdown):
                sched.shutdown()
                extra["result"] = vc.shut_down_parts(sched)
            elif isinstance(op, ChunkArrives):
                receiving = self.subject.receiving_stage()
                if receiving is not None:
                    receiving.arrive(sched, op.request_id, op.final)
            else:  # pragma: no cover - the Op union is closed
                raise TypeError(f"unknown op {op!r}")
        except HarnessError as exc:
            forget_pending()  # it reached us directly
            # Observed like any crash, as the exception the harness's code raised: it may be
            # the subject's doing (its SchedulerOutput), which the other side decides.
            self.harness_error = exc
            cause = exc.__cause__ or exc
            extra["exception"] = f"{type(cause).__name__}: {cause}"[:300]
        except Exception as exc:  # the subject's crash is an observable difference
            extra["exception"] = f"{type(exc).__name__}: {exc}"[:300]
        if cfg.kv_events:
            # What the scheduler published during the operation (its updates publish).
            extra["kv_events"] = vc.take_kv_events(sched)
        # The harness's own code may have raised where the subject caught it (a processor the
        # subject's fault containment called): that stops the run, it is no observation.
        raise_pending()
        observation = Observation(sched, self.subject, extra, outputs)
        self.last_observation = observation
        return observation

    def abort_state(self, rid: str) -> str:
        """Which state an abort of ``rid`` meets: waiting, running, in flight (async, a step
        of it queued), preempted, finished but unreported, or unknown."""
        sched = self.scheduler
        req = sched.requests.get(rid)
        if req is None:
            return "finished_unreported" if rid in vc.finished_unreported(sched) else "unknown"
        if vc.is_finished(req):
            return "finished_unreported"
        status = vc.status_name(req)
        if status == "PREEMPTED":
            return "preempted"
        if status == "RUNNING":
            queued = isinstance(self.driver, AsyncDriver) and any(
                rid in so.num_scheduled_tokens for so, _ in self.driver.queue
            )
            return "in_flight" if queued else "running"
        return "waiting"

    def live_ids(self) -> list[str]:
        return list(self.scheduler.requests)

    def busy(self) -> bool:
        """Requests held or a step in flight: the session's drain keeps stepping."""
        return bool(self.scheduler.has_requests() or self.driver.in_flight())

    def free_blocks(self) -> int:
        return vc.num_free_blocks(vc.block_pool(self.scheduler))

    def omni_ids(self) -> set[str]:
        return set(self.subject.live_omni_ids(self.scheduler))

    def attribute_names(self) -> AttributeNames:
        """The attribute names of the scheduler and of each live request: all the declared-
        attribute audits need of the oracle, plain values an oracle process can send."""
        return AttributeNames(
            frozenset(vars(self.scheduler)),
            {rid: frozenset(vars(req)) for rid, req in self.scheduler.requests.items()},
        )


@dataclass(frozen=True)
class AttributeNames:
    """What ``Side.attribute_names`` reads: the scheduler's attribute names and, per live
    request id, the request's."""

    scheduler: frozenset[str]
    requests: dict[str, frozenset[str]]


def make_side(subject: Subject, cfg: HarnessConfig, worker: Subject | None) -> Side:
    """A side for ``subject``: its scheduler, and ``worker``'s real worker when given, else the
    harness's deterministic token source."""
    scheduler = subject.build_scheduler(cfg)
    # What the runner and driver read of a V2-built configuration is read under the flavour it
    # was built with (HiSparse's refuses to be read under the V1 runner the harness pins).
    with runner_flavour(cfg.model_runner_v2):
        return _side(subject, cfg, worker, scheduler)


def _side(subject: Subject, cfg: HarnessConfig, worker: Subject | None, scheduler: Any) -> Side:
    executor: Executor
    if worker is not None:
        executor = WorkerExecutor(worker.make_worker(cfg))
    else:
        vocab = int(cfg.model_shape().get("vocab_size", 512))
        executor = DeterministicTokenSource(
            vocab=vocab,
            edges=cfg.token_edges,
            num_drafts=cfg.num_speculative_tokens,
            report=runner_report(scheduler.vllm_config),
            aux=vc.aux_runner(scheduler.vllm_config, vocab),
            dynamic_drafts=bool(cfg.spec_options.get("num_speculative_tokens_per_batch_size")),
        )
    return Side(subject, scheduler, make_driver(scheduler, executor), executor)
