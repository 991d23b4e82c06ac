"""The lock-step session: one workload applied to upstream and a subject, compared after each op.

``Lockstep`` owns two sides (the oracle — upstream vLLM — and the subject), each a scheduler,
a driver and an executor built from the same ``HarnessConfig``. ``apply(op)`` applies one
workload operation to both, snapshots both (``conformance._core.observe``) and compares them
(``conformance._core.compare``) against the subject's registry; the snapshots are built only when an
in-place check of both sides (``observe.same_state``) cannot show them equal, or when read
(``_last_up``, ``last_sub``). It also counts what the workload
actually exercised (preemptions, prefix hits, aborts per request state, stops, resets ...), so
tests can assert that a situation really happened rather than trusting the generator.

``run_trace`` replays a whole ``Trace`` and stops at the first untolerated difference;
``Shrinker`` (and ``shrink``) reduces a failing trace while the same field still fails — whole
requests, chunks of operations, repeated steps, aborted ids, request sizes, the KV-cache pool —
within a wall-clock bound (``OMNI_CONFORMANCE_SHRINK_SECONDS``, default 60 s), so saved failures are short.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from conformance._core.capabilities import NotApplicable
from conformance._core.compare import Comparison, FieldDifference, compare, field_of
from conformance._core.config import HarnessConfig
from conformance._core.differences import Registry
from conformance._core.harness_faults import forget_pending
from conformance._core.multimodal import IMAGES
from conformance._core.observe import Observation, same_state
from conformance._core.oracle_process import ProcessSide
from conformance._core.pristine import oracle_placement
from conformance._core.sides import Side, make_side
from conformance._core.subjects import Subject, UpstreamSubject
from conformance._core.workload import (
    Abort,
    AddRequest,
    DeliverChunks,
    Op,
    Pause,
    ResetEncoderCache,
    ResetPrefixCache,
    Shutdown,
    Step,
    StreamInput,
    Trace,
)


@dataclass
class Deferred:
    """The first difference in a deferred snapshot section, and the operations up to it (a
    trace that reproduces it with nothing set aside)."""

    difference: FieldDifference
    ops: list[Op]


class SubjectBroken(AssertionError):
    """Raised by ``Lockstep.check`` for the first untolerated difference."""

    def __init__(self, difference: FieldDifference) -> None:
        self.difference = difference
        super().__init__(difference.headline())


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
        set_aside: tuple[str, ...] = (),
        defer: tuple[str, ...] = (),
    ) -> None:
        if use_worker:
            config = subject.worker_config(config)
        forget_pending()  # errors of an earlier session were raised to their own caller
        self.config = config
        self.subject = subject
        worker_src = subject if use_worker else None
        self.up: Side | ProcessSide = self._make_oracle(oracle, config, worker_src)
        self.sub = make_side(subject, config, worker_src)
        self.registry = registry if registry is not None else Registry(subject.differences())
        self.trace = Trace(config=config, prefixes=dict(prefixes or {}))
        self.mode = self.up.mode
        self.facts: dict[str, dict[str, Any]] = {}
        self.stats: Counter[str] = Counter()
        self.tolerated: Counter[str] = Counter()
        self.steps_compared = 0
        self.failure: FieldDifference | None = None
        # Snapshot sections left out of the comparison (``set_aside``), and those whose first
        # difference is kept in ``deferred`` instead of ending the session (``defer``); see
        # ``_judge``.
        self.set_aside: set[str] = set(set_aside)
        self.defer = frozenset(defer)
        self.deferred: Deferred | None = None
        self._cfg_dict = config.to_dict()
        self._arrivals = 0
        # The last operation's observations (``_last_up`` and ``last_sub`` are their snapshots).
        self._up_obs: Observation | None = None
        self._sub_obs: Observation | None = None
        # Upstream's preemption count per request after the last operation (``_count``).
        self._preemptions: tuple[list[str], list[int]] = ([], [])
        # Streaming input sessions started (``AddRequest.resumable``): id -> its stream ended.
        self.sessions: dict[str, bool] = {}
        # The scheduler was last paused (``Pause``), not resumed: the drain resumes it.
        self.paused = False
        self.initial_free = self.up.free_blocks()

    @staticmethod
    def _make_oracle(
        oracle: Subject | None, config: HarnessConfig, worker: Subject | None
    ) -> Side | ProcessSide:
        """Upstream in this process while this process's vLLM is pristine, else in its own."""
        placement = oracle_placement()
        if not placement.isolated:
            return make_side(oracle or UpstreamSubject(), config, worker)
        if oracle is not None and not isinstance(oracle, UpstreamSubject):
            raise ValueError(f"an oracle other than upstream cannot run {placement.describe()}")
        if worker is not None:
            raise NotApplicable(
                "the real-worker mode runs the subject's worker on both sides, which needs the "
                f"oracle in this process; here it runs {placement.describe()}"
            )
        return ProcessSide(config)

    # ---- operations ------------------------------------------------------------------------

    def apply(self, op: Op) -> Comparison:
        if self.failure is not None:
            raise RuntimeError("lock-step already failed; start a new session")
        if isinstance(op, AddRequest) and op.client_index and self.subject.single_engine_client:
            # The subject's engine has one client: both sides get the request from it, and the
            # trace records the request as it ran.
            op = replace(op, client_index=0)
        index = len(self.trace.ops)
        self.trace.ops.append(op)
        arrival = float(self._arrivals)
        prompt = None
        if isinstance(op, StreamInput) and op.request_id not in self.open_sessions():
            # A client stops streaming to a session that has finished or whose stream it ended
            # (as ``AsyncLLM`` does): nothing is sent, so a shortened trace cannot start a new
            # request under a finished session's id.
            return Comparison()
        # What both sides are given: a session's input is the request its client sends.
        sent: Op = self.trace.session_input(op, index) if isinstance(op, StreamInput) else op
        if isinstance(sent, AddRequest):
            self._arrivals += 1
            prompt = self.trace.prompt_of(sent)
            if sent.arrival is not None:
                arrival = sent.arrival
        if isinstance(op, AddRequest) and op.resumable:
            self.sessions.setdefault(op.request_id, False)
        elif isinstance(op, StreamInput):
            self.stats["stream_end" if op.end else "stream_input"] += 1
            if op.end:
                self.sessions[op.request_id] = True
        elif isinstance(op, Pause):
            self.paused = op.state != "off"
            self.stats[f"pause_{op.state}"] += 1
        up = self.up.observe(sent, prompt, self.config, arrival)
        # A prompt list of its own: vLLM's ``Request`` keeps the list it is given, and a
        # streaming session's input extends it in place.
        sub_prompt = None if prompt is None else list(prompt)
        sub = self.sub.observe(sent, sub_prompt, self.config, arrival)
        # The harness's own code failed on upstream's input: a bug in the gate. On the subject's
        # input alone it is the subject's doing, and the difference is reported as usual.
        harness_error = getattr(self.up, "harness_error", None)
        if harness_error is not None:
            raise harness_error
        if isinstance(op, Abort):
            self.stats.update(f"abort_{state}" for state in self.up.last_abort_states.values())
        if isinstance(op, AddRequest):
            req = self.sub.scheduler.requests.get(op.request_id)
            if req is not None:
                self.facts[op.request_id] = self.subject.request_facts(req)
        for rid, more in self.subject.scheduler_facts(self.sub.scheduler).items():
            self.facts.setdefault(rid, {}).update(more)
        if same_state(up, sub):
            # The snapshots would be equal: nothing to judge, nothing tolerated. Building and
            # comparing them on every operation was most of the harness's own cost.
            result = Comparison()
        else:
            ctx = {
                "config": self._cfg_dict,
                "subject_state": self.facts,
                "step": index,
                "op": op.describe(),
                "mode": self.mode,
            }
            result = self._judge(up.snapshot(), sub.snapshot(), ctx)
            self.tolerated.update(result.tolerated)
        if isinstance(op, Step):
            self.steps_compared += 1
        self._count(op, up)
        self._up_obs = up
        self._sub_obs = sub
        if result.failure is not None:
            self.failure = result.failure
        return result

    def _judge(self, up: dict[str, Any], sub: dict[str, Any], ctx: dict[str, Any]) -> Comparison:
        """Compare two snapshots without the sections set aside. A deferrable section's first
        difference is kept (``deferred``, with the operations that led to it) and the section is
        set aside from then on, so the rest of the snapshot is still compared: scheduler
        statistics that differ (a subject that reports them less often, say) would otherwise
        end every session at its first report and hide what the scheduler does after it."""
        if self.set_aside:
            up = {k: v for k, v in up.items() if k not in self.set_aside}
            sub = {k: v for k, v in sub.items() if k not in self.set_aside}
        result = compare(up, sub, self.registry, ctx)
        failure = result.failure
        if failure is None or failure.section not in self.defer or self.deferred is not None:
            return result
        self.deferred = Deferred(failure, list(self.trace.ops))
        self.set_aside.add(failure.section)
        return self._judge(up, sub, ctx)

    @property
    def _last_up(self) -> dict[str, Any] | None:
        """Upstream's snapshot of the last operation (built when first read)."""
        return None if self._up_obs is None else self._up_obs.snapshot()

    @property
    def last_sub(self) -> dict[str, Any] | None:
        """The subject's snapshot of the last operation: checks of the subject alone read it."""
        return None if self._sub_obs is None else self._sub_obs.snapshot()

    @property
    def last_outputs(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Upstream's and the subject's normalised outputs of the last operation (the
        snapshots' ``outputs``), without building the rest of either snapshot."""
        up = {} if self._up_obs is None else self._up_obs.step_outputs()
        sub = {} if self._sub_obs is None else self._sub_obs.step_outputs()
        return up, sub

    def check(self, op: Op) -> Comparison:
        """``apply`` that raises ``SubjectBroken`` on the first untolerated difference."""
        result = self.apply(op)
        if result.failure is not None:
            raise SubjectBroken(result.failure)
        return result

    # ---- what the workload exercised ------------------------------------------------------

    def _count(self, op: Op, up: Observation) -> None:
        if isinstance(op, ResetPrefixCache):
            form = "running" if op.reset_running_requests else "plain"
            form = "connector" if op.reset_connector else form
            self.stats[f"reset_{form}"] += 1
            if up.get("result"):
                self.stats["reset_succeeded"] += 1
        ids, preemptions = up.preemption_counts()
        prev_ids, prev_counts = self._preemptions
        if preemptions != prev_counts or ids != prev_ids:
            before = dict(zip(prev_ids, prev_counts, strict=True))
            for rid, count in zip(ids, preemptions, strict=True):
                if count > before.get(rid, 0):
                    self.stats["preemptions"] += count - before.get(rid, 0)
            self._preemptions = (ids, preemptions)
        sched_out = up.get("sched_out") or {}
        self.stats["resumed"] += len(sched_out.get("resumed", ()))
        for prefill, reason, stop_reason in up.output_facts():
            if prefill and prefill.get("num_cached_tokens", 0) > 0:
                self.stats["prefix_hits"] += 1
            if reason == "stop":
                self.stats["stop_" + ("stop_token" if stop_reason is not None else "eos")] += 1
            elif reason == "length":
                self.stats["max_tokens"] += 1
        if self.mode == "async" and up.any_stale_tokens():
            self.stats["stale_in_flight"] += 1

    # ---- conveniences ---------------------------------------------------------------------

    def live_ids(self) -> list[str]:
        return self.up.live_ids()

    def has_work(self) -> bool:
        return self.up.busy() or self.sub.busy()

    def open_sessions(self) -> list[str]:
        """Streaming sessions upstream still holds whose input stream has not ended."""
        live = set(self.up.live_ids())
        return [rid for rid, ended in self.sessions.items() if not ended and rid in live]

    def live_sessions(self) -> set[str]:
        """Streaming sessions upstream still holds, their stream ended or not: a turn of one
        ends with a finish reason, and the request goes on."""
        return set(self.sessions).intersection(self.up.live_ids())

    def drain(self, max_steps: int = 500) -> None:
        """End the input stream of every open session (as a client that closes its streams
        does); step until neither side has work; then deliver chunks (C-06 needs transfers
        acked). With sessions, a client also gives up on what upstream cannot serve: a session
        keeps its KV-cache blocks between turns, so sessions can hold the pool while each waits
        for blocks another holds; after ``STUCK_STEPS`` steps in which upstream schedules
        nothing, the requests it still holds are aborted, on both sides alike. A paused
        scheduler is resumed first, as the engine is before it drains."""
        if self.paused and self.failure is None:
            self.apply(Pause("off"))
        for rid in self.open_sessions():
            if self.failure is not None:
                return
            self.apply(StreamInput(rid, end=True))
        idle = 0
        for _ in range(max_steps):
            if self.failure is not None or not self.has_work():
                break
            self.apply(Step())
            if not self.sessions:
                continue
            scheduled = (self._up_obs.get("sched_out") if self._up_obs else None) or {}
            idle = 0 if scheduled.get("total_tokens") else idle + 1
            if idle >= STUCK_STEPS:
                for rid in sorted(self.up.live_ids()):  # one at a time: a set's order varies
                    if self.failure is None:
                        self.apply(Abort((rid,)))
                idle = 0
        if self.failure is None:
            self.apply(DeliverChunks())
        if self.failure is None:
            self.apply(Shutdown())

    def conservation_problems(self) -> list[str]:
        """C-06 on both sides, once everything has finished or been aborted."""
        problems = []
        sides: tuple[tuple[str, Side | ProcessSide], ...] = (
            ("upstream", self.up),
            ("subject", self.sub),
        )
        for label, side in sides:
            free = side.free_blocks()
            if free != self.initial_free:
                problems.append(f"{label}: {free} free blocks, expected {self.initial_free}")
            if held := side.live_ids():
                problems.append(f"{label}: still holds requests {sorted(held)}")
            leaked = side.omni_ids()
            if leaked:
                problems.append(f"{label}: omni state survives for {sorted(leaked)}")
        return problems


# Steps in which upstream schedules nothing before a drain with streaming sessions aborts what it
# still holds (``Lockstep.drain``).
STUCK_STEPS = 4

# The trace ``meta`` key naming the snapshot sections a trace's run leaves out of the
# comparison: a difference found after another section's had been deferred replays that way.
SET_ASIDE = "set_aside"


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
        trace.config,
        subject,
        prefixes=trace.prefixes,
        registry=registry,
        use_worker=use_worker,
        set_aside=tuple(trace.meta.get(SET_ASIDE, ())),
    )
    for op in trace.ops:
        session.apply(op)
        if session.failure is not None:
            break
    executed = Trace(trace.config, list(session.trace.ops), dict(trace.prefixes), dict(trace.meta))
    return RunResult(session.failure, session, executed)


DEFAULT_SHRINK_SECONDS = 60.0
SHRINK_SECONDS_ENV = "OMNI_CONFORMANCE_SHRINK_SECONDS"

# What ``shrink`` asks of a candidate trace: falsy when it does not show the failure; ``True``, or
# better the executed prefix of the candidate (a ``Trace`` ending at the failing operation), when
# it does. ``same_failure`` returns the executed prefix, so everything after the failing
# operation is dropped at once.
FailsCheck = Callable[[Trace], "bool | Trace"]


def shrink_seconds() -> float:
    """The shrinker's wall-clock bound: ``OMNI_CONFORMANCE_SHRINK_SECONDS``, else 60 s."""
    raw = os.environ.get(SHRINK_SECONDS_ENV, "")
    try:
        return float(raw) if raw.strip() else DEFAULT_SHRINK_SECONDS
    except ValueError:
        return DEFAULT_SHRINK_SECONDS


class _OutOfBudget(Exception):
    pass


# The configuration fields the shrinker may make smaller (``Shrinker._shrink_pool``).
POOL_FIELDS = ("num_blocks", "max_model_len")


@dataclass
class ShrinkResult:
    trace: Trace
    original_ops: int
    runs: int
    seconds: float
    complete: bool  # False: the time or run bound ended the search (the trace is the best found)
    reproduced: bool  # False: the input trace did not fail at all, and is returned unchanged
    # The configuration the input trace ran with, when the shrinker found the failure with a
    # smaller KV-cache pool (the trace's config then says how small); None: unchanged.
    original_config: HarnessConfig | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "original_ops": self.original_ops,
            "ops": len(self.trace.ops),
            "runs": self.runs,
            "seconds": round(self.seconds, 3),
            "complete": self.complete,
        }
        if self.original_config is not None:
            for name in POOL_FIELDS:
                was, now = getattr(self.original_config, name), getattr(self.trace.config, name)
                if was != now:
                    d[name] = {"original": was, "shrunk": now}
        return d


def _weight(ops: list[Op], num_blocks: int = 0) -> tuple[int, int, int, int]:
    """Shrink order: fewer operations first, then a smaller KV-cache pool (``num_blocks``), then
    smaller requests and fewer aborted ids, then requests added earlier (a trace in which
    requests arrive first reads most easily)."""
    detail = 0
    late = 0
    for i, op in enumerate(ops):
        if isinstance(op, AddRequest):
            late += i
            detail += len(op.prompt) + op.max_tokens + len(op.stop_token_ids)
            detail += (op.prefix is not None) + (not op.ignore_eos) + (op.final_stage is not None)
            detail += (op.trace_headers is not None) + (op.client_index != 0) + op.plain
            detail += op.priority != 0
            detail += op.arrival is not None
            detail += op.kv_transfer_params is not None
            detail += op.grammar is not None
            detail += op.kv_cache_report_mode is not None
            detail += op.skip_reading_prefix_cache
            detail += op.resumable
            detail += op.logprobs is not None
            detail += len(op.images)
            detail += op.min_tokens
            detail += op.lora != 0
            detail += op.prompt_logprobs is not None
            detail += op.repetition is not None
            detail += op.embeds
        elif isinstance(op, StreamInput):
            detail += len(op.prompt) + (op.max_tokens or 0) + len(op.images)
        elif isinstance(op, Abort):
            detail += len(op.request_ids)
        elif isinstance(op, ResetPrefixCache):
            detail += op.reset_running_requests + op.reset_connector
        elif isinstance(op, Pause):
            detail += op.state != "off"
        elif isinstance(op, ResetEncoderCache):
            detail += 1
    return len(ops), num_blocks, detail, late


def _without_request(ops: list[Op], rid: str) -> list[Op]:
    out: list[Op] = []
    for op in ops:
        if isinstance(op, AddRequest | StreamInput) and op.request_id == rid:
            continue
        if isinstance(op, Abort) and rid in op.request_ids:
            rest = tuple(r for r in op.request_ids if r != rid)
            if rest:
                out.append(Abort(rest))
            continue
        out.append(op)
    return out


def _smaller_ints(n: int, floor: int) -> list[int]:
    """Candidate values below ``n`` (and at least ``floor``), smallest first."""
    return sorted({v for v in (floor, n // 4, n // 2, (3 * n) // 4, n - 1) if floor <= v < n})


def _pool_sizes(num_blocks: int, floor: int) -> list[int]:
    """Smaller KV-cache pools to try, fewest first, none below ``floor``: every size up to 16
    blocks, eighths of the pool above that (at most 22 runs a round, however large the pool)."""
    small = range(floor, min(num_blocks, 17))
    eighths = (num_blocks * k // 8 for k in range(1, 8))
    return sorted({*small, *(n for n in eighths if n >= floor)} - {num_blocks})


def _smaller_pool(config: HarnessConfig, num_blocks: int) -> HarnessConfig:
    """``config`` with ``num_blocks`` blocks, its context capped to what they hold beside the
    null block: vLLM starts only when one request of ``max_model_len`` tokens fits."""
    fits = (num_blocks - 1) * max(1, config.block_size)
    return config.with_(num_blocks=num_blocks, max_model_len=min(config.max_model_len, fits))


def _longest_request(ops: list[Op], prefixes: dict[str, tuple[int, ...]]) -> int:
    """The most tokens any request of ``ops`` may reach: its prompt and output, and every
    streamed input with its output. A pool or context smaller than that would starve it (the
    harness admits what the engine's input processor would refuse) into failures of its own."""
    sizes: Counter[str] = Counter()
    for op in ops:
        if isinstance(op, AddRequest):
            head = len(prefixes.get(op.prefix, ())) if op.prefix else 0
            images = sum(IMAGES[name][1] for name, _ in op.images)
            sizes[op.request_id] += head + len(op.prompt) + images + op.max_tokens
        elif isinstance(op, StreamInput):
            images = sum(IMAGES[name][1] for name, _ in op.images)
            sizes[op.request_id] += len(op.prompt) + images + (op.max_tokens or 0)
    return max(sizes.values(), default=0)


# The simplest value of each request field the shrinker resets in one go: no stop ids, EOS
# ignored, no final stage, no trace headers, the first client, not plain, no priority, ...
_SIMPLEST: tuple[tuple[str, Any], ...] = (
    ("stop_token_ids", ()),
    ("ignore_eos", True),
    ("final_stage", None),
    ("trace_headers", None),
    ("client_index", 0),
    ("plain", False),
    ("priority", 0),
    ("arrival", None),
    ("kv_transfer_params", None),
    ("grammar", None),
    ("kv_cache_report_mode", None),
    ("skip_reading_prefix_cache", False),
    ("logprobs", None),
    ("min_tokens", 0),
    ("lora", 0),
    ("prompt_logprobs", None),
    ("repetition", None),
    ("embeds", False),
)


def _simplifications(op: AddRequest) -> list[list[dict[str, Any]]]:
    """Field changes that make one request simpler, grouped by field, simplest first per group."""
    groups: list[list[dict[str, Any]]] = []
    if op.prefix is not None:
        groups.append([{"prefix": None}])
    groups.append([{"prompt": op.prompt[:n]} for n in _smaller_ints(len(op.prompt), 1)])
    # min_tokens follows max_tokens down: vLLM refuses it above.
    groups.append(
        [
            {"max_tokens": n, **({"min_tokens": n} if op.min_tokens > n else {})}
            for n in _smaller_ints(op.max_tokens, 1)
        ]
    )
    # One group per field left off its simplest value, in this order.
    groups += [[{name: simple}] for name, simple in _SIMPLEST if getattr(op, name) != simple]
    if op.images:
        # No image, then each image alone (the one a failure needs may be either).
        alone = [{"images": (im,)} for im in op.images] if len(op.images) > 1 else []
        groups.append([{"images": ()}, *alone])
    return [g for g in groups if g]


class Shrinker:
    """Greedy reduction of a failing trace that keeps ``still_fails`` true at every step.

    Passes, repeated until none makes progress: remove whole requests (with their ids in
    aborts); delta-debugging removal of chunks of operations, halving the chunk down to single
    operations; collapse runs of repeated steps; drop aborted ids one at a time; simplify each
    request (no shared prefix, shorter prompt, fewer max_tokens, fewer images, and each field
    of ``_SIMPLEST`` at its simplest value); move requests earlier (past the steps before them),
    which lets the steps that only waited for them go in the next round; trade a step for a
    block more of some earlier request's prompt (KV-cache pressure with fewer operations); run
    the same operations with a smaller KV-cache pool, so that pressure which took many steps of
    decoding to build (a preemption with steps in flight, say) comes sooner and those steps go
    in the next round. Every candidate is strictly smaller (``_weight``) than the current
    trace, so the search ends, and each distinct candidate runs at most once.

    Bounded by ``time_budget`` seconds (default ``shrink_seconds()``) and optionally ``budget``
    runs; when a bound is hit the best trace found so far is the result, so a failure is always
    saved shrunk as far as time allowed.
    """

    def __init__(
        self,
        trace: Trace,
        still_fails: FailsCheck,
        *,
        budget: int | None = None,
        time_budget: float | None = None,
    ) -> None:
        self.config = trace.config
        self.prefixes = dict(trace.prefixes)
        self.meta = dict(trace.meta)
        self.ops: list[Op] = list(trace.ops)
        self.still_fails = still_fails
        self.max_runs = budget
        self.time_budget = shrink_seconds() if time_budget is None else float(time_budget)
        self.runs = 0
        self.deadline = 0.0
        self._tried: set[tuple[int, tuple[Op, ...]]] = set()

    def _trace(self, ops: list[Op], config: HarnessConfig | None = None) -> Trace:
        return Trace(config or self.config, list(ops), dict(self.prefixes), dict(self.meta))

    def _size(self, ops: list[Op], config: HarnessConfig | None = None) -> tuple[int, ...]:
        return _weight(ops, (config or self.config).num_blocks)

    def _verdict(self, ops: list[Op], config: HarnessConfig | None = None) -> list[Op] | None:
        """The ops to keep when ``ops`` still fails (its executed prefix), else None."""
        self.runs += 1
        try:
            verdict = self.still_fails(self._trace(ops, config))
        except Exception:  # a candidate that crashes the harness is not the same failure
            return None
        if not verdict:
            return None
        return list(verdict.ops) if isinstance(verdict, Trace) else list(ops)

    def _spent(self) -> bool:
        """Whether the time or run bound is reached."""
        return time.monotonic() >= self.deadline or (
            self.max_runs is not None and self.runs >= self.max_runs
        )

    def _try(self, candidate: list[Op], config: HarnessConfig | None = None) -> bool:
        config = config or self.config
        key = (config.num_blocks, tuple(candidate))
        current = self._size(self.ops)
        if not candidate or key in self._tried or self._size(candidate, config) >= current:
            return False
        if self._spent():
            raise _OutOfBudget
        self._tried.add(key)
        kept = self._verdict(candidate, config)
        if kept is None or self._size(kept, config) >= current:
            return False
        self.ops, self.config = kept, config
        return True

    def run(self) -> ShrinkResult:
        started = time.monotonic()
        self.deadline = started + self.time_budget
        original, original_config = len(self.ops), self.config
        first = self._verdict(self.ops)
        if first is None:
            return ShrinkResult(
                self._trace(self.ops), original, self.runs, time.monotonic() - started, True, False
            )
        found = (first, self.config)
        # Two searches from the found trace, the smaller result kept: one shrinks the pool only
        # once the operations are as small as they go (a reset that preempts everything needs
        # no pressure, and a small pool taken early can trap it in a longer minimum); one takes
        # the pool first, while the found trace still has requests and steps to spare (pressure
        # built by many steps of decoding arrives in a few with fewer blocks).
        results: list[tuple[tuple[int, ...], list[Op], HarnessConfig]] = []
        complete = True
        for pool_first in (False, True):
            self.ops, self.config, self._tried = list(found[0]), found[1], set()
            try:
                self._search(pool_first)
            except _OutOfBudget:
                complete = False
            results.append((self._size(self.ops), self.ops, self.config))
            if not complete:
                break
        _, self.ops, self.config = min(results, key=lambda r: r[0])
        return ShrinkResult(
            self._trace(self.ops),
            original,
            self.runs,
            time.monotonic() - started,
            complete,
            True,
            original_config if self.config != original_config else None,
        )

    def _search(self, pool_first: bool) -> None:
        """Run the passes until a round makes no progress (``_OutOfBudget`` ends it early)."""
        while True:
            before = self._size(self.ops)
            if pool_first:
                self._shrink_pool()
            self._drop_requests()
            self._drop_chunks()
            self._collapse_steps()
            self._trim_aborts()
            self._simplify_adds()
            self._hoist_adds()
            self._trade_steps()
            if not pool_first:
                self._shrink_pool()
            if self._size(self.ops) >= before:
                return

    # ---- passes ---------------------------------------------------------------------------

    def _drop_requests(self) -> None:
        ids = [op.request_id for op in self.ops if isinstance(op, AddRequest)]
        for rid in reversed(ids):
            if any(isinstance(op, AddRequest) and op.request_id == rid for op in self.ops):
                self._try(_without_request(self.ops, rid))

    def _drop_chunks(self) -> None:
        chunk = len(self.ops) // 2
        while chunk >= 1:
            i = 0
            while i < len(self.ops):
                if not self._try(self.ops[:i] + self.ops[i + chunk :]):
                    i += chunk
            chunk //= 2

    def _collapse_steps(self) -> None:
        i = 0
        while i < len(self.ops):
            if not isinstance(self.ops[i], Step):
                i += 1
                continue
            run = 0
            while i + run < len(self.ops) and isinstance(self.ops[i + run], Step):
                run += 1
            for drop in sorted({run - 1, run // 2, 1} - {0}, reverse=True):
                if self._try(self.ops[:i] + self.ops[i + drop :]):
                    break
            while i < len(self.ops) and isinstance(self.ops[i], Step):
                i += 1

    def _trim_aborts(self) -> None:
        i = 0
        while i < len(self.ops):
            op = self.ops[i]
            if isinstance(op, Abort) and len(op.request_ids) > 1:
                for rid in op.request_ids:
                    current = self.ops[i] if i < len(self.ops) else None
                    if not isinstance(current, Abort) or len(current.request_ids) < 2:
                        break
                    rest = tuple(r for r in current.request_ids if r != rid)
                    self._try(self.ops[:i] + [Abort(rest)] + self.ops[i + 1 :])
            i += 1

    def _trade_steps(self) -> None:
        """Drop one step by giving an earlier request a block more prompt: the KV-cache pressure
        (preemption, eviction) that steps of decoding built up arrives with fewer operations."""
        block = max(1, self.config.block_size)
        j = len(self.ops) - 1
        while j > 0:
            if j < len(self.ops) and isinstance(self.ops[j], Step):
                for i in range(j):
                    op = self.ops[i] if j < len(self.ops) else None
                    if not isinstance(op, AddRequest):
                        continue
                    longer = op.prompt + tuple(op.prompt[k % len(op.prompt)] for k in range(block))
                    candidate = [*self.ops[:i], replace(op, prompt=longer), *self.ops[i + 1 :]]
                    if self._try(candidate[:j] + candidate[j + 1 :]):
                        break
            j -= 1

    def _shrink_pool(self) -> None:
        """The same operations with fewer KV-cache blocks: of every smaller pool, the one whose
        run fails soonest (the shortest executed prefix, then the fewest blocks). Not the first
        that fails: whether a pool shows the failure, and how early, is not monotone in its size
        (the pressure lands on other steps), and a pool that fails late leaves a longer local
        minimum. The context shrinks with the pool where it must (``_smaller_pool``), never
        below the longest request (``_longest_request``)."""
        best: tuple[tuple[int, ...], list[Op], HarnessConfig] | None = None
        longest = _longest_request(self.ops, self.prefixes)
        for n in _pool_sizes(self.config.num_blocks, 2):
            config = _smaller_pool(self.config, n)
            if config.max_model_len < longest:
                continue
            key = (n, tuple(self.ops))
            if key in self._tried:
                continue
            if self._spent():
                break
            self._tried.add(key)
            kept = self._verdict(self.ops, config)
            if kept is not None and (best is None or self._size(kept, config) < best[0]):
                best = (self._size(kept, config), kept, config)
        if best is not None and best[0] < self._size(self.ops):
            self.ops, self.config = best[1], best[2]

    def _hoist_adds(self) -> None:
        """Move each request earlier, before the steps that precede it, then one op earlier;
        steps that only waited for a late arrival then become removable."""
        i = 1
        while i < len(self.ops):
            op = self.ops[i]
            if isinstance(op, AddRequest) and not isinstance(self.ops[i - 1], AddRequest):
                start = i
                while start > 0 and isinstance(self.ops[start - 1], Step):
                    start -= 1
                for to in dict.fromkeys((start, i - 1)):
                    if to < i:
                        rest = self.ops[:i] + self.ops[i + 1 :]
                        if self._try([*rest[:to], op, *rest[to:]]):
                            break
            i += 1

    def _simplify_adds(self) -> None:
        i = 0
        while i < len(self.ops):
            op = self.ops[i]
            if isinstance(op, AddRequest) and not self._simplify_add(i, op):
                return  # the failure now happens before this request
            i += 1

    def _simplify_add(self, i: int, op: AddRequest) -> bool:
        """Simplify the request at ``i`` field by field; False once the failure moved before it."""
        for group in _simplifications(op):
            for change in group:
                current = self.ops[i] if i < len(self.ops) else None
                if not isinstance(current, AddRequest) or current.request_id != op.request_id:
                    return False
                candidate = [*self.ops[:i], replace(current, **change), *self.ops[i + 1 :]]
                if self._try(candidate):
                    break
        return True


def shrink(
    trace: Trace,
    still_fails: FailsCheck,
    *,
    budget: int | None = None,
    time_budget: float | None = None,
) -> Trace:
    """The smallest trace ``Shrinker`` finds for which ``still_fails`` holds (see ``Shrinker``)."""
    return Shrinker(trace, still_fails, budget=budget, time_budget=time_budget).run().trace


def same_failure(subject: Subject, path: str, **kw: Any) -> Callable[[Trace], Trace | bool]:
    """A ``shrink`` check: the executed prefix when the run's first difference is in the field
    ``path`` names, of whichever request (``compare.field_of``)."""
    wanted = field_of(path)

    def predicate(t: Trace) -> Trace | bool:
        res = run_trace(t, subject, **kw)
        if res.failure is not None and res.failure.field == wanted:
            return res.trace
        return False

    return predicate
