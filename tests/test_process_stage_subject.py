"""The invariant suite against ``omni-process-stage``: the omni schedulers as they run inside a
stage process, reached only the way the gate reaches any subject.

The default lane runs the suite against one subject (``omni``); this module runs, with the same
profile and budgets, the properties in which the process stage's code takes part against the
``omni-process-stage`` subject, loaded by name through its entry point as an outside runtime's
would be:

* AR-INV-001 lock-step parity (C-01..C-07, C-62, and after every operation the audits, C-46
  among them) for the token-source features, sync and async, prefix caching on and off, and for
  two real-worker features (hidden rows and token-only conditioning through shared memory);
* the chunk contracts with generated processors (C-40..C-46), and C-46 with generated stage
  inputs (``invariants/test_process_boundary.py``);
* the registry's completeness and witnesses (C-03, OMNI-WIRE-001 among them), the run-time
  attribute audit and the adapter's duplicate-id check (C-10..C-13), and worker fault
  containment (C-61, C-62: the failure's cause must survive the output wire), and send-path
  fault containment (C-61, C-43: a processor raising in the stage process fails its request
  alone, and the EOF that follows crosses numbered after the chunks before it).

Properties that drive the runner alone (materialization, payload and graph-independence checks)
are left out: the process stage does not take part in them. ``test_gate_check_passes`` (slow)
runs the whole gate end to end against the subject, through ``omni-conformance check``.

``test_outputs_arrive_as_the_parent_decodes_them`` is the test that makes OMNI-WIRE-001 happen:
every output the parent decodes is an ``OmniEngineCoreOutput``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance._core.needs import features_of
from conformance._core.subjects import load_subject
from conformance._core.workload import AddRequest, Step
from invariants.machines import (
    AuditedLockstep,
    LocalRecorder,
    harness_config,
    lockstep_run,
    raise_failure,
    run_machine,
    suite_settings,
)

# Part of the invariant suite (``pytest -m invariants``): the same properties, on the runtime's
# second subject; the mutation campaign reaches the stage-process code only through here.
pytestmark = pytest.mark.invariants

SUBJECT = "omni-process-stage"
TOKEN_FEATURES = ("off", "token-updates")
WORKER_FEATURES = ("hidden-inline", "token-only-background")


@pytest.fixture(scope="module")
def subject() -> Any:
    return load_subject(SUBJECT)


def _feature(subject: Any, name: str) -> Any:
    return {f.name: f for f in features_of(subject)}[name]


def _request_node() -> Any:
    """What the suite's tests read of pytest's ``request`` (the clauses they credit)."""
    return SimpleNamespace(node=SimpleNamespace(user_properties=[]))


@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "noprefix"])
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("feature", TOKEN_FEATURES)
def test_lockstep_parity(subject, feature, mode, prefix):
    from invariants.test_ar_inv_001_parity import test_lockstep_parity as suite

    suite(
        _request_node(), LocalRecorder(subject), subject, _feature(subject, feature), mode, prefix
    )


def test_lockstep_parity_speculative(subject):
    from invariants.test_ar_inv_001_parity import test_lockstep_parity_speculative as suite

    suite(_request_node(), LocalRecorder(subject), subject, True)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("feature", WORKER_FEATURES)
def test_lockstep_parity_with_the_worker(subject, feature, mode):
    from invariants.test_ar_inv_001_parity import test_lockstep_parity as suite

    suite(_request_node(), LocalRecorder(subject), subject, _feature(subject, feature), mode, True)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_chunk_contracts(subject, mode):
    from invariants.test_chunk_contracts import test_chunk_contracts as suite

    suite(_request_node(), LocalRecorder(subject), subject, mode)


def test_rows_survive_a_reset_with_steps_in_flight(subject):
    from invariants.test_chunk_contracts import (
        test_rows_survive_a_reset_with_steps_in_flight as suite,
    )

    suite(LocalRecorder(subject), subject)


def test_stage_inputs_cross_unchanged(subject):
    from invariants.test_process_boundary import test_stage_inputs_cross_unchanged as suite

    suite(subject)


def test_registry(subject):
    from invariants.test_registry import (
        test_registry_entries_are_complete,
        test_registry_entries_are_still_needed,
    )

    test_registry_entries_are_complete(subject)
    test_registry_entries_are_still_needed(LocalRecorder(subject), subject)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_runtime_audit(subject, mode):
    from invariants.test_ar_inv_002_adapters import test_runtime_audit as suite

    suite(LocalRecorder(subject), subject, mode)


def test_duplicate_live_id_rejected(subject):
    from invariants.test_ar_inv_002_adapters import test_duplicate_live_id_rejected as suite

    suite(subject)


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "transient"])
@pytest.mark.parametrize("mode,materialization", [("sync", "inline"), ("async", "background")])
def test_a_model_fault_stays_with_its_request(subject, mode, materialization, persistent):
    from invariants.test_reliability import test_a_model_fault_stays_with_its_request as suite

    suite(subject, mode, materialization, persistent)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_send_path_fault_stays_with_its_request(subject, mode):
    from invariants.test_send_path_faults import (
        test_a_send_path_fault_stays_with_its_request as suite,
    )

    suite(None, subject, mode)  # no recorder: a failure's trace goes to the default folder


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_abort_that_meets_a_send_fault_stays_an_abort(subject, mode):
    from invariants.test_send_path_faults import (
        test_an_abort_that_meets_a_send_fault_stays_an_abort as suite,
    )

    suite(None, subject, mode)


def test_outputs_arrive_as_the_parent_decodes_them(subject):
    """OMNI-WIRE-001 happens: the parent decodes every output as ``OmniEngineCoreOutput``, its
    omni fields at their defaults for a request the step sent nothing for; the registry
    tolerates exactly that, and nothing else differs from upstream."""
    from omni_runtime.payload import OmniEngineCoreOutput

    feature = _feature(subject, "off")
    session = AuditedLockstep(harness_config(feature, mode="sync", prefix=True), subject)
    session.apply(AddRequest("w", tuple(range(10, 30)), max_tokens=3))
    session.apply(Step())
    _, received = session.last_outputs
    assert received["w"]["__type__"] == OmniEngineCoreOutput.__name__
    session.drain()
    assert session.failure is None, session.failure.headline()
    assert session.tolerated["OMNI-WIRE-001"] > 0
    assert not session.problems and not session.teardown_problems()


def test_a_run_leaves_no_segment_behind(subject):
    """A session's chunks went through shared memory, and none of it is left once drained."""
    import os

    feature = _feature(subject, "token-updates")
    cfg = harness_config(feature, mode="async", prefix=True)
    run = lockstep_run(
        LocalRecorder(subject), subject, feature, "segments", mode="async", prefix=True
    )
    raise_failure(run_machine(run, suite_settings(3)), run)
    assert cfg.additional_config  # the feature sends chunks downstream
    left = [n for n in os.listdir("/dev/shm") if n.startswith(f"omni-gate-{os.getpid()}-")]
    assert not left, f"segments left in /dev/shm: {left}"


# ---- the shared-memory wire on messages nobody reads -----------------------------------------
# The lock-step sessions read every message the stage sends, so they never reach what the wire
# does with a message that is dropped unread (``release_descriptors``, as ``MPStageEngine`` does
# on shutdown), with a dead stage's leftovers (``sweep_segments``) or with the listing every leak
# audit reads (``live_segments``). These tests drive the wire itself, under names of their own.

_SHM = "/dev/shm"


def _wire_prefix(role: str) -> str:
    """A segment-name prefix no other test or process can share (pid and a random token)."""
    import os
    import secrets

    return f"omni-unread-{os.getpid()}-{secrets.token_hex(4)}-{role}"


def _on_disk(prefix: str) -> list[str]:
    """What /dev/shm itself holds under ``prefix``, read without the wire's help."""
    import os

    return sorted(n for n in os.listdir(_SHM) if n.startswith(prefix))


def _remove_all(prefix: str) -> None:
    import os

    for name in _on_disk(prefix):
        try:
            os.unlink(os.path.join(_SHM, name))
        except FileNotFoundError:
            pass


def _one_step(writer: Any, request_id: str, rows: Any) -> list[Any]:
    """One step of one request: a chunk carrying hidden rows, then its EOF carrying no tensor."""
    from omni_runtime.payload import StageChunk, StagePayload

    payload = StagePayload(request_id, 0, rows.shape[0], rows)
    writer.send(StageChunk(request_id, "thinker", 0, (7, 8), payload, payload, False))
    writer.send(StageChunk(request_id, "thinker", 1, (), None, None, True, "stop"))
    return writer.flush()


def test_an_unread_message_is_listed_released_and_swept_by_its_prefix():
    """C-46, "nothing of the crossing outlives what it carried" (and C-04 across the boundary:
    a stopped stage keeps nothing of its requests): a message that is written but never read
    must still leave nothing in /dev/shm. ``live_segments`` lists exactly the segments that
    exist under a prefix (every leak audit reads it); ``release_descriptors`` on a dropped
    message, one of whose chunks names no segment, raises nothing and unlinks its segment (and
    may run twice); ``sweep_segments`` unlinks exactly what is under its prefix, returns those
    names, and leaves a neighbouring prefix's unread message readable."""
    import torch

    from omni_runtime.adapters.shm_wire import (
        ShmChunkWriter,
        live_segments,
        read_chunks,
        release_descriptors,
        sweep_segments,
    )

    root = _wire_prefix("")
    dropped = ShmChunkWriter(root + "dropped")
    dead = ShmChunkWriter(root + "dead")
    alive = ShmChunkWriter(root + "alive")
    rows = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    try:
        sent = _one_step(dropped, "d", rows)
        segments = [d.segment for d in sent]
        assert segments[1] is None and segments[0], f"expected (segment, None), got {segments}"
        (name,) = _on_disk(dropped.prefix)
        assert segments[0] == name, f"the message names {segments[0]}, /dev/shm holds {name}"
        listed = live_segments(dropped.prefix)
        assert listed == [name], f"live_segments lists {listed}, /dev/shm holds [{name!r}]"

        release_descriptors(sent)
        left = _on_disk(dropped.prefix)
        assert not left, f"segments of a released unread message left in /dev/shm: {left}"
        assert live_segments(dropped.prefix) == [], "live_segments lists a released segment"
        release_descriptors(sent)  # a segment already gone is no error

        unread = _one_step(dead, "x", rows)
        kept = _one_step(alive, "y", rows + 100)
        (dead_name,) = _on_disk(dead.prefix)
        (alive_name,) = _on_disk(alive.prefix)
        assert live_segments(root) == sorted([dead_name, alive_name]), live_segments(root)

        swept = sweep_segments(dead.prefix)
        assert swept == [dead_name], f"sweep of {dead.prefix} returned {swept}, not [{dead_name}]"
        left = _on_disk(dead.prefix)
        assert not left, f"a sweep left segments under its prefix in /dev/shm: {left}"
        assert _on_disk(alive.prefix) == [alive_name], "a sweep removed another prefix's segment"
        again = sweep_segments(dead.prefix)
        assert again == [], f"a sweep of an emptied prefix returned {again}"
        assert unread[0].segment == dead_name

        back = read_chunks(kept)
        assert torch.equal(back[0].payload.hidden, rows + 100), "the neighbour's rows changed"
        assert back[0].data is back[0].payload and back[1].is_final
        left = _on_disk(root)
        assert not left, f"segments left in /dev/shm once everything was read or swept: {left}"
    finally:
        _remove_all(root)


def test_the_writer_hands_its_segment_over_and_the_reader_lets_go():
    """C-46's ownership rule, as the stdlib resource tracker sees it: a segment belongs to the
    reader from the moment a message names it, so once ``flush`` returns the writing process must
    no longer track it (else a stage process that exits unlinks what the parent has not read
    yet), and once ``read_chunks`` returns the reading process must not track it either (else
    every message leaves a registration behind, warned about as "leaked shared_memory objects" at
    exit). The tracker's calls are recorded as the tracker keeps them, one set of (name, type)
    per process; an unregister of something not in that set is a call the tracker rejects."""
    from multiprocessing import resource_tracker

    import torch

    from omni_runtime.adapters.shm_wire import ShmChunkWriter, read_chunks

    tracked: set[tuple[str, str]] = set()
    rejected: list[tuple[str, str]] = []
    register, unregister = resource_tracker.register, resource_tracker.unregister

    def record_register(name: str, rtype: str) -> None:
        tracked.add((name, rtype))
        register(name, rtype)

    def record_unregister(name: str, rtype: str) -> None:
        if (name, rtype) in tracked:
            tracked.discard((name, rtype))
        else:
            rejected.append((name, rtype))
        unregister(name, rtype)

    root = _wire_prefix("owner")
    writer = ShmChunkWriter(root)
    rows = torch.ones(2, 3, dtype=torch.bfloat16)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(resource_tracker, "register", record_register)
            patch.setattr(resource_tracker, "unregister", record_unregister)
            sent = _one_step(writer, "o", rows)
            assert _on_disk(root) == [sent[0].segment], "flush made no segment"
            assert not rejected, f"the writer's tracker calls were rejected: {rejected}"
            still = sorted(n for n, _ in tracked if root in n)
            assert not still, f"the writer still tracks {still} after flush: it would unlink it"
            back = read_chunks(sent)
            assert not rejected, f"the reader's tracker calls were rejected: {rejected}"
            still = sorted(n for n, _ in tracked if root in n)
            assert not still, f"the reader still tracks {still} after read_chunks"
        assert torch.equal(back[0].payload.hidden, rows)
        assert not _on_disk(root), "read_chunks left its segment in /dev/shm"
    finally:
        _remove_all(root)


@pytest.mark.parametrize(
    "data,message",
    [
        (object(), "chunk data of type object cannot cross a process boundary"),
        ([{1: "x"}], "chunk data: dict key 1 is not a string"),
    ],
    ids=["object", "int-key"],
)
def test_data_that_cannot_cross_is_refused_by_name(data, message):
    """C-61/C-46: a processor's data the wire cannot carry is refused at ``send`` (inside the
    transfer adapter, so it fails only its request), and the refusal names what is wrong (the
    offending type, or the dict key) since that text becomes the request's error; nothing of
    the refused chunk is written."""
    from omni_runtime.adapters.shm_wire import ShmChunkWriter
    from omni_runtime.payload import StageChunk

    root = _wire_prefix("refused")
    writer = ShmChunkWriter(root)
    try:
        with pytest.raises(TypeError, match=f"^{message}"):
            writer.send(StageChunk("z", "thinker", 0, (), None, data, False))
        assert len(writer) == 0 and writer.flush() == [], "a refused chunk was kept to send"
        assert not _on_disk(root), "a refused chunk left a segment"
    finally:
        _remove_all(root)


@pytest.mark.slow
def test_gate_check_passes(tmp_path, run_check):
    """The whole gate, end to end: every test applies to the subject, and C-46 passes. At the
    smoke profile (a fifth of ci's examples): the point is that each test runs against the
    subject across the process boundary, and what a wire loses (a request field it drops, say)
    shows on the first example; ci's depth for every test would double the lane's longest test."""
    run = run_check(tmp_path, SUBJECT, workers=2, profile="smoke")
    assert run.returncode == 0, run.tail()
    assert run.report is not None and run.report["status"] == "pass", run.tail()
    failed = [r["nodeid"] for r in run.records() if r["outcome"] in ("failed", "error")]
    assert not failed, failed
    c46 = next(c for c in run.report["clauses"] if c["id"] == "C-46")
    assert c46["status"] == "pass", c46


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1, [1, 2**80]])
def test_an_int_the_wire_cannot_carry_is_refused_at_the_adapter(subject, value):
    """What C-46's property found: the adapter accepted integers past 64 bits in additional
    information, and the multiprocess backend's ``add`` then raised OverflowError from vLLM's
    encoder, after validation, naming no field. Refused at the adapter now, naming the field."""
    probe = subject.input_adapter()
    scheduler = probe.scheduler()
    from vllm.sampling_params import SamplingParams

    with pytest.raises(probe.rejection) as info:
        probe.build(
            scheduler,
            "big",
            SamplingParams(max_tokens=2),
            prompt_token_ids=[1],
            additional_information={"k": value},
        )
    assert (info.value.request_id, info.value.field) == ("big", "additional_information['k']")
    edge = {"lo": -(2**63), "hi": 2**64 - 1, "flag": True}
    request = probe.build(
        scheduler,
        "edge",
        SamplingParams(max_tokens=2),
        prompt_token_ids=[1],
        additional_information=edge,
    )
    subject.admit(scheduler, request)
    assert dict(scheduler.requests["edge"].omni.additional_information) == edge


# An abort's request ids: everything (None), or some of the staged ids and one nobody admitted.
UNKNOWN_ID = "never-admitted"


@st.composite
def staged_aborts(draw: Any) -> tuple[int, list[Any], int]:
    """``n`` requests staged, then aborts (``None``, one id as a string, or a list of ids, some
    maybe not staged), then ``late`` more staged before an abort of everything."""
    n = draw(st.integers(1, 5))
    ids = st.sampled_from([*(f"s{i}" for i in range(n)), UNKNOWN_ID])
    one_abort = st.one_of(ids, st.lists(ids, min_size=1, max_size=3), st.none())
    aborts = draw(st.lists(one_abort, max_size=3))
    return n, aborts, draw(st.integers(0, 2))


def check_staged_aborts(value: tuple[int, list[Any], int], subject: Any) -> None:
    """C-04 where the lock-step sessions cannot reach (the subject releases each admission at
    once, so that queues compare with upstream's): ``MPStageEngine`` releases a step's admissions
    only when it steps, so an abort that arrives first meets them staged. Each abort takes
    exactly its ids out of the stage (one id given as a string is one id), an abort of everything
    (``None``) every staged one; the rest enter upstream's queue on release, in arrival order,
    and nothing of an aborted request is left anywhere."""
    from vllm.v1.request import RequestStatus

    n, aborts, late = value
    feature = _feature(subject, "token-updates")
    cfg = harness_config(feature, mode="sync", prefix=True)
    scheduler = subject.build_scheduler(cfg)

    def stage(ids: list[str]) -> None:
        for i, rid in enumerate(ids):
            prompt = list(range(100 + i, 120 + i))
            op = AddRequest(rid, tuple(prompt), max_tokens=3)
            # The stage's own add: what the engine process does with an admission message.
            scheduler.add_request(subject.make_request(op, prompt, cfg, scheduler, float(i)))

    staged = [f"s{i}" for i in range(n)]
    stage(staged)
    for ids in aborts:
        scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        gone = set(staged) if ids is None else {ids} if isinstance(ids, str) else set(ids)
        staged = [rid for rid in staged if rid not in gone]
        held = scheduler("audit")["staged"]
        assert held == sorted(staged), f"C-04: after abort({ids!r}) staged {held}, not {staged}"
    released = scheduler("release")
    assert released == len(staged), f"C-04: released {released}, staged {staged}"
    queued = [r.request_id for r in scheduler.waiting]
    assert queued == staged, f"C-04: the queue after release is {queued}, not {staged}"
    assert sorted(scheduler.requests) == sorted(staged), "C-04: an aborted request was queued"
    stage([f"late{i}" for i in range(late)])
    scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    left = scheduler("audit")["staged"]
    assert left == [], f"C-04: an abort of everything left {left} staged"
    assert scheduler("release") == 0, "C-04: a release after an abort of everything queued some"
    assert not scheduler.requests and not scheduler.waiting, "C-04: requests outlived abort(None)"


def test_an_abort_meets_requests_still_staged(subject):
    """Aborts that meet staged requests take exactly theirs (``check_staged_aborts``)."""

    @suite_settings(25)
    @given(staged_aborts())
    def run(value: tuple[int, list[Any], int]) -> None:
        check_staged_aborts(value, subject)

    run()
