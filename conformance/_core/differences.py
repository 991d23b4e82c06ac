"""The differences-registry mechanism: how a subject's documented differences tolerate a field.

Each subject declares its own entries (the omni runtime's are in ``omni_runtime/differences.py``);
this module decides, for one observed difference, which entry (if any) tolerates it: one whose
``fields`` patterns match the field path and whose ``applies(ctx)`` holds (C-02). An entry that
matched by pattern but not by condition is remembered, so the failure names it.

The entry attributes and the ``ctx`` handed to ``applies`` (``path``, ``upstream``, ``subject``,
``request_id``, ``config``, ``subject_state``, ``step``, ``op``, ``mode``) are documented for
registry authors in docs/adopting-the-gate.md, section 4; matching in docs/design.md, "Inside
the gate".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from conformance._core.subjects import DifferenceEntry


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
    entries: Sequence[DifferenceEntry] = ()
    disabled: frozenset[str] = field(default_factory=frozenset)
    _by_path: dict[str, tuple[DifferenceEntry, ...]] = field(default_factory=dict, repr=False)

    def candidates(self, path: str) -> tuple[DifferenceEntry, ...]:
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


def validate_entries(entries: Sequence[object]) -> list[str]:
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
