"""What a run executed of vLLM's own scheduler code: line and branch coverage, per file and per
function, of the modules a runtime that subclasses vLLM's scheduler can break (``TARGETS``).

A run (the gate's suite, or the release's own ``tests/v1/core``) is measured by starting its
pytest under coverage.py (``launcher``) with a configuration that follows every child process
(xdist workers, an oracle process), then combining the data (``measure``). ``compare`` sets two
measurements side by side and names the functions only one of them reaches; the gate's run
also measures the subject's own package (``reach_subject``). The command is
``omni-conformance reach``; the report's fields: docs/design.md, "Reach".
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conformance.release import reach_areas

# vLLM's scheduler, its KV-cache management and the request object, relative to the installed
# ``vllm`` package: what a scheduler subclass inherits and can break. A folder means every
# module in it.
TARGETS = (
    "v1/core/sched/",
    "v1/core/kv_cache_manager.py",
    "v1/core/block_pool.py",
    "v1/core/single_type_kv_cache_manager.py",
    "v1/core/kv_cache_coordinator.py",
    "v1/core/encoder_cache_manager.py",
    "v1/request.py",
)
REPORT_SCHEMA = "omni-conformance-reach/1"
# coverage.py's name for a module's top-level code, which import alone executes.
MODULE_LEVEL = ""


def vllm_root() -> Path:
    import vllm

    return Path(vllm.__file__).resolve().parent


def target_files(root: Path | None = None) -> list[Path]:
    """The installed release's files named by ``TARGETS`` (a target it lacks is skipped)."""
    root = root or vllm_root()
    found: list[Path] = []
    for target in TARGETS:
        path = root / target
        if target.endswith("/"):
            found += sorted(p for p in path.rglob("*.py") if "__pycache__" not in p.parts)
        elif path.is_file():
            found.append(path)
    return found


def write_config(folder: Path, files: Sequence[Path]) -> Path:
    """A coverage.py configuration measuring ``files`` with branches, in this process and in
    every Python process it starts (``patch = subprocess``), each writing its own data file
    under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    include = "".join(f"\n    {p}" for p in files)
    rc = folder / "coveragerc"
    rc.write_text(
        "[run]\n"
        "branch = True\n"
        "parallel = True\n"
        "patch = subprocess\n"
        f"data_file = {folder / '.coverage'}\n"
        f"include ={include}\n"
    )
    return rc


def launcher(rc: Path) -> list[str]:
    """What replaces ``python -m`` in front of ``pytest`` to run it measured."""
    return [sys.executable, "-m", "coverage", "run", "--rcfile", str(rc), "-m"]


@dataclass(frozen=True)
class Figures:
    """Covered and total statements and branches of a file or a function."""

    lines: int
    statements: int
    branches: int
    branch_total: int

    @classmethod
    def of(cls, summary: Mapping[str, Any]) -> Figures:
        return cls(
            int(summary["covered_lines"]),
            int(summary["num_statements"]),
            int(summary.get("covered_branches", 0)),
            int(summary.get("num_branches", 0)),
        )

    def to_dict(self) -> dict[str, int]:
        return {
            "lines": self.lines,
            "statements": self.statements,
            "branches": self.branches,
            "branch_total": self.branch_total,
        }


def combined(rc: Path, files: Sequence[Path]) -> dict[str, Any]:
    """Combine the data a measured run left beside ``rc`` once, and return coverage.py's JSON
    entry of each of ``files`` keyed by its resolved path (every file named, so one no process
    imported is there with nothing covered; one coverage.py cannot read is left out)."""
    import coverage

    cov = coverage.Coverage(config_file=str(rc))
    cov.combine(strict=False)
    out = rc.parent / "coverage.json"
    cov.json_report(morfs=[str(p) for p in files], outfile=str(out), ignore_errors=True)
    data = json.loads(out.read_text())["files"]
    return {str(Path(name).resolve()): entry for name, entry in data.items()}


def measure(
    rc: Path, root: Path | None = None, entries: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``{file relative to vllm: {"total": figures, "functions": {qualified name: figures}}}``
    for every target file, reached or not, from the data a measured run left beside ``rc``
    (or from ``entries``, ``combined``'s result, when the run measured more than the targets)."""
    root = root or vllm_root()
    files = target_files(root)
    by_path = entries if entries is not None else combined(rc, files)
    measured: dict[str, Any] = {}
    for path in files:
        rel = path.relative_to(root).as_posix()
        entry = by_path[str(path)]
        functions = {
            name: Figures.of(f["summary"]).to_dict()
            for name, f in entry["functions"].items()
            if name != MODULE_LEVEL
        }
        measured[rel] = {
            "total": Figures.of(entry["summary"]).to_dict(),
            "functions": functions,
            "areas": reach_areas.file_areas(path, entry),
        }
    return measured


def totals(files: Mapping[str, Any]) -> dict[str, int]:
    keys = ("lines", "statements", "branches", "branch_total")
    return {k: sum(int(f["total"][k]) for f in files.values()) for k in keys}


def area_totals(files: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """Covered and total branches per scheduler area over every measured file."""
    out: dict[str, dict[str, int]] = {}
    for entry in files.values():
        for area, figures in entry.get("areas", {}).items():
            into = out.setdefault(area, {"branches": 0, "branch_total": 0})
            into["branches"] += int(figures["branches"])
            into["branch_total"] += int(figures["branch_total"])
    return {a: out[a] for a in reach_areas.ORDER if a in out}


def compare(sides: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """For two measured sides, the functions that only one of them reaches (a covered line),
    per file, keyed by the side that reaches them."""
    if len(sides) != 2:
        return {}
    (a, fa), (b, fb) = sides.items()
    only: dict[str, dict[str, list[str]]] = {a: {}, b: {}}
    for rel in sorted(set(fa) | set(fb)):
        funcs_a = fa.get(rel, {}).get("functions", {})
        funcs_b = fb.get(rel, {}).get("functions", {})
        for name in sorted(set(funcs_a) | set(funcs_b)):
            hit_a = funcs_a.get(name, {}).get("lines", 0) > 0
            hit_b = funcs_b.get(name, {}).get("lines", 0) > 0
            if hit_a != hit_b:
                only[a if hit_a else b].setdefault(rel, []).append(name)
    return only


def build_report(
    sides: Mapping[str, Mapping[str, Any]],
    environment: Mapping[str, Any],
    subject: Mapping[str, Any],
) -> dict[str, Any]:
    """The ``reach.json`` document: each side's files and totals, what only one reaches, and
    the subject's own package by area (``conformance.release.reach_subject.section``)."""
    return {
        "schema": REPORT_SCHEMA,
        "environment": dict(environment),
        "targets": list(TARGETS),
        "sides": {
            name: {"totals": totals(files), "areas": area_totals(files), "files": dict(files)}
            for name, files in sides.items()
        },
        "parts": {area: reach_areas.PART.get(area, 2) for area in reach_areas.ORDER},
        "only": compare(sides),
        "subject": dict(subject),
    }


def report_section(files: Mapping[str, Any]) -> dict[str, Any]:
    """What ``check --reach`` adds to the compat report: per-file and total figures of one run
    (the per-function detail stays in ``reach``'s own report)."""
    return {
        "targets": list(TARGETS),
        "totals": totals(files),
        "files": {rel: dict(entry["total"]) for rel, entry in files.items()},
    }
