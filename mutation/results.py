"""mutmut's verdicts as the campaign reads them: one ``Mutant`` per mutated function variant.

Owns the fold of mutmut's exit codes into the report's statuses (``status_of``), the verdicts a
re-check may overturn (``RECHECKED``), a mutant's final verdict once the ledger and the re-check
have spoken (``Mutant.final``), reading mutmut's per-file results from a work folder
(``load_results``), and each mutant's changed lines (``mutant_changes``, as ``mutmut show``
prints them, all in one process). Method: ``docs/mutation-score.md``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from mutation import CampaignError
from mutation.targets import Target

# mutmut's result codes (its ``status_by_exit_code``), folded into the report's columns.
_STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped"}
_TIMEOUT = {-24, 24, 152, 255, 36}


def status_of(code: int | None) -> str:
    if code in _STATUS:
        return _STATUS[code]
    if code in _TIMEOUT:
        return "timeout"  # a mutant that hangs the suite is caught: mutmut counts it killed too
    return "not run" if code is None else "suspicious"


# Verdicts a re-check may overturn. "no tests" is mutmut's record of which tests called the
# function when the campaign began; tests added to the suite since may call it.
RECHECKED = ("survived", "timeout", "no tests")


@dataclasses.dataclass
class Mutant:
    name: str
    target: str
    status: str
    change: tuple[str, ...] = ()  # the mutated lines: "-old" / "+new", stripped
    equivalent: str | None = None  # the ledger's reason
    recheck: str | None = None  # "killed" / "survived" under the re-check profile

    @property
    def function(self) -> str:
        return self.name.rsplit("__mutmut_", 1)[0]

    @property
    def key(self) -> str:
        """The re-check caches' key: the name with the change, so an edit that makes the name
        mean another mutant does not inherit its verdict."""
        return f"{self.name} {' | '.join(self.change)}"

    @property
    def final(self) -> str:
        """The report's verdict: mutmut's, corrected by the ledger and the re-check."""
        if self.status not in RECHECKED:
            return self.status
        if self.recheck in ("killed", "timeout"):
            return "killed"  # a failing test, or a suite that hangs even with minutes to spare
        if self.status == "no tests" and self.recheck is None:
            return "no tests"  # and no test the suite gained since covers it either
        if self.recheck is None and self.status == "timeout":
            return "timeout"  # mutmut's wall-clock limit, not re-checked: no verdict yet
        return "equivalent" if self.equivalent else "survived"


def load_results(work: Path, targets: Sequence[Target]) -> list[Mutant]:
    mutants: list[Mutant] = []
    root = work / "mutants"
    for target in targets:
        meta = root / f"{target.path}.meta"
        if not meta.is_file():
            raise CampaignError(
                f"{meta}: no mutmut results for {target.name}; run the campaign first"
            )
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        for name, code in sorted(codes.items()):
            if any(fnmatch.fnmatch(name, g) for g in target.mutants):
                mutants.append(Mutant(name, target.name, status_of(code)))
    return mutants


# Prints ``mutmut show``'s diff for every mutant name read from stdin, in one process (one
# ``mutmut show`` per survivor costs an interpreter start each: minutes for a whole campaign).
_SHOW_MANY = """
import json, sys
from mutmut.mutation.diff_apply import get_diff_for_mutant
print(json.dumps({n: get_diff_for_mutant(n) for n in sys.stdin.read().split()}))
"""


def _changed_lines(diff: str) -> tuple[str, ...]:
    return tuple(
        line[0] + line[1:].strip()
        for line in diff.splitlines()
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    )


def mutant_changes(work: Path, names: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """The lines each mutation changed (its diff against the original, as ``mutmut show``)."""
    if not names:
        return {}
    proc = subprocess.run(
        [sys.executable, "-c", _SHOW_MANY],
        cwd=work,
        input="\n".join(names),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise CampaignError(f"reading the mutants' diffs in {work}: {proc.stderr.strip()[-500:]}")
    return {name: _changed_lines(diff) for name, diff in json.loads(proc.stdout).items()}
