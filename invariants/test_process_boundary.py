"""C-46: what crosses a stage's process boundary arrives unchanged, and nothing of it stays.

A subject whose scheduler runs in a process of its own (``process_boundary``,
``conformance._core.capabilities.ProcessBoundary``) admits requests through ``admit`` and hands
each step's outputs through ``receive_outputs``, as its runtime does across the boundary.
Every audited lock-step session (``invariants.machines.AuditedLockstep``) checks each crossing
and the boundary's leftovers after every operation; ``test_stage_inputs_cross_unchanged``
below admits generated stage inputs with tensors of every dtype and layout the input adapter
accepts, then aborts them: slots arrive unchanged, the request is queued when ``admit``
returns, and the abort leaves the boundary empty (an accepted input must be able to cross,
C-13).

Not applicable without ``process_boundary``. The clause and its mutants: docs/contracts.md; the
inputs drawn: docs/design.md, "How the suite checks".
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given

from conformance._core.capabilities import ProcessBoundary
from conformance._core.needs import require
from invariants.audits import crossing_problems, leftover_problems
from invariants.machines import suite_settings
from invariants.strategies import every_slot_kind, stage_inputs

pytestmark = [pytest.mark.invariants]


def _sampling(max_tokens: int) -> Any:
    from vllm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens)


def check_stage_input_crosses(
    subject: Any, boundary: ProcessBoundary, probe: Any, scheduler: Any, rid: str, fields: dict
) -> None:
    """Raise AssertionError when ``fields``, admitted as ``rid``, does not cross as C-46 says."""
    from vllm.v1.request import RequestStatus

    try:
        request = probe.build(scheduler, rid, _sampling(2), **fields)
    except probe.rejection as exc:
        # Refusing what cannot cross is the adapter's right (C-13 names the field); nothing
        # may have reached the scheduler.
        assert getattr(exc, "request_id", None) == rid and getattr(exc, "field", None), (
            f"C-13: {rid}: the rejection names {exc.request_id!r} / {exc.field!r}"
        )
        assert rid not in scheduler.requests, f"C-13: rejected {rid} reached the scheduler"
        return
    try:
        subject.admit(scheduler, request)
    except Exception as exc:  # noqa: BLE001 - any failure to cross is the finding
        raise AssertionError(
            f"C-46: {rid}: the input adapter accepted a stage input that cannot cross the "
            f"process boundary ({type(exc).__name__}: {exc})"
        ) from exc
    problems = crossing_problems(boundary.request_crossings(scheduler))
    if rid not in scheduler.requests:
        problems.append(f"C-46: {rid} is not in the scheduler once admitted")
    scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
    problems += crossing_problems(boundary.chunk_crossings(scheduler))
    problems += leftover_problems(boundary.leftovers(scheduler), f"after aborting {rid}")
    assert not problems, problems[0] + (f" (+{len(problems) - 1} more)" if problems[1:] else "")


@pytest.mark.clauses("C-46")
def test_stage_inputs_cross_unchanged(conformance_subject):
    boundary = require(conformance_subject, "process_boundary", "process boundary")
    probe = require(conformance_subject, "input_adapter", "input adapter")
    scheduler = probe.scheduler()
    check_stage_input_crosses(
        conformance_subject, boundary, probe, scheduler, "every-kind", every_slot_kind(probe.spec)
    )
    count = [0]

    @suite_settings(60)
    @given(stage_inputs(probe.spec))
    def prop(fields: dict[str, Any]) -> None:
        count[0] += 1
        check_stage_input_crosses(
            conformance_subject, boundary, probe, scheduler, f"in{count[0]}", fields
        )

    prop()
    assert count[0] > 0
