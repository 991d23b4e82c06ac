"""An audit failure (a run-time audit of the invariant suite, not a lock-step difference) is saved
as a shrunk, replayable trace, under every profile, like a lock-step failure.

The positive control is the ``extra_request_attribute`` mutant (C-12: the input adapter sets an
undeclared attribute on ``Request``): the audited machine fails, ``raise_failure`` shrinks the
failing program with the harness's bounded shrinker and writes it with ``meta.kind == "audit"``;
replaying it on the mutated runtime reproduces the C-12 problem, and on the healthy runtime it
does not reproduce — in process and through ``omni-conformance replay`` (exit 3).

Why this can fail: audit failures written unshrunk or not at all, a trace that does not carry
the feature it ran with, or a replay that cannot tell a fixed runtime from a broken one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings

from conformance._core.needs import features_of
from conformance._core.replay import load_trace
from conformance.cli import main
from invariants.machines import MachineRun, harness_config, raise_failure, replay_audit, run_machine
from omni_runtime.conformance_subject import OmniSubject
from tests.mutants.runtime_mutants import by_name


class Recorder:
    """The plugin recorder's surface that ``raise_failure`` uses."""

    def __init__(self, spec: str) -> None:
        self.subject_spec = spec
        self.trace: str | None = None
        self.sessions: list = []
        self.examples = 0

    def fail(self, session, name):  # pragma: no cover - not a lock-step bug
        raise AssertionError(session.failure.headline())


# The ci profile's shape: no hypothesis shrink phase, so the harness's shrinker must do it.
NO_SHRINK = settings(
    max_examples=20,
    stateful_step_count=40,
    derandomize=True,
    database=None,
    deadline=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.clauses("C-12")
def test_audit_failure_is_shrunk_saved_and_replayed(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_CONFORMANCE_FAILURES", str(tmp_path))
    subject = OmniSubject()
    feature = {f.name: f for f in features_of(subject)}["token-updates"]
    recorder = Recorder("omni")
    run = MachineRun(
        recorder, subject, feature, harness_config(feature, mode="sync", prefix=True), "audit-c12"
    )
    with by_name("extra_request_attribute").apply():
        outcome = run_machine(run, NO_SHRINK)
        assert outcome.error is not None, "the audit did not catch the mutant"
        with pytest.raises(AssertionError, match=r"(?s)^C-12: .*\ntrace: ") as info:
            raise_failure(outcome, run)
        assert recorder.trace is not None
        trace = load_trace(recorder.trace)
        assert trace.meta["kind"] == "audit" and trace.meta["subject"] == "omni"
        assert trace.meta["feature"]["name"] == "token-updates"
        assert trace.meta["problem"].startswith("C-12")
        # One request added is enough to show an undeclared attribute.
        assert len(trace.ops) <= 2, [op.describe() for op in trace.ops]
        assert trace.meta["found"]["ops"] >= len(trace.ops)
        assert replay_audit(trace, subject)[0].startswith("C-12")
    assert str(info.value).splitlines()[0] == trace.meta["problem"]
    # The healthy runtime: the same trace no longer shows the problem.
    assert replay_audit(trace, OmniSubject()) == []
    assert main(["replay", str(recorder.trace)]) == 3
    saved = json.loads(Path(recorder.trace).read_text())
    assert saved["meta"]["replay"] == "invariants.machines:replay_audit"


class FolderRecorder(Recorder):
    def __init__(self, spec: str, folder: str) -> None:
        super().__init__(spec)
        self.failures_dir = folder


@pytest.mark.clauses("C-45")
def test_a_reset_in_flight_failure_is_saved_and_replayed(tmp_path):
    """``test_rows_survive_a_reset_with_steps_in_flight`` (a property over fixed-shape async
    workloads, not the chunk machine) saves its failure like the chunk machine does."""
    from invariants import test_chunk_contracts as chunk
    from invariants.test_chunk_contracts import replay_chunk

    recorder = FolderRecorder("omni", str(tmp_path))
    with by_name("stale_step_chunk_sent").apply() as applied:
        subject = applied if isinstance(applied, OmniSubject) else OmniSubject()
        with pytest.raises(AssertionError, match=r"(?s)C-45.*\ntrace: ") as info:
            chunk.test_rows_survive_a_reset_with_steps_in_flight(recorder, subject)
        assert recorder.trace is not None and str(info.value).endswith(recorder.trace)
        trace = load_trace(recorder.trace)
        assert trace.meta["kind"] == "audit" and trace.meta["problem"].startswith("C-45")
        assert replay_chunk(trace, subject)[0].startswith("C-45")
    assert replay_chunk(trace, OmniSubject()) == []
