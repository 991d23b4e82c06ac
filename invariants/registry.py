"""C-03 checks of a subject's differences registry: every entry complete, every entry still needed.

Both read only what the subject declares: ``Subject.differences`` and, for "still needed", its
``DifferenceWitness`` workloads (``Subject.difference_witnesses``, a capability).

* ``registry_problems`` — each entry names field patterns within the snapshot's sections, its
  condition in words and as a predicate, its rationale, clauses ``conformance._core.clauses``
  defines, and at least one test as a pytest node id.
* ``witness_problems`` — each entry's witness passes in lock step with the whole registry, is
  tolerated by that entry at least once, and fails without it at a field it names; stale
  entries and needless witnesses are reported, and every request of a witness ends with
  exactly one terminal outcome (C-62, ``invariants.outcomes``).

Each problem is a string that starts with its clause id. C-03: docs/contracts.md; entries:
docs/adopting-the-gate.md, section 4.
"""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase
from typing import Any

from conformance._core.capabilities import DifferenceWitness
from conformance._core.clauses import unknown
from conformance._core.differences import Registry, validate_entries
from invariants.machines import AuditedLockstep, harness_config

# The top-level sections of a lock-step snapshot (``conformance._core.observe``): a field pattern
# outside them can never match, so the entry would tolerate nothing.
SNAPSHOT_SECTIONS = (
    "requests.",
    "queues.",
    "block_pool.",
    "encoder_cache.",
    "sched_out.",
    "outputs.",
    "audit.",
)


def registry_problems(entries: Sequence[Any]) -> list[str]:
    """Completeness of every entry (empty when the registry is complete)."""
    problems = [f"C-03: {p}" for p in validate_entries(entries)]
    for e in entries:
        label = getattr(e, "id", repr(e))
        for pattern in getattr(e, "fields", None) or ():
            if not str(pattern).startswith(SNAPSHOT_SECTIONS):
                problems.append(
                    f"C-03: {label}: field pattern {pattern!r} names no snapshot section "
                    f"({', '.join(s.rstrip('.') for s in SNAPSHOT_SECTIONS)})"
                )
        for test in getattr(e, "tests", None) or ():
            path, sep, name = str(test).partition("::")
            if not (sep and path.endswith(".py") and name):
                problems.append(f"C-03: {label}: test {test!r} is not a pytest node id")
        if bad := unknown(getattr(e, "clauses", None) or ()):
            problems.append(f"C-03: {label}: cites clauses nobody defines: {', '.join(bad)}")
    return problems


def run_witness(
    subject: Any, witness: DifferenceWitness, registry: Registry, recorder: Any = None
) -> AuditedLockstep:
    """The witness's workload in one session (then drained); counted by ``recorder``."""
    cfg = harness_config(witness.feature, mode=witness.mode, prefix=True)
    # audits=False: the per-operation audits belong to the lock-step properties; the terminal
    # outcome ledger (C-62) runs in every audited session regardless.
    session = AuditedLockstep(
        cfg, subject, feature=witness.feature, audits=False, registry=registry
    )
    if recorder is not None:
        recorder.sessions.append(session)
        recorder.examples += 1
    for op in witness.ops:
        session.apply(op)
        if session.failure is not None:
            return session
    session.drain()
    return session


def witness_problems(
    subject: Any, witnesses: Sequence[DifferenceWitness], recorder: Any = None
) -> list[str]:
    """ "Still needed" for every entry (empty when each is used and needed)."""
    entries = {e.id: e for e in subject.differences()}
    by_entry: dict[str, list[DifferenceWitness]] = {}
    for w in witnesses:
        by_entry.setdefault(w.entry, []).append(w)
    problems = [
        f"C-03: a witness names {name}, which is no entry of the registry"
        for name in sorted(set(by_entry) - set(entries))
    ]
    whole = Registry(list(entries.values()))
    for eid, entry in entries.items():
        if not by_entry.get(eid):
            problems.append(
                f"C-03: {eid} has no witness: no workload the subject declares makes it happen"
            )
            continue
        for w in by_entry[eid]:
            label = f"{eid} (witness {w.feature.name}, {w.mode})"
            session = run_witness(subject, w, whole, recorder)
            if session.failure is not None:
                problems.append(
                    f"C-03: {label} fails with the whole registry: {session.failure.headline()}"
                )
                continue
            problems += session.problems + session.terminal.drained_problems()
            if session.tolerated.get(eid, 0) == 0:
                problems.append(
                    f"C-03: {label}: stale entry: its witness ran {session.steps_compared} "
                    "steps and the entry tolerated no difference (it hides nothing: remove it)"
                )
                continue
            without = run_witness(subject, w, whole.without({eid}), recorder)
            if without.failure is None:
                problems.append(f"C-03: {label}: not needed: the witness passes without the entry")
            elif not any(fnmatchcase(without.failure.path, p) for p in entry.fields):
                problems.append(
                    f"C-03: {label}: without the entry the witness fails at "
                    f"{without.failure.path}, a field the entry does not name"
                )
    return problems
