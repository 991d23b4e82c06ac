"""C-61, C-62 and C-43 under a send-path fault: a chunk processor that raises fails its request
alone.

The check plants the fault itself, on one request, the victim: a generated processor
(``invariants.strategies``) raises ``PlantedSendFault`` on its first, a middle or its final call
(``FAULT_CALLS``); ``test_a_connector_fault_stays_with_its_request`` makes the connector
(``ChunkDelivery.install_sink``) refuse one of its chunks; and
``test_an_abort_that_meets_a_send_fault_stays_an_abort`` fails the EOF of a request the client
just aborted. The subject's scheduler runs each workload fault-free and faulted, stepped as
``EngineCore`` steps it, sync and async; the victim ends with one error (or stays aborted),
gets one EOF numbered without a gap, and every other request ends as in the fault-free run.

Not applicable without ``chunk_delivery`` or a ``processor_feature``. What is compared, and
what is not: C-61 in docs/contracts.md and docs/design.md, "How the suite checks".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from vllm.v1.request import RequestStatus

from conformance._core.capabilities import ChunkDelivery, NotApplicable
from conformance._core.driver import make_driver
from conformance._core.harness_faults import raise_pending
from conformance._core.machine import client_trace_headers
from conformance._core.needs import cause_naming_problem, require
from conformance._core.replay import failures_dir
from conformance._core.vllm_compat import environment_versions
from conformance._core.vllm_compat import state as vc
from conformance._core.workload import AddRequest, Trace
from invariants.machines import harness_config, suite_settings
from invariants.outcomes import Outcome
from invariants.strategies import (
    EDGE_JOBS,
    Job,
    PayloadTokenSource,
    ProcessorSpec,
    RecordingProcessor,
    delivery_shapes,
    job_prompt,
    jobs,
    processor_specs_of,
)

pytestmark = [pytest.mark.invariants]

MAX_STEPS = 400


# The processors this check generates: every shape but the batching one. A batch that raises
# cannot say for which of its requests it did, so C-61's "that request alone" is a rule about
# per-request calls; which requests a raising batch fails is the subject's to choose (the omni
# runtime fails the batch's requests).
def fault_specs(subject: Any) -> st.SearchStrategy[ProcessorSpec]:
    """Of the processor shapes the subject's delivery takes, all but the batching ones."""
    shapes = delivery_shapes(subject)
    return processor_specs_of(tuple(s for s in shapes if not s.startswith("token-updates-batch")))


def two_client_spec(subject: Any) -> ProcessorSpec:
    """A plain per-request processor that returns the payload: the explicit example's shape
    (declaring token updates where the subject's processors can)."""
    declares = "token-updates" in delivery_shapes(subject)
    return ProcessorSpec(
        declaration=True if declares else "absent",
        policy="payload",
        takes_ids=False,
        mutate_ids=False,
    )


class PlantedSendFault(RuntimeError):
    """What the generated processor raises for the victim."""


@dataclass(kw_only=True)
class Run(Outcome):
    """One run of the workload, as the engine's caller and the processor saw it."""

    processor: RecordingProcessor
    chunks: dict[str, list[Any]] = field(default_factory=dict)  # ChunkViews, in arrival order
    fired: int = 0
    # The client's abort of a request (``run_workload``'s ``abort``): whether it happened, and
    # the ids the subject's own structures still held for that request when the call returned.
    aborted: bool = False
    held_after_abort: list[str] = field(default_factory=list)


def faulting(processor: RecordingProcessor, victim: str, k: int, run: Run) -> None:
    """Make ``processor`` raise on its ``k``-th call for ``victim`` (after logging the call)."""
    record = processor.record

    def record_or_raise(
        request_id: str, payload: Any, is_final: bool, ids: Any, batched: bool = False
    ) -> Any:
        data = record(request_id, payload, is_final, ids, batched)
        if request_id == victim and len(processor.calls_for(victim)) == k + 1:
            run.fired += 1
            raise PlantedSendFault(f"planted send-path fault on {victim}, call {k}")
        return data

    processor.record = record_or_raise  # type: ignore[method-assign]


class FaultingSink:
    """The stage's send path as the connector: records every chunk it carries, and refuses (raises
    ``PlantedSendFault`` for) the ``k``-th chunk of ``victim``, once."""

    def __init__(self, delivery: ChunkDelivery, fault: tuple[str, int] | None) -> None:
        self.delivery = delivery
        self.fault = fault
        self.seen: dict[str, int] = {}
        self.chunks: list[Any] = []
        self.refused: list[Any] = []

    def send(self, chunk: Any) -> None:
        rid = self.delivery.view(chunk).request_id
        n = self.seen.get(rid, 0)
        self.seen[rid] = n + 1
        if self.fault is not None and (rid, n) == self.fault:
            self.refused.append(chunk)
            raise PlantedSendFault(
                f"planted send-path fault on {rid}: the connector refused chunk {n}"
            )
        self.chunks.append(chunk)

    def drain(self) -> list[Any]:
        out, self.chunks = self.chunks, []
        return out


def run_workload(
    subject: Any,
    delivery: ChunkDelivery,
    cfg: Any,
    spec: ProcessorSpec,
    prompts: dict[str, list[int]],
    limits: dict[str, int],
    fault: tuple[str, int] | None,
    sink: FaultingSink | None = None,
    abort: tuple[str, str] | None = None,
    second_client: str | None = None,
) -> Run:
    """Run the workload to the drain. ``abort``: (request, point) — the client aborts that
    request between steps, as vLLM's engine does (``finish_requests`` with
    ``FINISHED_ABORTED``), at one of ``ABORT_POINTS``, if it is still held there.
    ``second_client``: the request that comes from engine client 1 (the others from 0)."""
    cause_field = "omni_error"
    containment = subject.fault_containment()
    if containment is not None:
        cause_field = getattr(containment, "cause_field", None) or cause_field
    scheduler = subject.build_scheduler(cfg)
    run = Run(processor=spec.build())
    if fault is not None:
        faulting(run.processor, fault[0], fault[1], run)
    delivery.set_processor(scheduler, run.processor)
    if sink is not None and not delivery.install_sink(scheduler, sink):
        raise NotApplicable("the subject has no send path to route through a connector here")
    pool = vc.block_pool(scheduler)
    initial = vc.num_free_blocks(pool)
    driver = make_driver(scheduler, PayloadTokenSource(delivery))

    def take_chunks() -> None:
        for chunk in sink.drain() if sink is not None else subject.drain_chunks(scheduler):
            view = delivery.view(chunk)
            run.chunks.setdefault(view.request_id, []).append(view)

    def abort_if(point: str) -> None:
        if abort is None or run.aborted or abort[1] != point:
            return
        rid = abort[0]
        if point == "running" and not run.tokens.get(rid):
            return  # not yet streaming: the abort waits for its first output
        if rid not in vc.live_request_ids(scheduler):
            return  # it ended first: nothing to abort
        scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
        raise_pending()
        run.aborted = True
        # Whatever the abort's terminal delivery left in the subject's own per-request
        # structures (a send-path failure not taken yet, a progress record) outlives the
        # request, which the abort has ended (C-04).
        run.held_after_abort = sorted(set(subject.live_omni_ids(scheduler)) & {rid})
        take_chunks()

    # The victim comes from a second engine client (one whose engine serves a single client
    # gets every request as client 0): a step's outputs then come back in two containers, the
    # victim's after its neighbours' whenever one of them is scheduled first, and a request
    # failed on its terminal delivery must be found in whichever container holds it (C-07,
    # C-61).
    two_clients = not subject.single_engine_client
    for i, (rid, prompt) in enumerate(prompts.items()):
        op = AddRequest(
            rid,
            tuple(prompt),
            max_tokens=limits[rid],
            trace_headers=client_trace_headers(i, 1),
            client_index=int(two_clients and rid == second_client),
        )
        subject.admit(scheduler, subject.make_request(op, prompt, cfg, scheduler, float(i)))
        run.admitted(op)
    abort_if("waiting")
    while scheduler.has_requests() or driver.in_flight():
        if run.steps >= MAX_STEPS:
            raise AssertionError(f"C-62: the workload did not drain within {MAX_STEPS} steps")
        obs = driver.step()
        raise_pending()  # a harness bug the subject's fault containment caught
        run.steps += 1
        run.record(subject.receive_outputs(scheduler, obs.outputs), cause_field)
        take_chunks()
        abort_if("running")
    free = vc.num_free_blocks(pool)
    assert free == initial, f"C-06: {initial - free} blocks still held after the drain"
    left = subject.live_omni_ids(scheduler)
    assert not left, f"C-04: omni state left for {sorted(left)} after the drain"
    return run


def _handed(run: Run, rid: str) -> tuple[list[int], int]:
    """What ``rid``'s processor calls carried that no schedule changes: the ids, in order, and
    the number of final calls. (Which positions carry rows depends on step sizes and on what
    the prefix cache holds, both of which an earlier-ending neighbour may change.)"""
    calls = run.processor.calls_for(rid)
    return [t for call in calls for t in (call.ids or ())], sum(c.is_final for c in calls)


# Which of the victim's processor calls raises, as a position in the calls it gets in the
# fault-free run: each is a path of its own through a subject's send path (a fault before any
# chunk went out, one between chunks, one on the terminal delivery of a request that ends on
# that very step, and none at all).
FAULT_CALLS: tuple[str, ...] = ("first", "middle", "final", "past-the-end")


def fault_call(where: str, calls: int) -> int:
    """The index of the call that raises, for a victim with ``calls`` fault-free calls."""
    return {"first": 0, "middle": calls // 2, "final": calls - 1, "past-the-end": calls}[where]


def processor_delivery(subject: Any) -> ChunkDelivery:
    """The subject's chunk delivery, when it has a feature to run generated processors on."""
    delivery: ChunkDelivery = require(subject, "chunk_delivery", "chunk delivery")
    if delivery.processor_feature is None:
        raise NotApplicable(f"subject {subject.name!r} provides no processor feature")
    return delivery


class Workload(NamedTuple):
    """One example's workload as every check here runs it: the subject's processor feature, the
    requests (``s0``, ``s1``, ...) with their prompts and limits, and the victim."""

    delivery: ChunkDelivery
    cfg: Any
    prompts: dict[str, list[int]]
    limits: dict[str, int]
    victim: str


def workload_of(
    subject: Any, jobs_: list[Job], victim_index: int, mode: str, *, connector: bool = False
) -> Workload:
    """``connector``: the check plants its fault in the connector (``sink_is_connector``)."""
    delivery = processor_delivery(subject)
    if connector and not getattr(delivery, "sink_is_connector", True):
        raise NotApplicable(f"subject {subject.name!r}'s sink is not its stage's connector")
    feature = delivery.processor_feature
    assert feature is not None  # ``processor_delivery`` refuses a subject without one
    return Workload(
        delivery,
        harness_config(feature, mode=mode, prefix=True),
        {f"s{i}": job_prompt(i, job) for i, job in enumerate(jobs_)},
        {f"s{i}": job.max_tokens for i, job in enumerate(jobs_)},
        f"s{victim_index % len(jobs_)}",
    )


def check_victim_chunks(got: Run, victim: str, eofs: int, where: str, why: str = "") -> None:
    """C-43: the victim's chunks are numbered ``0..n-1`` and hold ``eofs`` EOF chunks (0 or 1),
    the EOF last; ``why`` says what the expectation follows from."""
    views = sorted(got.chunks.get(victim, []), key=lambda v: v.seq)
    seqs = [v.seq for v in views]
    assert seqs == list(range(len(views))), (
        f"C-43: {victim}'s chunks are numbered {seqs}{why} ({where})"
    )
    finals = [v for v in views if v.is_final]
    assert len(finals) == eofs and (not finals or views[-1].is_final), (
        f"C-43: {victim} got {len(finals)} EOF chunks of {len(views)}, expected {eofs}{why} "
        f"({where})"
    )


def outcome_problems(
    subject: Any,
    cfg: Any,
    prompts: dict[str, list[int]],
    victim: str,
    fired: bool,
    got: Run,
    clean: Run,
    where: str,
    fault: str,
    *,
    aborted: bool = False,
) -> None:
    """Raise AssertionError unless every request ended once (C-62), the victim (when the fault
    fired) with an error whose cause carries the fault, and every other one exactly as in the
    fault-free run: same end, no cause, same tokens, same ids and final calls handed to its
    processor (C-61); and that every output carried its request's trace headers (C-07, C-61).
    ``aborted``: the client aborted the victim in both runs, so the fault met a request that had
    already ended: it must end as in the fault-free run (an abort has no terminal output to
    turn into an error), with no cause."""
    problems = clean.header_problems("C-07") + got.header_problems("C-61")
    assert not problems, f"{'; '.join(problems)} ({where})"
    for rid in prompts:
        ends = got.terminal.get(rid, [])
        if rid == victim and aborted:
            assert ends == clean.terminal.get(rid, []) and rid not in got.causes, (
                f"C-61: {rid} was aborted, and {fault} on the abort's own delivery; it ended "
                f"{ends} (cause {got.causes.get(rid)!r}) against "
                f"{clean.terminal.get(rid, [])} in the fault-free run ({where})"
            )
            continue
        assert len(ends) == 1, f"C-62: {rid} ended {len(ends)} times: {ends} ({where})"
        if rid == victim and fired:
            assert ends == ["error"], (
                f"C-61: {fault} ({rid}), yet it ended {ends[0]!r}, not with an error ({where})"
            )
            field_name = getattr(subject.fault_containment(), "cause_field", None)
            if field_name:
                cause = got.causes.get(rid, "")
                assert "planted send-path fault" in cause, (
                    f"C-61: {rid} failed, but its {field_name} ({cause!r}) does not carry the "
                    f"fault ({where})"
                )
                unnamed = cause_naming_problem(
                    subject, cfg.additional_config, cause, PlantedSendFault("")
                )
                assert unnamed is None, f"C-61: {rid}'s {field_name} {cause!r}: {unnamed} ({where})"
            continue
        assert ends == clean.terminal.get(rid), (
            f"C-61: {rid} ended {ends} against {clean.terminal.get(rid)} in the fault-free "
            f"run, though the fault was {victim}'s ({where})"
            + (f"; the subject says: {got.causes[rid]}" if rid in got.causes else "")
        )
        assert rid not in got.causes, (
            f"C-61: {rid} did not fail, yet its output carries a cause {got.causes[rid]!r}"
        )
        assert got.tokens.get(rid) == clean.tokens.get(rid), (
            f"C-61: {rid}'s tokens {got.tokens.get(rid)} differ from the fault-free run's "
            f"{clean.tokens.get(rid)} ({where})"
        )
        assert _handed(got, rid) == _handed(clean, rid), (
            f"C-61: {rid}'s processor calls carried other ids or final calls than in the "
            f"fault-free run: {_handed(got, rid)} against {_handed(clean, rid)} ({where})"
        )


def check_send_fault_stays_with_its_request(
    subject: Any,
    workload: list[Job],
    spec: ProcessorSpec,
    victim_index: int,
    k: int | str,
    *,
    mode: str,
) -> int:
    """Raise AssertionError on a C-61/C-62/C-43 violation; returns the steps run. ``k``: the
    index of the victim's call that raises, or where it is among the fault-free run's calls
    (``FAULT_CALLS``)."""
    delivery, cfg, prompts, limits, victim = workload_of(subject, workload, victim_index, mode)
    clean = run_workload(subject, delivery, cfg, spec, prompts, limits, None, second_client=victim)
    if isinstance(k, str):
        k = max(0, fault_call(k, len(clean.processor.calls_for(victim))))
    got = run_workload(
        subject, delivery, cfg, spec, prompts, limits, (victim, k), second_client=victim
    )
    where = f"{spec.describe()}, fault on {victim}'s call {k}"
    outcome_problems(
        subject,
        cfg,
        prompts,
        victim,
        bool(got.fired),
        got,
        clean,
        where,
        "its chunk processor raised",
    )
    # The victim: its calls are the fault-free run's up to the one that raised, then at most
    # the final call of its EOF; one EOF chunk, chunks numbered from 0 (C-43).
    calls = got.processor.calls_for(victim)
    if got.fired:
        before = clean.processor.calls_for(victim)[: k + 1]
        assert [(c.ids, c.is_final) for c in calls[: k + 1]] == [
            (c.ids, c.is_final) for c in before
        ], f"C-61: {victim}'s processor calls before its fault differ from the fault-free run"
        after = calls[k + 1 :]
        raised_final = calls[k].is_final
        assert len(after) == (0 if raised_final else 1) and all(c.is_final for c in after), (
            f"C-43: after {victim}'s processor raised on call {k} "
            f"({'final' if raised_final else 'not final'}), it was called "
            f"{[('final' if c.is_final else 'step') for c in after]} ({where})"
        )
    if getattr(delivery, "releases_on_final_fault", False):
        # The subject says it asks a processor whose final call raised to let go of that
        # request: exactly then, once, and never for anybody else.
        want = [victim] if got.fired and calls[k].is_final else []
        assert got.processor.released == want and clean.processor.released == [], (
            f"C-61: the processor was asked to release {got.processor.released} (fault-free "
            f"run: {clean.processor.released}), expected {want} ({where})"
        )
    check_victim_chunks(got, victim, 1, where)
    # Every EOF that says why its request ended says what the request's terminal output said:
    # the victim's "error" too, when its own terminal delivery was the call that raised (C-43).
    required = bool(getattr(delivery, "eof_reasons", False))
    for rid in prompts:
        eofs = [v for v in got.chunks.get(rid, []) if v.is_final]
        if len(eofs) != 1 or len(got.terminal.get(rid, [])) != 1:
            continue  # counted above
        said = eofs[0].finish_reason
        assert said is not None or not required, (
            f"C-43: {rid}'s EOF chunk carries no finish reason ({where})"
        )
        # vLLM's reason strings, exactly: a consumer matches them as they are.
        assert said is None or str(said) == got.terminal[rid][0], (
            f"C-43: {rid}'s EOF chunk says it ended with {str(said)!r}; its terminal "
            f"output says {got.terminal[rid][0]!r} ({where})"
        )
    return clean.steps + got.steps


@pytest.mark.clauses("C-61", "C-62", "C-43")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_send_path_fault_stays_with_its_request(conformance, conformance_subject, mode):
    processor_delivery(conformance_subject)
    failing = FailingExamples(conformance, conformance_subject, f"C-61-send-fault-{mode}")

    # Each fault position in a run of its own, with an equal share of the examples: a drawn
    # call index lands on the victim's final call only by chance, and that is where a subject
    # must turn an output that already finished into an error.
    budget = suite_settings(10)
    for where in FAULT_CALLS:

        @settings(budget, max_examples=max(1, budget.max_examples // len(FAULT_CALLS)))
        @given(jobs, fault_specs(conformance_subject), st.integers(0, 5), st.just(where))
        # Met first at every position: the second request, from the second client, fails while
        # the first (client 0) has an output in the same step, so the victim's output comes back
        # in the second of two containers.
        @example(list(EDGE_JOBS[0]), two_client_spec(conformance_subject), 1, where)
        def prop(workload: list[Job], spec: ProcessorSpec, victim: int, call: str) -> None:
            failing.run(FaultExample("processor", workload, spec, victim, (call,), mode))

        failing.around(prop)


def check_connector_fault_stays_with_its_request(
    subject: Any,
    workload: list[Job],
    spec: ProcessorSpec,
    victim_index: int,
    where: str,
    *,
    mode: str,
) -> int:
    """The connector (``ChunkDelivery.install_sink``) refuses one chunk of the victim: its first,
    a middle one or its EOF (``where``), by position among the victim's chunks in the fault-free
    run. Raise AssertionError on a C-61/C-62/C-43 violation; returns the steps run."""
    delivery, cfg, prompts, limits, victim = workload_of(
        subject, workload, victim_index, mode, connector=True
    )
    clean = run_workload(
        subject,
        delivery,
        cfg,
        spec,
        prompts,
        limits,
        None,
        FaultingSink(delivery, None),
        second_client=victim,
    )
    n = len(clean.chunks.get(victim, []))
    k = {"first": 0, "middle": n // 2, "final": n - 1}[where]
    sink = FaultingSink(delivery, (victim, k))
    got = run_workload(
        subject, delivery, cfg, spec, prompts, limits, None, sink, second_client=victim
    )
    at = f"{spec.describe()}, the connector refusing {victim}'s chunk {k} of {n} ({where})"
    outcome_problems(
        subject,
        cfg,
        prompts,
        victim,
        bool(sink.refused),
        got,
        clean,
        at,
        "the connector refused its chunk",
    )
    # The victim's chunks: in order (a refused chunk was delivered to nobody, so the next takes
    # its number), the EOF last, exactly one unless the connector refused the EOF itself (then
    # none: the stage sent it, the connector failed to carry it) (C-43).
    refused_eof = bool(sink.refused) and delivery.view(sink.refused[0]).is_final
    why = f", the connector having refused {'its EOF' if refused_eof else 'another chunk'}"
    check_victim_chunks(got, victim, 0 if refused_eof else 1, at, why)
    return clean.steps + got.steps


@pytest.mark.clauses("C-61", "C-62", "C-43")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_connector_fault_stays_with_its_request(conformance, conformance_subject, mode):
    """The send path's other half: the connector that carries a stage's chunks raises on one
    chunk of one request (its first, a middle one, its EOF, each in a run of its own)."""
    delivery = processor_delivery(conformance_subject)
    if not getattr(delivery, "sink_is_connector", True):
        raise NotApplicable(
            f"subject {conformance_subject.name!r}'s sink is not its stage's connector"
        )
    failing = FailingExamples(conformance, conformance_subject, f"C-61-connector-fault-{mode}")
    budget = suite_settings(10)
    for where in ("first", "middle", "final"):

        @settings(budget, max_examples=max(1, budget.max_examples // 3))
        @given(jobs, fault_specs(conformance_subject), st.integers(0, 5), st.just(where))
        def prop(workload: list[Job], spec: ProcessorSpec, victim: int, at: str) -> None:
            failing.run(FaultExample("connector", workload, spec, victim, (at,), mode))

        failing.around(prop)


# Where the client aborts the victim in ``test_an_abort_that_meets_a_send_fault_stays_an_abort``:
# before any step (the abort's EOF is its only chunk) or after the step that brought its first
# output (the EOF ends a stream). Each is a run of its own.
ABORT_POINTS: tuple[str, ...] = ("waiting", "running")
# What fails on the abort's terminal delivery: the processor's final call raises, or the
# connector refuses the EOF chunk.
ABORT_FAULTS: tuple[str, ...] = ("processor", "connector")


def check_abort_meets_a_send_fault(
    subject: Any,
    workload: list[Job],
    spec: ProcessorSpec,
    victim_index: int,
    point: str,
    path: str,
    *,
    mode: str,
) -> int:
    """The client aborts the victim between steps (``point``, one of ``ABORT_POINTS``), and the
    send path fails on the abort's own terminal delivery (``path``, one of ``ABORT_FAULTS``).
    Raise AssertionError on a C-61/C-43/C-04 violation; returns the steps run, 0 when the victim
    ended before the abort point (nothing met the fault)."""
    connector = path == "connector"
    delivery, cfg, prompts, limits, victim = workload_of(
        subject, workload, victim_index, mode, connector=connector
    )
    abort = (victim, point)

    def sink(fault: tuple[str, int] | None) -> FaultingSink | None:
        return FaultingSink(delivery, fault) if connector else None

    clean = run_workload(subject, delivery, cfg, spec, prompts, limits, None, sink(None), abort)
    where = f"{spec.describe()}, {victim} aborted {point}, {path} fault on the abort's EOF"
    assert not clean.held_after_abort, (
        f"C-04: the abort of {victim} returned with {clean.held_after_abort} still held ({where})"
    )
    if not clean.aborted:
        return 0  # the victim ended before the abort point: nothing met the fault
    # The runs agree up to the abort, so its delivery is the victim's last call and last chunk
    # in the fault-free run.
    last_call = len(clean.processor.calls_for(victim)) - 1
    last_chunk = len(clean.chunks.get(victim, [])) - 1
    if connector:
        got_sink = sink((victim, last_chunk))
        got = run_workload(subject, delivery, cfg, spec, prompts, limits, None, got_sink, abort)
        fired = bool(got_sink is not None and got_sink.refused)
    else:
        fault = (victim, last_call)
        got = run_workload(subject, delivery, cfg, spec, prompts, limits, fault, None, abort)
        fired = bool(got.fired)
    outcome_problems(
        subject,
        cfg,
        prompts,
        victim,
        fired,
        got,
        clean,
        where,
        "the send path failed",
        aborted=True,
    )
    # The failure is the abort's to settle: nothing of the request outlives the call (C-04).
    assert not got.held_after_abort, (
        f"C-04: the abort of {victim} met a send-path fault and returned with "
        f"{got.held_after_abort} still held by the subject ({where})"
    )
    # A processor fault on the final call still sends the EOF, bare; a refused EOF reached
    # nobody (C-43); a subject whose caller ends an aborted request downstream itself sends
    # none for it (``ChunkDelivery.abort_eof`` False, C-46).
    want = 0 if connector and fired or not getattr(delivery, "abort_eof", True) else 1
    check_victim_chunks(got, victim, want, where)
    # The request ended by the client's abort, not by the fault: an EOF that says why says so.
    for eof in (v for v in got.chunks.get(victim, []) if v.is_final):
        assert eof.finish_reason is None or str(eof.finish_reason) == "abort", (
            f"C-43: {victim} was aborted, yet its EOF says {str(eof.finish_reason)!r} ({where})"
        )
    if getattr(delivery, "releases_on_final_fault", False):
        want_released = [victim] if fired and not connector else []
        assert got.processor.released == want_released, (
            f"C-61: the processor was asked to release {got.processor.released}, expected "
            f"{want_released} ({where})"
        )
    return clean.steps + got.steps


@pytest.mark.clauses("C-61", "C-43", "C-04")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_abort_that_meets_a_send_fault_stays_an_abort(conformance, conformance_subject, mode):
    """The send path fails on the terminal delivery of a request the client aborted between
    steps: the processor's final call raises, or the connector refuses the EOF. The request
    stays aborted (no terminal output, no cause: the client has gone), an EOF that went out says
    ``abort``, the processor is asked to release the request when its final call raised (for a
    subject that declares ``releases_on_final_fault``), nothing of the request is held when the
    abort returns, and every other request ends as in the run without the fault."""
    delivery = processor_delivery(conformance_subject)
    paths = ABORT_FAULTS if getattr(delivery, "sink_is_connector", True) else ("processor",)
    budget = suite_settings(10)
    runs = [(point, path) for point in ABORT_POINTS for path in paths]
    met: dict[tuple[str, str], int] = dict.fromkeys(runs, 0)  # steps run that met the fault
    failing = FailingExamples(conformance, conformance_subject, f"C-61-abort-meets-fault-{mode}")
    for point, path in runs:

        @settings(budget, max_examples=max(1, budget.max_examples // len(runs)))
        @given(
            jobs, fault_specs(conformance_subject), st.integers(0, 5), st.just(point), st.just(path)
        )
        def prop(
            workload: list[Job], spec: ProcessorSpec, victim: int, at: str, fails: str
        ) -> None:
            met[at, fails] += failing.run(
                FaultExample("abort", workload, spec, victim, (at, fails), mode)
            )

        failing.around(prop)
        assert met[point, path] > 0, f"no example aborted its victim {point} ({path} fault)"


# ---- failing examples as replayable traces ------------------------------------------------------

REPLAY_SEND_FAULT = "invariants.test_send_path_faults:replay_send_fault"


@dataclass(frozen=True)
class FaultExample:
    """One example of a check of this module: which check, its workload, processor, victim,
    where the fault goes (``args``: the check's own) and the scheduling mode."""

    check: str  # a key of ``CHECKS``
    jobs: list[Job]
    spec: ProcessorSpec
    victim: int
    args: tuple[str, ...]
    mode: str

    def run(self, subject: Any) -> int:
        check = CHECKS[self.check]
        return check(subject, self.jobs, self.spec, self.victim, *self.args, mode=self.mode)

    def to_meta(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "jobs": [dataclasses.asdict(j) for j in self.jobs],
            "processor_spec": dataclasses.asdict(self.spec),
            "victim": self.victim,
            "args": list(self.args),
            "mode": self.mode,
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> FaultExample:
        return cls(
            meta["check"],
            [Job(**j) for j in meta["jobs"]],
            ProcessorSpec(**meta["processor_spec"]),
            int(meta["victim"]),
            tuple(meta["args"]),
            meta["mode"],
        )


CHECKS: dict[str, Callable[..., int]] = {
    "processor": check_send_fault_stays_with_its_request,
    "connector": check_connector_fault_stays_with_its_request,
    "abort": check_abort_meets_a_send_fault,
}


class FailingExamples:
    """Runs a property's examples and keeps the last that failed (the one hypothesis reports:
    it runs the failing example again last), so the property's failure is saved as a trace
    that ``omni-conformance replay`` re-runs (``replay_send_fault``)."""

    def __init__(self, recorder: Any, subject: Any, name: str) -> None:
        self.recorder = recorder
        self.subject = subject
        self.name = name
        self.last: FaultExample | None = None

    def run(self, example: FaultExample) -> int:
        try:
            return example.run(self.subject)
        except AssertionError:
            self.last = example
            raise

    def around(self, prop: Callable[[], None]) -> None:
        """Run ``prop``; its failure is saved as a trace and raised naming it."""
        self.last = None
        try:
            prop()
        except (AssertionError, ExceptionGroup) as exc:  # a group: hypothesis met several
            if self.last is None:
                raise
            path = save_fault_trace(self.last, exc, self.subject, self.recorder, self.name)
            raise AssertionError(f"{_first_line(exc)}\ntrace: {path}") from exc


def _first_line(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


def save_fault_trace(
    example: FaultExample, exc: BaseException, subject: Any, recorder: Any, name: str
) -> Path:
    """The example as an audit trace: its requests as ``ops`` (the run steps them until the
    workload drains; ``meta.example`` holds the rest)."""
    delivery, cfg, prompts, limits, victim = workload_of(
        subject,
        example.jobs,
        example.victim,
        example.mode,
        connector=example.check == "connector" or example.args[-1:] == ("connector",),
    )
    ops = [
        AddRequest(rid, tuple(prompt), max_tokens=limits[rid]) for rid, prompt in prompts.items()
    ]
    trace = Trace(cfg, list(ops), {})
    trace.meta = {
        "kind": "audit",
        "replay": REPLAY_SEND_FAULT,
        "subject": getattr(recorder, "subject_spec", None) or subject.name,
        "test": name,
        "victim": victim,
        "processor": example.spec.describe(),
        "example": example.to_meta(),
        **environment_versions(),
        "problem": _first_line(exc),
    }
    path = failures_dir(getattr(recorder, "failures_dir", None)) / f"{name}.json"
    trace.save(path)
    if hasattr(recorder, "trace"):
        recorder.trace = str(path)
    return path


def replay_send_fault(trace: Trace, subject: Any) -> list[str]:
    """The problem a send-path trace shows on ``subject`` now (empty: it does not reproduce);
    a subject without a send path raises ``NotApplicable``."""
    try:
        FaultExample.from_meta(trace.meta["example"]).run(subject)
    except AssertionError as exc:
        return [_first_line(exc)]
    return []
