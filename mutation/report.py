"""The score and its report.

Owns the tally per target (``COLUMNS``), the score (killed / (mutants - equivalent - not run):
a mutant no test reaches counts as not killed, one a stopped campaign never ran is reported and
not scored), the Markdown report (``render``) and ``report``, which reads a work folder's
results, applies the ledger, re-checks survivors (or takes the kept verdicts) and writes
``score.md`` and ``score.json`` into the work folder. Figures and method:
``docs/mutation-score.md``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from mutation import CampaignError
from mutation.ledger import apply_ledger, load_ledger
from mutation.reach import load_reach
from mutation.recheck import kept_verdicts, recheck
from mutation.results import RECHECKED, Mutant, load_results, mutant_changes
from mutation.targets import Slice

COLUMNS = (
    "mutants",
    "killed",
    "equivalent",
    "survived",
    "no tests",
    "timeout",
    "not run",
    "other",
)


def tally(mutants: Iterable[Mutant]) -> dict[str, int]:
    row = dict.fromkeys(COLUMNS, 0)
    for m in mutants:
        row["mutants"] += 1
        final = m.final
        row[final if final in row else "other"] += 1
    return row


def score(row: dict[str, int]) -> float:
    """Killed over the mutants that got a verdict, equivalents excluded (a campaign stopped
    early leaves mutants "not run": they are reported, not scored)."""
    countable = row["mutants"] - row["equivalent"] - row["not run"]
    return row["killed"] / countable if countable else 1.0


UNREACHED = "; no test executes the mutated statement under the re-check's profile"
UNINFECTED = (
    "; no test that executes it computes anything otherwise there under the re-check's profile"
)
NOTES = {"unreached": UNREACHED, "uninfected": UNINFECTED}


def render(
    mutants: list[Mutant],
    stale: list[dict[str, object]],
    meta: dict[str, object],
    left_out: Sequence[str] = (),
) -> str:
    """The report. ``left_out``: the tests the re-check's reach run saw fail with no mutant
    active, which no re-check runs (a refreshed harness the work folder's runtime does not
    match fails whole files this way, and narrows every re-check without it)."""
    labels = list(dict.fromkeys(m.target for m in mutants))
    lines = [
        "# Mutation score of the invariant suite",
        "",
        f"mutmut {meta.get('mutmut')} on {str(meta.get('rev', '?'))[:12]}, profile {meta.get('profile')} "
        f"(survivors re-checked under {meta.get('recheck')}"
        + (
            f", against the suite of {meta['suite_refreshed_from']}"
            if meta.get("suite_refreshed_from")
            else ""
        )
        + (
            f"; survivors run again under {meta['rerun_profile']} "
            f"({float(meta.get('rerun_seconds', 0.0)):.0f} s)"  # type: ignore[arg-type]
            if meta.get("rerun_profile")
            else ""
        )
        + f"), {meta.get('children')} workers, {meta.get('seconds', 0):.0f} s"
        + (
            " so far: stopped before the end (`resume` goes on)."
            if meta.get("complete") is False
            else "."
        ),
        "",
        "| module | " + " | ".join(COLUMNS) + " | score |",
        "|---|" + "---|" * (len(COLUMNS) + 1),
    ]
    for label in [*labels, "total"]:
        row = tally(m for m in mutants if label in ("total", m.target))
        cells = " | ".join(str(row[c]) for c in COLUMNS)
        lines.append(f"| {label} | {cells} | {score(row):.1%} |")
    left = [m for m in mutants if m.final in ("survived", "no tests", "timeout")]
    if left:
        lines += ["", "## Not killed", ""]
        lines += [
            f"- `{m.name}` ({m.final}{NOTES.get(m.recheck or '', '')}): `{' / '.join(m.change)}`"
            for m in left
        ]
    if left_out:
        lines += ["", "## Tests left out of the re-checks (they fail with no mutant active)", ""]
        lines += [f"- `{t}`" for t in left_out]
    if stale:
        lines += ["", "## Stale ledger entries (match no survivor)", ""]
        lines += [f"- `{e['function']}`: `{' / '.join(map(str, e['change']))}`" for e in stale]  # type: ignore[call-overload]
    return "\n".join(lines) + "\n"


def report(
    work: Path,
    chosen: Slice,
    meta: dict[str, object],
    recheck_profile: str | None,
    recheck_timeout: float,
    recheck_only: str | None = None,
    recheck_tests: Sequence[str] = (),
    recheck_quick: float | None = None,
    keep: Callable[[], None] | None = None,
    infect: bool = True,
) -> tuple[str, float]:
    mutants = load_results(work, chosen.targets)
    wanted = [m.name for m in mutants if m.status in RECHECKED]
    changes = mutant_changes(work, [*wanted, *(name for name, _ in chosen.expected)])
    for m in mutants:
        m.change = changes.get(m.name, ())
    for name, change in chosen.expected:
        found = changes[name]
        if found != change:
            raise CampaignError(
                f"sampled mutant {name} now changes {' / '.join(found) or 'nothing'}, not "
                f"{' / '.join(change)}: the file was edited; pick the sample again"
            )
    # Entries for modules this campaign did not mutate (a slice) are not stale, only not asked.
    modules = tuple(t.path.removesuffix(".py").replace("/", ".") + "." for t in chosen.targets)
    stale = [
        e for e in apply_ledger(mutants, load_ledger()) if str(e["function"]).startswith(modules)
    ]
    reach = None
    if recheck_profile:
        # A targeted re-check names its tests; a full one runs the tests that reach each survivor.
        reach = None if recheck_tests else load_reach(work, recheck_profile, meta)
        if keep is not None:
            keep()  # a reach measured now cost a whole suite run: kept before any re-check
        recheck(
            work,
            mutants,
            recheck_profile,
            recheck_timeout,
            recheck_only,
            recheck_tests,
            reach,
            quick=recheck_quick,
            keep=keep,
            infect=infect,
        )
    else:
        kept_verdicts(work, mutants)
    text = render(mutants, stale, meta, reach.failing if reach is not None else ())
    total = score(tally(mutants))
    (work / "score.md").write_text(text)
    (work / "score.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "score": total,
                "per_module": {
                    label: tally(m for m in mutants if m.target == label)
                    for label in dict.fromkeys(m.target for m in mutants)
                },
                "mutants": [dataclasses.asdict(m) | {"final": m.final} for m in mutants],
            },
            indent=1,
        )
    )
    return text, total
