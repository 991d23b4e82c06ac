"""Every behaviour in which omni_runtime's schedulers differ from upstream vLLM (C-02, C-03).

This is the runtime's side of AR-INV-001: a difference observed by the conformance harness is
tolerated only when an entry below names the field, its ``applies`` condition holds for the
observed difference, and a named test makes the difference happen. Anything else is a failure.
The harness reads ``DIFFERENCES``; the entry type is the harness's own
``conformance._core.differences.Difference``, as for any subject.

``fields`` are ``fnmatch`` patterns over the harness's field paths (``outputs.<req>.omni_eof``);
``applies(ctx)`` receives the harness's difference context, a mapping with at least ``path``,
``upstream`` and ``subject`` (the two values), ``request_id`` (or None), ``config`` (the harness
configuration as a dict) and ``subject_state`` (the subject's extra per-request facts, such as
whether a request has a downstream consumer).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from conformance.api import Difference


def _stage(ctx: Mapping[str, Any]) -> Mapping[str, Any]:
    config = ctx.get("config") or {}
    return (config.get("additional_config") or {}).get("omni_stage") or {}


def _has_downstream(ctx: Mapping[str, Any]) -> bool:
    facts = (ctx.get("subject_state") or {}).get(ctx.get("request_id") or "", {})
    return bool(_stage(ctx).get("downstream")) and bool(facts.get("has_downstream"))


def _extra_field_absent_upstream(ctx: Mapping[str, Any]) -> bool:
    # Upstream has no such field at all; the omni value must be the field's own non-default.
    return ctx.get("upstream") is None and _has_downstream(ctx)


def _processor_failed(ctx: Mapping[str, Any]) -> bool:
    # A request-level field differs only for the failed request itself; shared structures (queues,
    # block pool, scheduler output) differ once any request has been failed by the send path.
    state = ctx.get("subject_state") or {}
    rid = ctx.get("request_id")
    if rid is not None and str(ctx.get("path", "")).startswith(("requests.", "outputs.")):
        return bool(state.get(rid, {}).get("transfer_failed"))
    return any(facts.get("transfer_failed") for facts in state.values())


DIFFERENCES: tuple[Difference, ...] = (
    Difference(
        id="OMNI-OUT-001",
        fields=("outputs.*.omni_chunk_refs", "outputs.*.omni_eof", "outputs.*.__type__"),
        condition="the request has a downstream consumer and its step delivered a chunk",
        applies=_extra_field_absent_upstream,
        rationale=(
            "Omni payload references ride on EngineCoreOutput as trailing msgspec fields "
            "(OmniEngineCoreOutput) so the orchestrator can route chunks; upstream decoders "
            "ignore them. Upstream has no such fields, so the values differ by construction."
        ),
        tests=("tests/test_omni_scheduler.py::test_chunk_refs_ride_on_engine_core_outputs",),
        clauses=("C-02", "C-40", "C-43"),
    ),
    Difference(
        id="OMNI-ERR-001",
        fields=("requests.*", "outputs.*", "queues.*", "block_pool.*", "sched_out.*"),
        condition="the stage's chunk processor or connector raised for this request",
        applies=_processor_failed,
        rationale=(
            "A fault in the send path fails only the request it touches with an error finish "
            "reason (C-61); upstream has no send path, so it keeps running the request."
        ),
        tests=(
            "tests/test_omni_scheduler.py::test_processor_fault_fails_only_its_request",
            "tests/test_lockstep_faults.py::test_omni_err_001_tolerates_a_failed_send",
            "tests/test_lockstep_faults.py::test_omni_err_001_is_still_needed",
        ),
        clauses=("C-02", "C-61"),
        # A processor or connector that raised: the gate plants such faults; its own lock-step
        # programs plant none, so a failure there is the runtime's own (C-61).
        planted_only=True,
    ),
)


def by_id(difference_id: str) -> Difference:
    for d in DIFFERENCES:
        if d.id == difference_id:
            return d
    raise KeyError(difference_id)
