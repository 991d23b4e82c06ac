"""Audited lock-step machines: the engine of every stateful invariant in this suite.

Built on the harness (``conformance._core.lockstep.Lockstep``, ``conformance._core.machine``),
which compares with upstream after every operation (C-01..C-07) and checks conservation at
teardown (C-06). This module adds, for whatever the subject declares:

* ``AuditedLockstep`` — after every operation the audits of ``invariants.audits`` (C-10..C-12,
  C-20/C-51, C-21, C-46), and a ledger for the teardown checks of ``invariants.ledger``;
* ``InvariantMachine`` — ``LockstepMachine`` over an audited session: audit problems fail the
  program after the operation that caused them; ledger and model reference are checked at
  teardown;
* ``MachineRun`` / ``run_machine`` — one property's run, and the length of the last program.

Each failure names its clause (docs/contracts.md, with the mutants that prove it caught); how
the suite is built: docs/design.md, "How the suite checks".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hypothesis import settings
from hypothesis.stateful import invariant, run_state_machine_as_test

from conformance._core.capabilities import OFF, Feature
from conformance._core.config import HarnessConfig
from conformance._core.lockstep import (
    SET_ASIDE,
    Deferred,
    Lockstep,
    Shrinker,
    SubjectBroken,
    run_trace,
)
from conformance._core.machine import PREFIXES, TIGHT, LockstepMachine, Pauses, StreamsInput
from conformance._core.replay import failures_dir, record_failure
from conformance._core.sides import Side
from conformance._core.vllm_compat import environment_versions
from conformance._core.workload import Abort, AddRequest, Step, StreamInput, Trace
from invariants.audits import (
    CheckingExecutor,
    RecordingSink,
    audit_requests,
    audit_scheduler,
    chunk_ref_problems,
    crossing_problems,
    leftover_problems,
)
from invariants.ledger import RequestLedger, hf_problems, ledger_problems
from invariants.outcomes import TerminalOutcomes
from invariants.reference import cached

if TYPE_CHECKING:
    from conformance._core.compare import Comparison
    from conformance._core.subjects import Subject
    from conformance._core.workload import Op


def harness_config(feature: Feature, *, mode: str, prefix: bool, **over: Any) -> HarnessConfig:
    """The suite's tight configuration with ``feature``'s additional config."""
    return TIGHT.with_(
        async_scheduling=mode == "async",
        enable_prefix_caching=prefix,
        additional_config=dict(feature.additional_config),
        token_edges=feature.token_edges,
        **over,
    )


def worker_harness_config(subject: Subject, feature: Feature, **kw: Any) -> HarnessConfig:
    """``harness_config`` as the subject's worker needs it (its real weights)."""
    return subject.worker_config(harness_config(feature, **kw))


class AuditedLockstep(Lockstep):
    """``Lockstep`` plus the per-operation audits and the request ledger (module docstring)."""

    def __init__(
        self,
        config: HarnessConfig,
        subject: Subject,
        *,
        feature: Feature = OFF,
        audits: bool = True,
        **kw: Any,
    ) -> None:
        super().__init__(config, subject, use_worker=feature.use_worker, **kw)
        self.feature = feature
        self.audits = audits
        # The declared-attribute audits need only the oracle's attribute names, which an oracle
        # in its own process sends with each reply: they run wherever the oracle does.
        self.declared = subject.declared_attributes()
        self.delivery = subject.chunk_delivery()
        self.boundary = subject.process_boundary()
        probes = subject.runner_probes() if feature.use_worker else None
        self.ledger: dict[str, RequestLedger] = {}
        self.terminal = TerminalOutcomes()
        self.problems: list[str] = []
        self.requests_audited = 0  # request audits of C-10..C-12 run (``audit``)
        self.ref_problems: list[str] = []  # C-43: outputs against the chunks of their step
        self.checkers: list[CheckingExecutor] = []
        for side in self.local_sides():
            checker = CheckingExecutor(side.executor, probes.payloads if probes else None)
            side.executor = checker
            side.driver.executor = checker
            self.checkers.append(checker)
        self.sink: RecordingSink | None = None
        layout = subject.source_layout()
        if self.delivery is not None and layout is not None and layout.worker_roots:
            sink = RecordingSink(layout.worker_roots, lambda c: _describe_chunk(self.delivery, c))
            if self.delivery.install_sink(self.sub.scheduler, sink):
                self.sink = sink

    # Every operation (including the drain's) passes here.
    def apply(self, op: Op) -> Comparison:
        live_before = set(self.sub.scheduler.requests)
        result = super().apply(op)
        # A streaming session's turn ends with a finish reason and the session goes on: that
        # output is no terminal outcome while upstream still holds the session.
        continuing = self.live_sessions() if self.sessions else set()
        if isinstance(op, AddRequest) and op.request_id in self.sub.scheduler.requests:
            self.ledger[op.request_id] = RequestLedger(self.trace.prompt_of(op), plain=op.plain)
            self.terminal.entered(op.request_id)
        elif isinstance(op, StreamInput) and op.end and op.request_id in live_before:
            # The stream's end finishes a session waiting for input at once, as an abort
            # (upstream's ``finish_requests(..., FINISHED_ABORTED)``): no output, no turn.
            if op.request_id not in continuing:
                entry = self.ledger.get(op.request_id)
                if entry is not None and entry.finish_reason is None:
                    entry.aborted = True
                self.terminal.stream_ended(op.request_id)
        elif isinstance(op, Abort):
            for rid in op.request_ids:
                entry = self.ledger.get(rid)
                # A request that already finished (its blocks held for a KV connector's send)
                # is not aborted: upstream's ``finish_requests`` skips it, its outcome stands.
                if rid in live_before and entry is not None and entry.finish_reason is None:
                    entry.aborted = True
                self.terminal.aborted(rid, self.sub.last_abort_states.get(rid, "unknown"))
        # Only the outputs: the rest of the snapshots is built only when the sides differ.
        up_outputs, sub_outputs = self.last_outputs if isinstance(op, Step) else ({}, {})
        recent = self.sink.take_recent() if self.sink is not None else []
        if isinstance(op, Step):
            where = f"step {len(self.trace.ops) - 1} ({op.describe()})"
            self.terminal.emitted(sub_outputs, where, continuing)
            # Reported with the chunk ledger at the end (``teardown_problems``): a chunk that
            # should not have been sent at all is named by its own clause first.
            self.ref_problems.extend(chunk_ref_problems(self.delivery, sub_outputs, recent, where))
        # C-62 is read from the subject's own outputs, so it is recorded even when this operation
        # also differs from upstream: a duplicated outcome is then named by its own clause
        # (``audits_hold`` runs before the difference check).
        self.problems.extend(self.terminal.take())
        if isinstance(op, Step):
            for key, out in up_outputs.items():
                entry = self.ledger.get(key.split("#", 1)[0])
                if entry is None:
                    continue
                if out["new_token_ids"]:
                    entry.steps.append(tuple(out["new_token_ids"]))
                if out.get("finish_reason") is not None and key.split("#", 1)[0] not in continuing:
                    entry.finish_reason = out["finish_reason"]
        if self.failure is None and self.audits:
            self.problems.extend(self.audit())
        return result

    def audit(self) -> list[str]:
        problems: list[str] = []
        for checker in self.checkers:
            problems.extend(checker.problems)
            checker.problems.clear()
        if self.sink is not None:
            problems.extend(self.sink.violations)
            self.sink.violations.clear()
        if self.declared is not None:
            names = self.up.attribute_names()
            # Requests the audit compares (live on both sides): none at all is no audit.
            self.requests_audited += len(set(names.requests) & set(self.sub.scheduler.requests))
            problems.extend(audit_requests(names, self.sub.scheduler, self.declared))
            problems.extend(audit_scheduler(names, self.sub.scheduler, self.declared))
        if self.boundary is not None:
            problems.extend(self.boundary_problems(f"after operation {len(self.trace.ops) - 1}"))
        return problems

    def boundary_problems(self, when: str) -> list[str]:
        """C-46: what crossed since the last call arrived unchanged; nothing is left held."""
        assert self.boundary is not None
        sched = self.sub.scheduler
        problems = crossing_problems(self.boundary.request_crossings(sched))
        problems += crossing_problems(self.boundary.chunk_crossings(sched))
        return problems + leftover_problems(self.boundary.leftovers(sched), when)

    def clauses(self) -> set[str]:
        """The clauses this session checks for its subject and feature (what the subject
        declared decides which audits run, so a report credits only those)."""
        found = {"C-01", "C-02", "C-04", "C-05", "C-06", "C-07", "C-20", "C-62"}
        if self.declared is not None:
            found |= {"C-10", "C-11", "C-12"}
        if self.sink is not None:
            found.add("C-21")
        if self.boundary is not None and self.audits:
            found.add("C-46")
        if self.delivery is not None and self.feature.additional_config:
            found |= {"C-42", "C-43"}
            if self.delivery.expected_tokens(self.feature, []) is not None:
                found |= {"C-40", "C-44", "C-45"}
            probes = self.subject.runner_probes() if self.feature.use_worker else None
            if probes is not None and self.subject.model_reference() is not None:
                found.add("C-31")
                if probes.includes_hidden(self.feature):
                    found |= {"C-45", "C-51", "C-55"}
                else:
                    found.add("C-30")
        if self.checkers[0].payloads is not None:
            found.add("C-51")
        return found

    def teardown_problems(self, *, check_reference: bool = False) -> list[str]:
        """After ``drain``: conservation, the ledger, and (optionally) model parity (C-08)."""
        problems = list(self.problems) + self.terminal.drained_problems()
        problems += self.conservation_problems()
        if self.boundary is not None:
            problems += self.boundary_problems("once the workload drained")
        reference = self.subject.model_reference() if self.feature.use_worker else None
        ref = cached(reference) if reference is not None else None
        if self.delivery is not None and self.feature.additional_config:
            probes = self.subject.runner_probes() if self.feature.use_worker else None
            problems += ledger_problems(
                self,
                self.feature,
                self.delivery,
                includes_hidden=probes.includes_hidden(self.feature) if probes else None,
                reference=ref,
            )
        problems += self.ref_problems
        problems += self.unplanted_fault_problems()
        if check_reference and ref is not None:
            problems += hf_problems(self, ref)
        return problems

    def unplanted_fault_problems(self) -> list[str]:
        """C-61: differences this program had tolerated by entries that only a planted fault
        may make (``planted_only``): the audited programs plant none, so the subject's own code
        failed (a shipped processor that raises, say) and the entry hid it."""
        planted = {e.id for e in self.registry.entries if getattr(e, "planted_only", False)}
        return [
            f"C-61: {self.registry.describe(eid)} tolerated {n} difference(s), but this "
            "program plants no fault: the subject failed a request on its own"
            for eid, n in sorted(self.tolerated.items())
            if eid in planted
        ]

    def local_sides(self) -> list[Side]:
        """The sides in this process (the oracle's is elsewhere when it runs isolated)."""
        return [side for side in (self.up, self.sub) if isinstance(side, Side)]

    def shutdown(self) -> None:
        for side in self.local_sides():
            inner = getattr(side.executor, "inner", side.executor)
            worker = getattr(inner, "worker", inner)
            shutdown = getattr(worker, "shutdown", None)
            if shutdown is not None:
                shutdown()


def _describe_chunk(delivery: Any, chunk: Any) -> str:
    view = delivery.view(chunk)
    return f"{view.request_id}#{view.seq}"


def describe(session: Lockstep, problems: list[str]) -> str:
    ops = "\n".join(f"  {i}: {op.describe()}" for i, op in enumerate(session.trace.ops[-60:]))
    return (
        f"{problems[0]}"
        + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "")
        + (f"\nprogram ({len(session.trace.ops)} ops, last 60 shown):\n{ops}")
    )


# ---- one property's run -------------------------------------------------------------------


@dataclass
class MachineRun:
    """What a property runs (subject, feature, config) and what it saw (the last program's
    length in rules, so the shrunk failing program's when it fails)."""

    recorder: Any
    subject: Subject
    feature: Feature
    config: HarnessConfig
    name: str
    check_reference: bool = False
    # A scheduler axis's per-request draws (``conformance._core.axes.Axis.request_values``).
    request_values: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    last_ops: int = 0
    # Clauses the sessions of this run checked (``AuditedLockstep.clauses``).
    clauses: set[str] = field(default_factory=set)
    # The last session whose audits failed, and its problems (saved as a trace at the end).
    audit_failure: tuple[AuditedLockstep, list[str]] | None = None
    # The sessions this run opened (what their audits covered is read after the run).
    sessions: list[AuditedLockstep] = field(default_factory=list)
    # Snapshot sections whose first difference does not end a session (``Lockstep.defer``), and
    # the shortest such difference any example met: reported after the run (``run_machine``).
    defer: tuple[str, ...] = ()
    deferred: Deferred | None = None

    def open_session(self) -> AuditedLockstep:
        """An audited session registered with the recorder so its steps are counted."""
        session = AuditedLockstep(
            self.config, self.subject, feature=self.feature, prefixes=PREFIXES, defer=self.defer
        )
        self.recorder.sessions.append(session)
        self.sessions.append(session)
        self.recorder.examples += 1
        self.clauses |= session.clauses()
        if self.check_reference:
            self.clauses.add("C-08")
        return session


class InvariantMachine(LockstepMachine):
    """``LockstepMachine`` over an ``AuditedLockstep``; see the module docstring."""

    def __init__(self, run: MachineRun) -> None:
        super().__init__(
            run.recorder,
            run.config,
            final_stages=run.feature.final_stages,
            plain_requests=run.feature.plain_requests,
            name=run.name,
            session=run.open_session(),
            request_values=run.request_values,
        )
        self.run = run
        # Hypothesis checks invariants once before the first rule and after every rule.
        self.checks = 0
        run.last_ops = 0

    @invariant()
    def audits_hold(self) -> None:
        # Named to sort before the base class's invariant: hypothesis runs them by name.
        self.run.last_ops = self.checks
        self.checks += 1
        if self.session.problems:
            self.run.audit_failure = (self.session, list(self.session.problems))
            raise AssertionError(describe(self.session, self.session.problems))

    def teardown(self) -> None:
        found = self.session.deferred
        if found is not None and (
            self.run.deferred is None or len(found.ops) < len(self.run.deferred.ops)
        ):
            self.run.deferred = found
        try:
            if self.session.failure is None and not self.session.problems:
                self.session.drain()
                if self.session.problems:  # the drain's own problems (C-62) lead, by clause
                    self.run.audit_failure = (self.session, list(self.session.problems))
                    raise AssertionError(describe(self.session, self.session.problems))
                if self.session.failure is not None:
                    self.recorder.fail(self.session, self.name)
                problems = self.session.teardown_problems(check_reference=self.run.check_reference)
                if problems:
                    self.run.audit_failure = (self.session, problems)
                    raise AssertionError(describe(self.session, problems))
        finally:
            self.session.shutdown()


class SessionInvariantMachine(StreamsInput, InvariantMachine):
    """``InvariantMachine`` whose client also streams input to its sessions (``StreamsInput``)."""


class PausingInvariantMachine(Pauses, InvariantMachine):
    """``InvariantMachine`` whose engine also pauses and resumes its scheduler (``Pauses``)."""


def axis_machine(axis: Any) -> type[InvariantMachine]:
    """The machine a scheduler axis runs on: with the client rules its workloads need."""
    if axis.streams_input:
        return SessionInvariantMachine
    if axis.pauses:
        return PausingInvariantMachine
    return InvariantMachine


@dataclass
class MachineOutcome:
    error: BaseException | None
    ops: int
    # The run's error is its deferred difference (no example failed otherwise).
    from_deferred: bool = False


def run_machine(
    run: MachineRun,
    run_settings: settings | None = None,
    machine: Callable[[MachineRun], InvariantMachine] = InvariantMachine,
) -> MachineOutcome:
    """Run the property; return its failure (if any) and the last program's length. With no
    other failure, a deferred difference (``MachineRun.defer``) is the run's failure."""
    try:
        run_state_machine_as_test(lambda: machine(run), settings=run_settings)
    except Exception as exc:  # noqa: BLE001 - the caller reports any failure
        return MachineOutcome(exc, run.last_ops)
    if run.deferred is not None:
        found = run.deferred
        return MachineOutcome(SubjectBroken(found.difference), len(found.ops), from_deferred=True)
    return MachineOutcome(None, run.last_ops)


def raise_failure(outcome: MachineOutcome, run: MachineRun | None = None) -> None:
    """Raise the property's failure; an audit failure is first saved as a shrunk trace
    (lock-step differences are saved by the recorder as they happen)."""
    if outcome.error is None:
        return
    if run is not None and run.deferred is not None and hasattr(run.recorder, "trace"):
        deferred = record_deferred(run, is_the_failure=outcome.from_deferred)
        if outcome.from_deferred:
            raise deferred from None
    if run is not None and run.audit_failure is not None and hasattr(run.recorder, "trace"):
        session, problems = run.audit_failure
        path, problem = record_audit_failure(
            session,
            problems,
            subject_spec=getattr(run.recorder, "subject_spec", None),
            name=run.name,
            check_reference=run.check_reference,
            folder=getattr(run.recorder, "failures_dir", None),
        )
        run.recorder.trace = str(path)
        raise AssertionError(f"{problem}\ntrace: {path}") from outcome.error
    raise outcome.error


def record_deferred(run: MachineRun, *, is_the_failure: bool) -> SubjectBroken:
    """Save the run's deferred difference as a shrunk trace (its operations re-run with nothing
    set aside fail there); the recorder keeps it as the test's ``set_aside`` finding, and as its
    failure when nothing else failed. Returns the failure to raise for it."""
    assert run.deferred is not None
    trace = Trace(run.config, list(run.deferred.ops), dict(PREFIXES))
    rerun = run_trace(trace, run.subject)
    if rerun.failure is None:  # nothing set aside, it must fail as it did: a harness bug if not
        raise AssertionError(
            f"{run.name}: the deferred difference did not recur when its "
            f"{len(trace.ops)} operations were re-run ({run.deferred.difference.headline()})"
        )
    path, difference = record_failure(
        rerun.session,
        subject_spec=getattr(run.recorder, "subject_spec", None),
        name=f"{run.name}-{rerun.failure.section}",
        folder=getattr(run.recorder, "failures_dir", None),
        profile=getattr(run.recorder, "profile", None),
        test=getattr(run.recorder, "test", None),
    )
    run.recorder.set_aside = {"first_difference": difference.to_dict(), "trace": str(path)}
    if is_the_failure:
        run.recorder.first_difference = difference.to_dict()
        run.recorder.trace = str(path)
    return SubjectBroken(difference)


def lockstep_run(
    recorder: Any,
    subject: Subject,
    feature: Feature,
    name: str,
    *,
    mode: str,
    prefix: bool,
    speculative: int = 0,
    **kw: Any,
) -> MachineRun:
    """The run of a lock-step property of ``feature`` under ``harness_config(feature, ...)``,
    with ``speculative`` draft tokens per step (sync scheduling only, as vLLM's engine)."""
    cfg = harness_config(feature, mode=mode, prefix=prefix, num_speculative_tokens=speculative)
    return MachineRun(recorder, subject, feature, cfg, name, **kw)


def check_machine(
    run: MachineRun,
    run_settings: settings | None = None,
    machine: Callable[[MachineRun], InvariantMachine] = InvariantMachine,
) -> None:
    """Run the property and raise its failure (``run_machine`` then ``raise_failure``)."""
    raise_failure(run_machine(run, run_settings, machine), run)


# ---- audit failures as replayable traces ---------------------------------------------------

# What ``omni-conformance replay`` imports to re-run an audit trace (see ``replay_audit``).
REPLAY_AUDIT = "invariants.machines:replay_audit"


def audit_problems(
    trace: Trace, subject: Subject, feature: Feature, check_reference: bool
) -> list[str]:
    """Re-run ``trace`` in an audited session: the problems of its operations, then (when the
    operations ran clean) of the drain and teardown."""
    session = AuditedLockstep(
        trace.config,
        subject,
        feature=feature,
        prefixes=dict(trace.prefixes),
        set_aside=tuple(trace.meta.get(SET_ASIDE, ())),
    )
    try:
        for op in trace.ops:
            if session.failure is not None or session.problems:
                break
            session.apply(op)
        # Problems first: a C-62 problem can come with a difference at the same operation.
        if session.problems:
            return list(session.problems)
        if session.failure is not None:
            return [f"first difference: {session.failure.headline()}"]
        session.drain()
        if session.problems:
            return list(session.problems)
        if session.failure is not None:
            return [f"first difference: {session.failure.headline()}"]
        return session.teardown_problems(check_reference=check_reference)
    finally:
        session.shutdown()


def _clause(problem: str) -> str:
    return problem.split(":", 1)[0]


def record_audit_failure(
    session: AuditedLockstep,
    problems: list[str],
    *,
    subject_spec: str | None,
    name: str,
    check_reference: bool,
    folder: str | Path | None = None,
) -> tuple[Path, str]:
    """Shrink (bounded, ``conformance._core.lockstep.Shrinker``) the failing session's trace to the
    smallest one whose audits fail with the same clause, and save it for ``replay``."""
    # Found with sections set aside (a deferred statistics difference): replayed the same way.
    set_aside = {SET_ASIDE: sorted(session.set_aside)} if session.set_aside else {}
    found = Trace(
        session.config, list(session.trace.ops), dict(session.trace.prefixes), dict(set_aside)
    )
    subject, feature, clause = session.subject, session.feature, _clause(problems[0])

    def same_clause(t: Trace) -> bool:
        return any(
            _clause(p) == clause for p in audit_problems(t, subject, feature, check_reference)
        )

    result = Shrinker(found, same_clause).run()
    trace = result.trace
    rerun = audit_problems(trace, subject, feature, check_reference)
    same = [p for p in rerun if _clause(p) == clause]
    if not same:
        trace, same = found, problems
    trace.meta = {
        "kind": "audit",
        "replay": REPLAY_AUDIT,
        "subject": subject_spec or subject.name,
        "test": name,
        "feature": {
            "name": feature.name,
            "additional_config": dict(feature.additional_config),
            "final_stages": list(feature.final_stages),
            "use_worker": feature.use_worker,
        },
        "check_reference": check_reference,
        **environment_versions(),
        "problem": same[0],
        "found": {"ops": len(found.ops), "problem": problems[0]},
        "shrink": result.to_dict(),
        **set_aside,
    }
    path = failures_dir(folder) / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)[:120]}.json"
    trace.save(path)
    return path, same[0]


def replay_audit(trace: Trace, subject: Subject) -> list[str]:
    """The problems an audit trace shows on ``subject`` now (empty: it does not reproduce)."""
    f = trace.meta["feature"]
    feature = Feature(
        f["name"], f["additional_config"], tuple(f["final_stages"]), bool(f["use_worker"])
    )
    return audit_problems(trace, subject, feature, bool(trace.meta.get("check_reference")))


class LocalRecorder:
    """What the plugin's ``conformance`` recorder offers, for runs outside a pytest test."""

    def __init__(self, subject: Subject) -> None:
        self.subject = subject
        self.sessions: list[Lockstep] = []
        self.examples = 0
        self.steps_compared = 0

    def fail(self, session: Lockstep, name: str) -> None:
        assert session.failure is not None
        raise SubjectBroken(session.failure)


def examples(at_ci: int) -> int:
    """``at_ci`` examples under the ``ci`` profile, scaled with the loaded profile (``thorough``
    runs ten times as many), so the suite's budget is set here, per property."""
    from conformance.plugin import CI_EXAMPLES

    return max(1, round(at_ci * settings.default.max_examples / CI_EXAMPLES))


def suite_settings(at_ci: int, **kw: Any) -> settings:
    """The loaded profile with this property's example count (and no example database but a
    sharded deep run's, ``conformance.plugin.suite_database``)."""
    from conformance.plugin import suite_database

    return settings(settings.default, max_examples=examples(at_ci), database=suite_database(), **kw)
