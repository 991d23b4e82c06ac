"""The differences-registry mechanism: how a subject's documented differences tolerate a field.

Each subject declares its own entries (the omni runtime's live in ``omni_runtime/differences.py``);
this module only decides, for one observed difference, which entry (if any) tolerates it. An
entry tolerates a difference when one of its ``fields`` fnmatch patterns matches the field path
*and* its ``applies(ctx)`` returns True. An entry whose pattern matches but whose condition does
not hold is remembered, so the failure says "OMNI-OUT-001 names this field but its condition
(...) does not hold here" rather than just "unexpected difference".

The context handed to ``applies`` (documented for registry authors):

``path``           the field path (see ``conformance._core.observe``)
``upstream``       upstream's value (None when upstream has no such field)
``subject``        the subject's value (None when the subject has no such field)
``request_id``     the request the field belongs to, or None
``config``         ``HarnessConfig.to_dict()`` (``additional_config`` included)
``subject_state``  request id -> the subject's extra facts (``Subject.request_facts``), captured
                   while the request was live
``step``           the lock-step index of the operation; ``op`` its description; ``mode``
                   ``"sync"`` or ``"async"``
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any


@dataclass(frozen=True)
class Difference:
    """One documented difference of a subject from upstream (``conformance._core.subjects``'s
    ``DifferenceEntry``): the field patterns it tolerates, the condition as a predicate on the
    context above and in words, why, the tests that make it happen and the clauses it touches.
    ``documented_at`` names where a third-party runtime documents it, for adapters of runtimes
    this project did not write. ``planted_only``: the difference follows from a fault (a
    processor or connector that raised), so only a run that plants one may meet it; an audited
    lock-step program that plants none and still has it tolerated reports it (C-61: the
    subject's own code failed where nothing made it fail, and the entry would have hidden it)."""

    id: str
    fields: tuple[str, ...]
    condition: str
    applies: Callable[[Mapping[str, Any]], bool]
    rationale: str
    tests: tuple[str, ...]
    clauses: tuple[str, ...]
    documented_at: tuple[str, ...] = ()
    planted_only: bool = False


@dataclass(frozen=True)
class Judgement:
    tolerated_by: str | None
    matched_but_not_applicable: tuple[str, ...] = ()


@dataclass
class Registry:
    entries: Sequence[Any] = ()
    disabled: frozenset[str] = field(default_factory=frozenset)
    _by_path: dict[str, tuple[Any, ...]] = field(default_factory=dict, repr=False)

    def candidates(self, path: str) -> tuple[Any, ...]:
        hit = self._by_path.get(path)
        if hit is None:
            hit = tuple(
                e
                for e in self.entries
                if e.id not in self.disabled and any(fnmatchcase(path, p) for p in e.fields)
            )
            self._by_path[path] = hit
        return hit

    def judge(self, ctx: Mapping[str, Any]) -> Judgement:
        rejected: list[str] = []
        for entry in self.candidates(ctx["path"]):
            try:
                ok = bool(entry.applies(ctx))
            except Exception:  # a crashing condition never tolerates anything
                ok = False
            if ok:
                return Judgement(entry.id)
            rejected.append(entry.id)
        return Judgement(None, tuple(rejected))

    def without(self, ids: Iterable[str]) -> Registry:
        return Registry(self.entries, self.disabled | frozenset(ids))

    def describe(self, entry_id: str) -> str:
        for e in self.entries:
            if e.id == entry_id:
                return f"{e.id} ({e.condition})"
        return entry_id


def validate_entries(entries: Sequence[Any]) -> list[str]:
    """C-03: problems with registry entries (empty list when every entry is complete)."""
    problems: list[str] = []
    seen: set[str] = set()
    for e in entries:
        label = getattr(e, "id", repr(e))
        if label in seen:
            problems.append(f"{label}: duplicate id")
        seen.add(label)
        for attr in ("fields", "tests", "clauses"):
            if not getattr(e, attr, None):
                problems.append(f"{label}: {attr} is empty")
        for attr in ("condition", "rationale"):
            if not str(getattr(e, attr, "") or "").strip():
                problems.append(f"{label}: {attr} is empty")
        if not callable(getattr(e, "applies", None)):
            problems.append(f"{label}: applies is not callable")
    return problems
