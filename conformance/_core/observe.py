"""Observation: normalised, comparable snapshots of one scheduler after each operation.

A snapshot is a nested ``dict`` of plain values whose dotted key paths are the *field paths*
comparisons, registry patterns and failure reports use: ``requests.<id>.<field>``,
``queues.<name>``, ``block_pool.<field>``, ``sched_out.<field>``, ``outputs.<id>.<field>`` and
``audit.leaked_omni_ids`` (C-04). No timestamps are read, sets are sorted, live lists are copied
as they are read; every vLLM internal is read through ``vllm_compat``.

An ``Observation`` holds one side's live state; ``same_state`` checks both sides in place
(``vllm_compat.same_scheduler_state``, ``same_outputs``) and says equal only if the snapshots
would be, so they are built and compared field by field only when it cannot show equality.

Every field of every section: docs/design.md, "Inside the gate"; why snapshots are built lazily
and what it saved: docs/design.md, "The gate".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from conformance._core import vllm_compat as vc
from conformance._core.logprobs import output_logprobs, output_prompt_logprobs

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutputs

    from conformance._core.subjects import Subject


def leaked_omni_ids(scheduler: Scheduler, subject: Subject) -> list[str]:
    """Ids the subject's own structures hold although the scheduler no longer does (C-04)."""
    live = scheduler.requests
    ids = subject.live_omni_ids(scheduler)
    if isinstance(ids, set | frozenset):  # the protocol's type: one C-level difference
        return sorted(ids.difference(live))
    return sorted(i for i in ids if i not in live)


def observe_state(scheduler: Scheduler, subject: Subject) -> dict[str, Any]:
    requests: dict[str, Any] = {}
    block_ids = vc.block_ids_reader(scheduler)
    request_fields = vc.request_fields
    for rid, req in scheduler.requests.items():
        fields = request_fields(req)
        fields["block_ids"] = block_ids(rid)
        requests[rid] = fields
    pool = vc.block_pool(scheduler)
    refs, hashed = vc.block_table(pool)
    leaked = leaked_omni_ids(scheduler, subject)
    state = {
        "requests": requests,
        "queues": vc.scheduler_queues(scheduler),
        "block_pool": {
            "num_free": vc.num_free_blocks(pool),
            "free_order": vc.free_block_order(pool),
            "ref_counts": refs,
            "hashed_blocks": hashed,
            "num_cached_hashes": vc.num_cached_hashes(pool),
        },
        "audit": {"leaked_omni_ids": leaked},
    }
    encoder = vc.encoder_cache_state(scheduler)
    if encoder is not None:  # a multimodal model's only: text runs' snapshots are unchanged
        state["encoder_cache"] = encoder
    return state


def observe_schedule(so: SchedulerOutput) -> dict[str, Any]:
    """The ``SchedulerOutput``, copied right after ``schedule()`` returned."""
    fields = vc.schedule_fields(so)
    fields.update(vc.encoder_schedule_fields(so))
    ec_meta = vc.ec_metadata(so)
    if ec_meta is not None:  # an EC connector's step metadata: absent without one
        fields["ec_connector_metadata"] = ec_meta
    return fields


def observe_outputs(outputs: dict[int, EngineCoreOutputs] | None) -> dict[str, Any]:
    result: dict[str, Any] = {}
    if not outputs:
        return result
    # The type name depends on the output's class alone: looked up once per class per step.
    type_names: dict[type, str | None] = {}
    for client in sorted(outputs):
        for out in outputs[client].outputs:
            cls = type(out)
            if cls in type_names:
                type_name = type_names[cls]
            else:
                type_name = type_names[cls] = vc.output_type_name(out)
            entry: dict[str, object] = {
                "new_token_ids": tuple(out.new_token_ids),
                "finish_reason": vc.finish_reason_name(out.finish_reason),
                "stop_reason": out.stop_reason,
                "prefill_stats": vc.prefill_stats_fields(out.prefill_stats),
                "__type__": type_name,
            }
            headers = vc.output_trace_headers(out)
            if headers is not None:  # absent when unset: snapshots of untraced runs unchanged
                entry["trace_headers"] = headers
            if client:  # likewise: single-client snapshots are as they were
                entry["client"] = client
            # Present only when set (statistics, spec decoding, a KV connector): snapshots of
            # runs without them are unchanged.
            events = vc.request_events(out)
            if events is not None:
                entry["events"] = events
            metrics = vc.spec_decode_metrics(out)
            if metrics is not None:
                entry["spec_decode_metrics"] = metrics
            if out.kv_transfer_params is not None:
                entry["kv_transfer_params"] = vc.plain(out.kv_transfer_params)
            ec_params = vc.ec_transfer_params(out)
            if ec_params is not None:
                entry["ec_transfer_params"] = ec_params
            # Sampling masks and routed experts: likewise present only when the runner returned
            # them (``vllm_compat.aux_outputs``).
            aux = vc.aux_output_fields(out)
            if aux:
                entry.update(aux)
            logprobs = output_logprobs(out)
            if logprobs is not None:
                entry["logprobs"] = logprobs
            prompt_logprobs = output_prompt_logprobs(out)
            if prompt_logprobs is not None:
                entry["prompt_logprobs"] = prompt_logprobs
            pooled = vc.pooled_output(out)
            if pooled is not None:
                entry["pooling_output"] = pooled
            extra = vc.output_extra_fields(out)
            if extra:
                entry.update(extra)
            key = out.request_id
            n = 2
            while key in result:
                key = f"{out.request_id}#{n}"
                n += 1
            result[key] = entry
    return result


class Observation:
    """One side's state right after one operation, held where it lies until it is needed.

    ``snapshot()`` builds the snapshot above (``observe_state`` plus the operation's own
    observations); lock-step needs it only when ``same_state`` cannot show the two sides equal,
    or when a caller reads it (``Lockstep._last_up`` / ``last_sub``). It reads the scheduler as
    it is, so it must be built before the side runs its next operation: the side calls
    ``expire()`` then, and a later ``snapshot()`` raises instead of returning a later state.

    ``extra`` holds the operation's observations in snapshot order (``sched_out``, ``outputs``,
    ``updated``, ``result``, ``exception``); its ``outputs`` is a placeholder for the step's
    output objects, ``outputs``, which ``observe_outputs`` normalises with the snapshot. An
    observation made from a finished snapshot (another process's) has no scheduler.
    """

    __slots__ = ("scheduler", "subject", "extra", "outputs", "_snapshot", "_expired")

    def __init__(
        self,
        scheduler: Scheduler | None,
        subject: Subject | None,
        extra: dict[str, Any],
        outputs: dict[int, EngineCoreOutputs] | None,
    ) -> None:
        self.scheduler = scheduler
        self.subject = subject
        self.extra = extra
        self.outputs = outputs
        self._snapshot: dict[str, Any] | None = None
        self._expired = False

    @classmethod
    def of_snapshot(cls, snapshot: dict[str, Any]) -> Observation:
        obs = cls(None, None, {}, None)
        obs._snapshot = snapshot
        return obs

    def snapshot(self) -> dict[str, Any]:
        snap = self._snapshot
        if snap is None:
            if self._expired:
                raise RuntimeError(
                    "the snapshot of an operation was asked for after the side ran the next one"
                )
            # Only an observation made from a snapshot has no scheduler (and no subject), and
            # that one has its snapshot.
            assert self.scheduler is not None and self.subject is not None
            snap = observe_state(self.scheduler, self.subject)
            snap.update(self.extra)
            if "outputs" in snap:
                try:
                    snap["outputs"] = observe_outputs(self.outputs)
                except Exception as exc:  # outputs that cannot be read: a crash of the step
                    del snap["outputs"], snap["updated"]
                    snap["exception"] = f"{type(exc).__name__}: {exc}"[:300]
            self._snapshot = snap
        return snap

    def expire(self) -> None:
        self._expired = True

    def step_outputs(self) -> dict[str, Any]:
        """The snapshot's ``outputs`` (empty when the operation had none or they could not be
        read), without building the rest of the snapshot: checks that follow each request's
        outputs read only these."""
        if self._snapshot is not None or self.scheduler is None:
            return self.snapshot().get("outputs") or {}
        if "outputs" not in self.extra:
            return {}
        if self._expired:
            raise RuntimeError(
                "the outputs of an operation were asked for after the side ran the next one"
            )
        try:
            return observe_outputs(self.outputs)
        except Exception:  # the snapshot records these as the step's exception, not outputs
            return {}

    def get(self, key: str) -> Any:
        """One of the operation's own observations (``result``, ``sched_out``, ...)."""
        if self.scheduler is None:
            return self.snapshot().get(key)
        return self.extra.get(key)

    def preemption_counts(self) -> tuple[list[str], list[int]]:
        """Ids of the requests held, and how often each was preempted."""
        if self.scheduler is None:
            requests = self.snapshot()["requests"]
            return list(requests), [f["num_preemptions"] for f in requests.values()]
        return vc.preemption_counts(self.scheduler)

    def any_stale_tokens(self) -> bool:
        """Whether some request held has stale output tokens (async scheduling)."""
        if self.scheduler is None:
            return any(map(vc.stale_in_fields, self.snapshot()["requests"].values()))
        return vc.has_stale_tokens(self.scheduler)

    def output_facts(self) -> list[tuple[Any, Any, Any]]:
        """(prefill stats, finish reason, stop reason) in snapshot form of each output that has
        prefill stats or a finish reason."""
        if self.scheduler is None:
            outs = (self.snapshot().get("outputs") or {}).values()
            return [
                (o.get("prefill_stats"), o.get("finish_reason"), o.get("stop_reason"))
                for o in outs
                if o.get("prefill_stats") is not None or o.get("finish_reason") is not None
            ]
        return vc.output_facts(self.outputs)


def same_state(a: Observation, b: Observation) -> bool:
    """True only if ``a.snapshot() == b.snapshot()``, decided without building them.

    False proves nothing (a snapshot from another process cannot be checked this way; two values
    can differ as read and agree once normalised): the caller then compares the snapshots.
    """
    # An observation without a scheduler (made from a snapshot) has no subject either.
    if a.scheduler is None or b.scheduler is None or a.subject is None or b.subject is None:
        return False
    if a.extra != b.extra:
        return False
    try:
        return (
            vc.same_outputs(a.outputs, b.outputs)
            and vc.same_scheduler_state(a.scheduler, b.scheduler)
            and leaked_omni_ids(a.scheduler, a.subject) == leaked_omni_ids(b.scheduler, b.subject)
        )
    except Exception:  # state the check cannot read: the snapshots say what it is
        return False
