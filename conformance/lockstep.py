"""The lock-step session: one workload applied to upstream and a subject, compared after each op.

``Lockstep`` owns two sides (the oracle — upstream vLLM — and the subject), each a scheduler,
a driver and an executor built from the same ``HarnessConfig``. ``apply(op)`` applies one
workload operation to both, snapshots both (``conformance.observe``) and compares them
(``conformance.compare``) against the subject's registry. It also counts what the workload
actually exercised (preemptions, prefix hits, aborts per request state, stops, resets ...), so
tests can assert that a situation really happened rather than trusting the generator.

``run_trace`` replays a whole ``Trace`` and stops at the first untolerated difference;
``shrink`` removes operations while the same field still fails, so saved failures are short.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from conformance import vllm_compat as vc
from conformance.compare import Comparison, FieldDifference, compare
from conformance.config import HarnessConfig
from conformance.differences import Registry
from conformance.driver import AsyncDriver, Executor, SyncDriver, WorkerExecutor, make_driver
from conformance.observe import observe_outputs, observe_state
from conformance.subjects import Subject, UpstreamSubject
from conformance.tokens import DeterministicTokenSource
from conformance.workload import (
    Abort,
    AddRequest,
    DeliverChunks,
    Op,
    ResetPrefixCache,
    Step,
    Trace,
)


class SubjectBroken(AssertionError):
    """Raised by ``Lockstep.check`` for the first untolerated difference."""

    def __init__(self, difference: FieldDifference) -> None:
        self.difference = difference
        super().__init__(difference.headline())


@dataclass
class Side:
    subject: Subject
    scheduler: Any
    driver: SyncDriver | AsyncDriver
    executor: Executor
    chunks: list[Any] = field(default_factory=list)


def _make_side(subject: Subject, cfg: HarnessConfig, worker: Subject | None) -> Side:
    scheduler = subject.build_scheduler(cfg)
    executor: Executor
    if worker is not None:
        executor = WorkerExecutor(worker.make_worker(cfg))
    else:
        vocab = int(cfg.model_shape().get("vocab_size", 512))
        executor = DeterministicTokenSource(vocab=vocab)
    return Side(subject, scheduler, make_driver(scheduler, executor), executor)


class Lockstep:
    def __init__(
        self,
        config: HarnessConfig,
        subject: Subject,
        *,
        prefixes: dict[str, tuple[int, ...]] | None = None,
        registry: Registry | None = None,
        oracle: Subject | None = None,
        use_worker: bool = False,
    ) -> None:
        if use_worker:
            config = subject.worker_config(config)
        self.config = config
        self.subject = subject
        worker_src = subject if use_worker else None
        self.up = _make_side(oracle or UpstreamSubject(), config, worker_src)
        self.sub = _make_side(subject, config, worker_src)
        self.registry = registry if registry is not None else Registry(subject.differences())
        self.trace = Trace(config=config, prefixes=dict(prefixes or {}))
        self.mode = self.up.driver.mode
        self.facts: dict[str, dict[str, Any]] = {}
        self.stats: Counter[str] = Counter()
        self.tolerated: Counter[str] = Counter()
        self.steps_compared = 0
        self.failure: FieldDifference | None = None
        self._cfg_dict = config.to_dict()
        self._arrivals = 0
        self._last_up: dict[str, Any] | None = None
        self.initial_free = vc.num_free_blocks(vc.block_pool(self.up.scheduler))

    # ---- operations ------------------------------------------------------------------------

    def apply(self, op: Op) -> Comparison:
        if self.failure is not None:
            raise RuntimeError("lock-step already failed; start a new session")
        index = len(self.trace.ops)
        self.trace.ops.append(op)
        if isinstance(op, Abort):
            self._classify_abort(op)
        arrival = float(self._arrivals)
        if isinstance(op, AddRequest):
            self._arrivals += 1
        up = self._apply(self.up, op, arrival)
        sub = self._apply(self.sub, op, arrival)
        if isinstance(op, AddRequest):
            req = self.sub.scheduler.requests.get(op.request_id)
            if req is not None:
                self.facts[op.request_id] = self.subject.request_facts(req)
        for rid, more in self.subject.scheduler_facts(self.sub.scheduler).items():
            self.facts.setdefault(rid, {}).update(more)
        ctx = {
            "config": self._cfg_dict,
            "subject_state": self.facts,
            "step": index,
            "op": op.describe(),
            "mode": self.mode,
        }
        result = compare(up, sub, self.registry, ctx)
        self.tolerated.update(result.tolerated)
        if isinstance(op, Step):
            self.steps_compared += 1
        self._count(op, up)
        self._last_up = up
        if result.failure is not None:
            self.failure = result.failure
        return result

    def check(self, op: Op) -> Comparison:
        """``apply`` that raises ``SubjectBroken`` on the first untolerated difference."""
        result = self.apply(op)
        if result.failure is not None:
            raise SubjectBroken(result.failure)
        return result

    def _apply(self, side: Side, op: Op, arrival: float) -> dict[str, Any]:
        sched = side.scheduler
        extra: dict[str, Any] = {}
        try:
            if isinstance(op, Step):
                obs = side.driver.step()
                extra["sched_out"] = obs.scheduled
                extra["outputs"] = observe_outputs(obs.outputs)
                extra["updated"] = obs.updated
            elif isinstance(op, AddRequest):
                prompt = self.trace.prompt_of(op)
                request = side.subject.make_request(op, prompt, self.config, sched, arrival)
                sched.add_request(request)
            elif isinstance(op, Abort):
                from vllm.v1.request import RequestStatus

                sched.finish_requests(list(op.request_ids), RequestStatus.FINISHED_ABORTED)
            elif isinstance(op, ResetPrefixCache):
                extra["result"] = sched.reset_prefix_cache(
                    op.reset_running_requests, op.reset_connector
                )
            elif isinstance(op, DeliverChunks):
                chunks = side.subject.drain_chunks(sched)
                side.chunks.extend(chunks)
            else:  # pragma: no cover - the Op union is closed
                raise TypeError(f"unknown op {op!r}")
        except Exception as exc:  # a crash is an observable difference, not a harness error
            extra["exception"] = f"{type(exc).__name__}: {exc}"[:300]
        snap = observe_state(sched, side.subject)
        snap.update(extra)
        return snap

    # ---- what the workload exercised ------------------------------------------------------

    def _classify_abort(self, op: Abort) -> None:
        sched = self.up.scheduler
        in_queue = set()
        if isinstance(self.up.driver, AsyncDriver):
            for so, _ in self.up.driver.queue:
                in_queue.update(so.num_scheduled_tokens)
        for rid in op.request_ids:
            req = sched.requests.get(rid)
            if req is None:
                state = "finished_unreported" if rid in vc.finished_unreported(sched) else "unknown"
            elif vc.is_finished(req):
                state = "finished_unreported"
            elif vc.status_name(req) == "PREEMPTED":
                state = "preempted"
            elif vc.status_name(req) == "RUNNING":
                state = "in_flight" if rid in in_queue else "running"
            else:
                state = "waiting"
            self.stats[f"abort_{state}"] += 1

    def _count(self, op: Op, up: dict[str, Any]) -> None:
        if isinstance(op, ResetPrefixCache):
            form = "running" if op.reset_running_requests else "plain"
            form = "connector" if op.reset_connector else form
            self.stats[f"reset_{form}"] += 1
            if up.get("result"):
                self.stats["reset_succeeded"] += 1
        prev = self._last_up["requests"] if self._last_up else {}
        for rid, fields in up["requests"].items():
            before = prev.get(rid, {}).get("num_preemptions", 0)
            if fields["num_preemptions"] > before:
                self.stats["preemptions"] += fields["num_preemptions"] - before
        sched_out = up.get("sched_out") or {}
        self.stats["resumed"] += len(sched_out.get("resumed", ()))
        for out in (up.get("outputs") or {}).values():
            ps = out.get("prefill_stats")
            if ps and ps.get("num_cached_tokens", 0) > 0:
                self.stats["prefix_hits"] += 1
            reason = out.get("finish_reason")
            if reason == "stop":
                self.stats[
                    "stop_" + ("stop_token" if out.get("stop_reason") is not None else "eos")
                ] += 1
            elif reason == "length":
                self.stats["max_tokens"] += 1
        if isinstance(self.up.driver, AsyncDriver) and up.get("requests"):
            if any(f["num_stale_output_tokens"] for f in up["requests"].values()):
                self.stats["stale_in_flight"] += 1

    # ---- conveniences ---------------------------------------------------------------------

    def live_ids(self) -> list[str]:
        return list(self.up.scheduler.requests)

    def has_work(self) -> bool:
        return bool(
            self.up.scheduler.has_requests()
            or self.sub.scheduler.has_requests()
            or self.up.driver.in_flight()
            or self.sub.driver.in_flight()
        )

    def drain(self, max_steps: int = 500) -> None:
        """Step until neither side has work; then deliver chunks (C-06 needs transfers acked)."""
        for _ in range(max_steps):
            if self.failure is not None or not self.has_work():
                break
            self.apply(Step())
        if self.failure is None:
            self.apply(DeliverChunks())

    def conservation_problems(self) -> list[str]:
        """C-06 on both sides, once everything has finished or been aborted."""
        problems = []
        for label, side in (("upstream", self.up), ("subject", self.sub)):
            sched = side.scheduler
            free = vc.num_free_blocks(vc.block_pool(sched))
            if free != self.initial_free:
                problems.append(f"{label}: {free} free blocks, expected {self.initial_free}")
            if sched.requests:
                problems.append(f"{label}: still holds requests {sorted(sched.requests)}")
            leaked = side.subject.live_omni_ids(sched)
            if leaked:
                problems.append(f"{label}: omni state survives for {sorted(leaked)}")
        return problems


@dataclass
class RunResult:
    failure: FieldDifference | None
    session: Lockstep
    trace: Trace


def run_trace(
    trace: Trace,
    subject: Subject,
    *,
    registry: Registry | None = None,
    use_worker: bool = False,
) -> RunResult:
    session = Lockstep(
        trace.config, subject, prefixes=trace.prefixes, registry=registry, use_worker=use_worker
    )
    for op in trace.ops:
        session.apply(op)
        if session.failure is not None:
            break
    executed = Trace(trace.config, list(session.trace.ops), dict(trace.prefixes), dict(trace.meta))
    return RunResult(session.failure, session, executed)


def shrink(
    trace: Trace,
    still_fails: Callable[[Trace], bool],
    *,
    budget: int = 200,
    time_budget: float | None = None,
) -> Trace:
    """Delta-debugging over operations: drop chunks, then single ops, while the failure persists.

    Bounded by ``budget`` re-runs and ``time_budget`` seconds: a CI gate must fail fast, and a
    partly shrunk trace still replays.
    """
    import time

    if time_budget is None:
        time_budget = float(os.environ.get("OMNI_CONFORMANCE_SHRINK_SECONDS", "20"))
    ops = list(trace.ops)
    runs = 0
    deadline = time.monotonic() + time_budget

    def attempt(candidate: list[Op]) -> bool:
        nonlocal runs
        runs += 1
        if time.monotonic() > deadline:
            runs = budget
            return False
        return still_fails(Trace(trace.config, candidate, trace.prefixes, dict(trace.meta)))

    chunk = max(1, len(ops) // 2)
    while chunk >= 1 and runs < budget:
        i = 0
        changed = False
        while i < len(ops) and runs < budget:
            candidate = ops[:i] + ops[i + chunk :]
            if candidate and attempt(candidate):
                ops = candidate
                changed = True
            else:
                i += chunk
        if not changed:
            chunk //= 2
    return Trace(trace.config, ops, dict(trace.prefixes), dict(trace.meta))


def same_failure(subject: Subject, path: str, **kw: Any) -> Callable[[Trace], bool]:
    def predicate(t: Trace) -> bool:
        res = run_trace(t, subject, **kw)
        return res.failure is not None and res.failure.path == path

    return predicate
