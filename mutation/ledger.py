"""The triage ledger, ``mutation/triage.toml``: what the campaign is told about survivors.

Owns reading its ``[[equivalent]]`` entries (a survivor no behaviour tells apart, with the
reason) and its ``[[guard]]`` entries (an expression, false where a survivor's difference cannot
matter, that the infection run checks), and matching both to mutants. An entry names the
function and the mutated line pair, not mutmut's positional number, so it survives unrelated
edits; an equivalent entry that matches nothing is reported as stale. How to triage a survivor:
``docs/mutation-score.md``.
"""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from pathlib import Path

from mutation import REPO, CampaignError
from mutation.results import Mutant

LEDGER = REPO / "mutation" / "triage.toml"


def load_ledger(path: Path = LEDGER) -> list[dict[str, object]]:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise CampaignError(f"{path}: {exc}") from exc
    entries = data.get("equivalent", [])
    for i, entry in enumerate(entries):
        for key in ("function", "change", "reason"):
            if not entry.get(key):
                raise CampaignError(f"{path}: equivalent entry {i + 1} has no {key!r}")
    return list(entries)


def load_guards(mutants: Sequence[Mutant], path: Path = LEDGER) -> dict[str, str]:
    """The infection guards of the ledger's ``[[guard]]`` entries (``function``, ``change``,
    ``when``, ``reason``), by the key of the mutant each matches, as the equivalents match."""
    try:
        entries = tomllib.loads(path.read_text()).get("guard", [])
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise CampaignError(f"{path}: {exc}") from exc
    found: dict[str, str] = {}
    for i, entry in enumerate(entries):
        for key in ("function", "change", "when", "reason"):
            if not entry.get(key):
                raise CampaignError(f"{path}: guard entry {i + 1} has no {key!r}")
        try:
            compile(str(entry["when"]), str(path), "eval")
        except SyntaxError as exc:
            raise CampaignError(
                f"{path}: guard entry {i + 1}: 'when' is no expression: {exc}"
            ) from exc
        change = tuple(str(c) for c in entry["change"])
        for m in mutants:
            if m.function == entry["function"] and m.change == change:
                found[m.key] = str(entry["when"])
    return found


def apply_ledger(mutants: list[Mutant], ledger: list[dict[str, object]]) -> list[dict[str, object]]:
    """Mark ledger matches equivalent; return the entries that matched no mutant (stale)."""
    used: set[int] = set()
    for m in mutants:
        if not m.change:
            continue
        for i, entry in enumerate(ledger):
            change = tuple(str(c) for c in entry["change"])  # type: ignore[attr-defined]
            if entry["function"] == m.function and change == m.change:
                m.equivalent = str(entry["reason"])
                used.add(i)
    return [e for i, e in enumerate(ledger) if i not in used]
