"""The contract clauses: every ``C-xx`` id the code, the tests and the docs cite, in one table.

Each clause belongs to one invariant (AR-INV-001..003) or one payload contract group, and has a
one-line title. ``docs/contracts.md`` states each clause in full, with the tests and the mutants
that prove it; the compat report (``conformance._core.report``) counts results per clause from this
table; a ``clauses(...)`` marker naming an id that is not here fails test collection
(``conformance.plugin``); ``tests/test_clauses.py`` holds the code, the tests and the docs to it.

This module imports nothing but the standard library: the plugin reads it in every pytest run.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

# The three architecture invariants: the report rolls clause results up into these.
INVARIANTS: dict[str, str] = {
    "AR-INV-001": "vLLM owns base scheduling semantics",
    "AR-INV-002": "Omni data crosses explicit adapters",
    "AR-INV-003": "Workers execute assigned work",
}

# The payload contract groups: clauses about what crosses a stage boundary and how.
GROUPS: dict[str, str] = {
    "token-only-payloads": "Token-only stages send tokens, not hidden rows",
    "chunk-processors": "Chunk processors see every accepted token once, and end once",
    "materialization": "Payloads are built from the right rows, on the right thread",
    "reliability": "Bad input and faults stay with the request they concern",
    "process-boundary": "What crosses a stage's process boundary arrives unchanged",
    "receiving-stages": "A stage waiting for chunks keeps its requests in upstream's states",
}

CLAUSE_ID = re.compile(r"\bC-\d{2}\b")


@dataclass(frozen=True)
class Clause:
    id: str
    invariant: str  # a key of INVARIANTS or of GROUPS
    title: str


def _table(*rows: tuple[str, str, str]) -> dict[str, Clause]:
    return {cid: Clause(cid, inv, title) for cid, inv, title in rows}


CLAUSES: dict[str, Clause] = _table(
    # AR-INV-001: vLLM owns base scheduling semantics
    ("C-01", "AR-INV-001", "Request state and queues equal upstream's after every operation"),
    ("C-02", "AR-INV-001", "A difference from upstream is tolerated only by a registry entry"),
    ("C-03", "AR-INV-001", "Every registry entry is complete and still needed"),
    ("C-04", "AR-INV-001", "No subject per-request state outlives its request"),
    ("C-05", "AR-INV-001", "The block pool and prefix cache equal upstream's"),
    ("C-06", "AR-INV-001", "Blocks and requests are conserved once the workload drains"),
    ("C-07", "AR-INV-001", "Scheduler and engine outputs equal upstream's, sync and async"),
    ("C-08", "AR-INV-001", "Greedy tokens equal an independent model reference"),
    ("C-09", "AR-INV-001", "Every scheduler axis, its statistics and events, equals upstream's"),
    # AR-INV-002: Omni data crosses explicit adapters
    ("C-10", "AR-INV-002", "Omni data enters only through declared slots and builders"),
    ("C-11", "AR-INV-002", "No tensor or payload is reachable from upstream fields"),
    ("C-12", "AR-INV-002", "Requests and schedulers carry no undeclared attributes"),
    ("C-13", "AR-INV-002", "Malformed stage inputs are rejected at the adapter"),
    # AR-INV-003: Workers execute assigned work
    ("C-20", "AR-INV-003", "Runner results cover exactly the scheduled requests, in order"),
    ("C-21", "AR-INV-003", "Workers never route: no send from worker code, no routing imports"),
    ("C-22", "AR-INV-003", "Worker results do not depend on the stage graph that follows"),
    # token-only payloads
    ("C-30", "token-only-payloads", "Token-only payloads carry no hidden rows; tokens unchanged"),
    ("C-31", "token-only-payloads", "The prefill conditioning crosses exactly once"),
    # chunk processors
    ("C-40", "chunk-processors", "Declared token updates deliver every accepted id"),
    ("C-41", "chunk-processors", "Undeclared processors are called only with a tensor payload"),
    ("C-42", "chunk-processors", "A request final at this stage sends nothing downstream"),
    ("C-43", "chunk-processors", "Exactly one final call and one EOF chunk per downstream request"),
    ("C-44", "chunk-processors", "Processors get a copy of the stop-trimmed accepted ids"),
    ("C-45", "chunk-processors", "No position is delivered twice, even after preemption"),
    ("C-46", "process-boundary", "Chunks and stage inputs cross a process boundary unchanged"),
    (
        "C-47",
        "receiving-stages",
        "Parked requests stay live, accounted, and leave nothing on abort",
    ),
    # materialization
    ("C-50", "materialization", "Steps with nothing to deliver build no payload objects"),
    ("C-51", "materialization", "Payload slot i holds request i's scheduled rows"),
    ("C-52", "materialization", "Inline and background materialization deliver the same"),
    ("C-53", "materialization", "Builds never read a reused buffer; payloads align with req_ids"),
    ("C-54", "materialization", "Collection, building and builder errors on the right threads"),
    ("C-55", "materialization", "Full-prefix stages deliver rows from position 0 on a cache hit"),
    # reliability
    ("C-60", "reliability", "Bad input is rejected at admission, naming request and field"),
    ("C-61", "reliability", "A send-path, worker or decoder fault fails only its request"),
    ("C-62", "reliability", "Every request gets exactly one terminal outcome"),
)


def invariant_of(clause_id: str) -> str:
    """The invariant or contract group ``clause_id`` belongs to (KeyError when unknown)."""
    return CLAUSES[clause_id].invariant


def unknown(ids: Iterable[str]) -> list[str]:
    """The ids in ``ids`` that are not clauses of this table, sorted."""
    return sorted({str(i) for i in ids} - set(CLAUSES))


def cited(text: str) -> set[str]:
    """Every clause id written in ``text``; a range ``C-40..C-45`` cites its ends."""
    return set(CLAUSE_ID.findall(text))
