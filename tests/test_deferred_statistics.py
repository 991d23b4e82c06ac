"""Scheduler statistics that differ are reported after an axis run, not at their first report, so
the rest of the axis is still compared past them (``conformance._core.axes.DEFERRED_SECTIONS``).

The positive controls are two mutants of the runtime on the ``stats-events`` axis: one whose
statistics are throttled (``statistics_throttled``: ``make_stats`` returns ``None`` between
reports, as vllm-omni's scheduler does within a second) and the same throttle on a scheduler that
also requeues a preempted request at the back of the waiting queue (a lifecycle bug that only
shows after some steps). The throttle alone fails the run with the statistics difference, saved
shrunk; with both, the run fails with the lifecycle difference, whose trace replays with
statistics set aside, and the statistics difference is kept beside it with its own trace.

Why this can fail: a statistics difference that still ends every session (the lifecycle bug is
never reached), one that is dropped instead of reported, or a trace found past it that does not
replay because its replay compares statistics again.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

from conformance._core.axes import DEFERRED_SECTIONS, axis
from conformance._core.lockstep import SET_ASIDE, SubjectBroken, run_trace
from conformance._core.needs import features_of
from conformance._core.replay import load_trace
from conformance.plugin import ConformanceRecorder
from invariants.machines import (
    MachineRun,
    harness_config,
    raise_failure,
    replay_audit,
    run_machine,
)
from omni_runtime.conformance_subject import OmniSubject
from tests.mutants.runtime_mutants import (
    RepeatsFinishedOutput,
    RequeuePreemptedAtBack,
    StatisticsThrottled,
    _subject_with,
)
from tests.test_audit_traces import NO_SHRINK

pytestmark = [pytest.mark.clauses("C-09")]

SETTINGS = settings(NO_SHRINK, max_examples=12)


class ThrottledAndRequeued(StatisticsThrottled, RequeuePreemptedAtBack):
    """Both bugs at once: the statistics differ from the second update on."""


def _axis_run(subject, tmp_path: Path, defer: tuple[str, ...]) -> tuple[MachineRun, Exception]:
    chosen = axis("stats-events")
    feature = {f.name: f for f in features_of(subject)}["off"]
    recorder = ConformanceRecorder("omni", subject, failures_dir=str(tmp_path))
    run = MachineRun(
        recorder,
        subject,
        feature,
        chosen.config(harness_config(feature, mode="sync", prefix=True)),
        "stats-events-sync",
        request_values=chosen.request_values,
        defer=defer,
    )
    outcome = run_machine(run, SETTINGS)
    assert outcome.error is not None, "the mutant was not caught"
    with pytest.raises(Exception) as info:
        raise_failure(outcome, run)
    return run, info.value


def test_a_throttled_subject_fails_on_its_statistics_shrunk(tmp_path):
    subject = _subject_with(scheduler_mixin=StatisticsThrottled)
    run, error = _axis_run(subject, tmp_path, DEFERRED_SECTIONS)
    assert isinstance(error, SubjectBroken)
    assert error.difference.path.startswith("stats")
    recorder = run.recorder
    assert recorder.first_difference["path"].startswith("stats")
    assert recorder.set_aside is not None and recorder.set_aside["trace"] == recorder.trace
    trace = load_trace(recorder.trace)
    assert SET_ASIDE not in trace.meta
    # The second update is the first the throttle withholds: a request and two steps.
    assert len(trace.ops) <= 3, [op.describe() for op in trace.ops]
    rerun = run_trace(trace, subject)
    assert rerun.failure is not None and rerun.failure.path == recorder.first_difference["path"]
    assert run_trace(trace, OmniSubject()).failure is None


def test_a_lifecycle_bug_past_the_statistics_is_found_and_replays(tmp_path):
    subject = _subject_with(scheduler_mixin=ThrottledAndRequeued)
    # Without deferral every session ends at the throttle's first withheld report.
    _, plain = _axis_run(subject, tmp_path / "plain", ())
    assert isinstance(plain, SubjectBroken) and plain.difference.path.startswith("stats")

    run, error = _axis_run(subject, tmp_path / "deferred", DEFERRED_SECTIONS)
    assert isinstance(error, SubjectBroken)
    assert not error.difference.path.startswith("stats"), error.difference.headline()
    recorder = run.recorder
    recorder.finish()  # the plugin shrinks the lock-step failure when the test ends
    lifecycle = load_trace(recorder.trace)
    assert lifecycle.meta[SET_ASIDE] == ["stats"]
    replayed = run_trace(lifecycle, subject)
    assert replayed.failure is not None
    assert replayed.failure.path == recorder.first_difference["path"]
    assert run_trace(lifecycle, OmniSubject()).failure is None
    # The statistics difference is kept beside it, with a trace of its own.
    found = recorder.set_aside
    assert found is not None and found["trace"] != recorder.trace
    assert found["first_difference"]["path"].startswith("stats")
    stats_trace = load_trace(found["trace"])
    assert run_trace(stats_trace, subject).failure.path == found["first_difference"]["path"]


class ThrottledAndRepeated(StatisticsThrottled, RepeatsFinishedOutput):
    """The throttle and a finished request's output emitted twice (an audit problem, C-62)."""


def test_an_audit_problem_past_the_statistics_replays_with_them_set_aside(tmp_path):
    subject = _subject_with(scheduler_mixin=ThrottledAndRepeated)
    run, error = _axis_run(subject, tmp_path, DEFERRED_SECTIONS)
    assert str(error).startswith("C-62"), error
    trace = load_trace(run.recorder.trace)
    assert trace.meta["kind"] == "audit" and trace.meta[SET_ASIDE] == ["stats"]
    assert len(trace.ops) < trace.meta["found"]["ops"] or len(trace.ops) <= 4
    assert replay_audit(trace, subject)[0].startswith("C-62")
    assert replay_audit(trace, OmniSubject()) == []


def test_the_report_lists_a_set_aside_difference_beside_the_failure():
    from conformance._core.report import ReportBuilder, TestRecord, render_markdown, validate

    stats = {"step": 2, "op": "step", "path": "stats", "upstream": {"a": 1}, "subject": None}
    queue = {"step": 9, "op": "step", "path": "queues.waiting", "upstream": [1], "subject": [2]}
    env = {"vllm": "0.33.0", "torch": "2.x", "python": "3.11.7"}
    builder = ReportBuilder(subject="s", profile="ci", seed=0, environment=env)
    builder.add(
        TestRecord(
            "t::test_scheduler_axis[off-stats-events-sync]",
            "failed",
            ["C-09"],
            first_difference=queue,
            trace="f/lifecycle.json",
            set_aside={"first_difference": stats, "trace": "f/stats.json"},
        )
    )
    report = builder.build()
    validate(report)
    (failure,) = report["failures"]
    assert failure["set_aside"]["message"].startswith("step 2 (step) stats:")
    text = render_markdown(report)
    assert "also, set aside to compare the rest: step 2 (step) stats:" in text
    assert "omni-conformance replay f/stats.json" in text
