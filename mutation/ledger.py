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
from typing import Any

from mutation import REPO, CampaignError
from mutation.results import Mutant

LEDGER = REPO / "mutation" / "triage.toml"


def _entries(path: Path, table: str, keys: Sequence[str]) -> list[dict[str, Any]]:
    """The ledger's ``[[table]]`` entries, each refused unless it has every one of ``keys``."""
    try:
        entries = list(tomllib.loads(path.read_text()).get(table, []))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise CampaignError(f"{path}: {exc}") from exc
    for i, entry in enumerate(entries):
        for key in keys:
            if not entry.get(key):
                raise CampaignError(f"{path}: {table} entry {i + 1} has no {key!r}")
    return entries


def _matches(entry: dict[str, Any], m: Mutant) -> bool:
    return m.function == entry["function"] and m.change == tuple(str(c) for c in entry["change"])


def load_ledger(path: Path = LEDGER) -> list[dict[str, object]]:
    return _entries(path, "equivalent", ("function", "change", "reason"))


def load_guards(mutants: Sequence[Mutant], path: Path = LEDGER) -> dict[str, str]:
    """The infection guards of the ledger's ``[[guard]]`` entries (``function``, ``change``,
    ``when``, ``reason``), by the key of the mutant each matches, as the equivalents match."""
    found: dict[str, str] = {}
    for i, entry in enumerate(_entries(path, "guard", ("function", "change", "when", "reason"))):
        try:
            compile(str(entry["when"]), str(path), "eval")
        except SyntaxError as exc:
            raise CampaignError(
                f"{path}: guard entry {i + 1}: 'when' is no expression: {exc}"
            ) from exc
        for m in mutants:
            if _matches(entry, m):
                found[m.key] = str(entry["when"])
    return found


def apply_ledger(mutants: list[Mutant], ledger: list[dict[str, object]]) -> list[dict[str, object]]:
    """Mark ledger matches equivalent; return the entries that matched no mutant (stale)."""
    used: set[int] = set()
    for m in mutants:
        if not m.change:
            continue
        for i, entry in enumerate(ledger):
            if _matches(entry, m):
                m.equivalent = str(entry["reason"])
                used.add(i)
    return [e for i, e in enumerate(ledger) if i not in used]
