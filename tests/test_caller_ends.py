"""Which requests owe their downstream an EOF chunk (C-43), and which are ended there by their
caller instead (C-46): the chunk ledger's judgement, on a subject that declares ``abort_eof`` or
``error_eof`` False (vllm-omni's orchestrator aborts a request in every stage when a stage
aborts it or reports its error) and on one that declares neither.

The planted failures: an EOF that crosses for a request its caller aborted, two for one that
errored, and a missing EOF for a request that errored on a subject that promises one. And the harness's own false alarm this
guards against: a request that had already finished (its blocks held for a KV connector's
send) when an abort for it came is not aborted, as upstream's ``finish_requests`` skips it.

Why this can fail: a ledger that owes an EOF where the subject's caller ends the request, one
that lets an EOF cross where none may, or an abort of a finished request counted as an abort.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conformance._core.capabilities import OFF, ChunkView
from invariants.ledger import RequestLedger, caller_ends, ledger_problems

pytestmark = pytest.mark.clauses("C-43", "C-46")


class Delivery:
    def __init__(self, *, abort_eof: bool = True, error_eof: bool = True) -> None:
        self.abort_eof = abort_eof
        self.error_eof = error_eof

    def view(self, chunk: ChunkView) -> ChunkView:
        return chunk

    def expected_tokens(self, feature, emitted):
        return None  # only the EOF accounting is judged here


def _problems(entry: RequestLedger, chunks: list[ChunkView], delivery: Delivery) -> list[str]:
    session = SimpleNamespace(
        sub=SimpleNamespace(chunks=chunks),
        ledger={"r0": entry},
        facts={"r0": {"has_downstream": True}},
    )
    return ledger_problems(session, OFF, delivery)


EOF = [ChunkView("r0", 0, True)]


def test_an_errored_request_owes_an_eof_unless_its_caller_ends_it():
    errored = RequestLedger([1], finish_reason="error")
    assert caller_ends(errored, abort_eof=True, error_eof=True) is None
    assert _problems(errored, EOF, Delivery()) == []
    (missing,) = _problems(errored, [], Delivery())
    assert missing.startswith("C-43: r0 (error) got 0 EOF deliveries")
    # Declared as ended by its caller: none owed, and none may cross.
    assert caller_ends(errored, abort_eof=True, error_eof=False) == "finished with an error"
    assert _problems(errored, [], Delivery(error_eof=False)) == []
    # One EOF may still cross (the error came in the step that ended its last chunk); two not.
    assert _problems(errored, EOF, Delivery(error_eof=False)) == []
    twice = [ChunkView("r0", 0, True), ChunkView("r0", 1, True)]
    (crossed,) = _problems(errored, twice, Delivery(error_eof=False))
    assert crossed.startswith("C-43/C-46: r0 was finished with an error, and its caller ends")
    # The declaration is about errors only: a request that stopped still owes its EOF.
    stopped = RequestLedger([1], finish_reason="stop")
    assert _problems(stopped, [], Delivery(error_eof=False, abort_eof=False))


def test_an_aborted_request_is_judged_by_abort_eof_alone():
    aborted = RequestLedger([1], aborted=True)
    assert _problems(aborted, EOF, Delivery(error_eof=False)) == []
    (crossed,) = _problems(aborted, EOF, Delivery(abort_eof=False))
    assert "aborted by its caller" in crossed


def test_an_abort_of_a_request_that_already_finished_is_no_abort(tmp_path):
    """Through the audited session: a P/D producer's finished request is still held (its blocks
    wait for the send) when the abort comes; it keeps its outcome and its EOF."""
    from conformance._core.axes import axis
    from conformance._core.needs import features_of
    from conformance._core.workload import Abort, AddRequest, Step
    from invariants.machines import AuditedLockstep, harness_config
    from omni_runtime.conformance_subject import OmniSubject

    subject = OmniSubject()
    feature = next(f for f in features_of(subject) if f.name == "token-updates")
    cfg = axis("kv-harness-recompute").config(harness_config(feature, mode="sync", prefix=True))
    session = AuditedLockstep(cfg, subject, feature=feature)
    try:
        session.apply(
            AddRequest(
                "r0", (137,), max_tokens=1, ignore_eos=True, kv_transfer_params=(("send_steps", 2),)
            )
        )
        session.apply(Step())
        assert "r0" in session.sub.scheduler.requests, "the connector no longer holds r0"
        session.apply(Abort(("r0",)))
        entry = session.ledger["r0"]
        assert entry.finish_reason == "length" and not entry.aborted
    finally:
        session.shutdown()
