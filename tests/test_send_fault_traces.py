"""A send-path fault check's failure is saved as a replayable trace, like every other failure.

The positive control is the ``send_fault_fails_neighbours`` mutant (C-61: a processor fault
fails every request of the step, not only its own): ``test_a_send_path_fault_stays_with_its_request``
fails, names the trace it saved, and replaying that trace reproduces the problem on the mutant
and not on the unmodified runtime; on a subject without a send path it cannot happen
(``NotApplicable``, which ``replay`` reports as "does not reproduce").

Why this can fail: a failure saved without its example (processor, victim, fault position,
mode), or a replay that runs another workload than the one that failed.
"""

from __future__ import annotations

import pytest

from conformance._core.capabilities import NotApplicable
from conformance._core.replay import load_trace
from conformance._core.subjects import UpstreamSubject
from invariants import test_send_path_faults as send_faults
from invariants.test_send_path_faults import replay_send_fault
from omni_runtime.conformance_subject import OmniSubject
from tests.mutants.runtime_mutants import by_name

pytestmark = pytest.mark.clauses("C-61")


class Recorder:
    """The plugin recorder's surface the check uses."""

    def __init__(self, folder: str) -> None:
        self.subject_spec = "mutant"
        self.failures_dir = folder
        self.trace: str | None = None


def test_a_send_path_failure_is_saved_and_replays(tmp_path):
    recorder = Recorder(str(tmp_path))
    with by_name("send_fault_fails_neighbours").apply() as applied:
        subject = applied if isinstance(applied, OmniSubject) else OmniSubject()
        with pytest.raises(AssertionError) as info:
            send_faults.test_a_send_path_fault_stays_with_its_request(recorder, subject, "sync")
        message = str(info.value)
        assert message.startswith("C-61") and "\ntrace: " in message, message
        assert recorder.trace is not None and message.endswith(recorder.trace)
        trace = load_trace(recorder.trace)
        assert trace.meta["kind"] == "audit" and trace.meta["example"]["mode"] == "sync"
        assert trace.meta["problem"] == message.splitlines()[0]
        # Its requests are the workload's; the run steps them to the drain.
        assert 1 <= len(trace.ops) <= 6
        again = replay_send_fault(trace, subject)
        assert again and again[0].split(":", 1)[0] == "C-61", again
    assert replay_send_fault(trace, OmniSubject()) == []
    with pytest.raises(NotApplicable):
        replay_send_fault(trace, UpstreamSubject())
