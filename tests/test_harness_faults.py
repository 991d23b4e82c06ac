"""The harness's own bugs stop a run as harness errors, never as findings about the subject.

Two places where harness code runs where a subject's fault would show: the token source that
stands in for the model (a crash there used to be recorded as an observed difference, and a crash
on both sides compared equal), and a generated chunk processor the subject's scheduler calls (the
subject's fault containment used to fail the request, which reads as the subject's C-61 finding).
A token-source crash on the subject's output alone stays the subject's difference.
"""

from __future__ import annotations

import pytest

from conformance._core.harness_faults import (
    HarnessError,
    forget_pending,
    harness_code,
    raise_pending,
)
from conformance._core.lockstep import Lockstep
from conformance._core.machine import TIGHT
from conformance._core.workload import AddRequest, Step
from invariants.strategies import ProcessorSpec
from omni_runtime.conformance_subject import OmniSubject

pytestmark = pytest.mark.clauses("C-01")


def _session() -> Lockstep:
    feat = OmniSubject().feature_configs()["token-updates"]
    cfg = TIGHT.with_(additional_config=feat["additional_config"])
    session = Lockstep(cfg, OmniSubject())
    session.apply(AddRequest("r0", tuple(range(10, 30)), max_tokens=6))
    return session


def test_a_token_source_crash_is_a_harness_error_on_both_sides() -> None:
    session = _session()
    for side in (session.up, session.sub):
        # token_at takes the position modulo (vocab - 3): the same crash on both sides.
        side.executor.vocab = 3
    with pytest.raises(HarnessError, match="DeterministicTokenSource.execute.*ZeroDivisionError"):
        for _ in range(4):
            session.apply(Step())
    assert session.failure is None  # no difference was reported about the subject


def test_a_token_source_crash_on_the_subjects_output_alone_is_the_subjects_difference() -> None:
    session = _session()
    session.sub.executor.vocab = 3  # as if the subject's SchedulerOutput made the source raise
    for _ in range(4):
        if session.apply(Step()).failure is not None or session.failure is not None:
            break
    # Reported as the subject's difference at the step that crashed (no HarnessError raised).
    assert session.failure is not None and session.failure.op == "step"
    assert session.sub.last_observation is not None
    assert "ZeroDivisionError" in session.sub.last_observation.extra["exception"]


def test_a_processor_crash_the_subject_contains_is_still_a_harness_error() -> None:
    session = _session()
    processor = ProcessorSpec(True, "tokens", takes_ids=True, mutate_ids=False).build()
    processor.calls = None  # type: ignore[assignment]  # record() now raises AttributeError
    OmniSubject().chunk_delivery().set_processor(session.sub.scheduler, processor)
    with pytest.raises(HarnessError, match="RecordingProcessor.record.*AttributeError"):
        for _ in range(4):
            session.apply(Step())
    assert session.failure is None


def test_a_remembered_error_is_raised_once() -> None:
    @harness_code
    def broken() -> None:
        raise KeyError("x")

    forget_pending()
    with pytest.raises(HarnessError) as caught:
        broken()  # a subject would catch this ...
    assert isinstance(caught.value.__cause__, KeyError)
    with pytest.raises(HarnessError):
        raise_pending()  # ... and the harness raises it after the step
    raise_pending()  # then it is gone
