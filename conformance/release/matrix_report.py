"""The merged upstream-compat report of a vLLM-version × subject matrix, and ``omni-conformance merge``.

``omni-conformance matrix`` (``conformance.release.matrix``) leaves one folder per (subject, vLLM version)
cell, ``cells/<subject>--vllm-<version>/``, holding a ``cell.json`` (schema
``omni-conformance-matrix-cell/1``) and, when the suite ran, the check's compat report. This module
owns everything after that:

* ``load_cells(paths)`` finds the ``cell.json`` files under matrix output folders, ``cells/``
  folders or single cell folders (also cells copied from several machines into one folder), checks
  each one field by field (``CellError`` names the file and the field), reads the cell's compat
  report, resolves duplicates of one (subject, vLLM) cell by the newest ``finished_at``, and notes
  cell folders that have no ``cell.json`` yet (an interrupted or still running matrix);
* ``build_matrix_report(cells, out_dir=...)`` turns them into the merged report, a JSON document
  (schema ``conformance/schemas/matrix-report.schema.json``, id
  ``omni-conformance-matrix-report/1``) with per-cell results, an overall summary and rollups per
  subject and per vLLM version. Paths in it are relative to the folder the report is written to,
  so the report still makes sense when that folder is copied elsewhere with the cells;
* ``write_matrix_report(report, out_dir)`` writes ``matrix-report.json`` and its renderings:
  Markdown (a CI job summary), JUnit XML (one suite per cell) and one self-contained HTML page;
* ``cmd_merge`` / ``add_merge_parser``: the ``merge`` command of ``conformance.cli``.

Outcomes stay honest, as in the per-run report: a cell that says ``pass`` without a readable
compat report is shown as ``incomplete``, a failing test that cites no clause still appears as a
JUnit failure, and cell folders without a ``cell.json`` make the merged matrix ``incomplete``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import html
import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape as _xml_escape

SCHEMA_ID = "omni-conformance-matrix-report/1"
SCHEMA_PATH = Path(__file__).parents[1] / "schemas" / "matrix-report.schema.json"
CELL_SCHEMA_ID = "omni-conformance-matrix-cell/1"
CELL_FILE = "cell.json"
DEFAULT_OUT = "matrix-report"
FILES = {
    "json": "matrix-report.json",
    "markdown": "matrix-report.md",
    "junit": "matrix-report.junit.xml",
    "html": "matrix-report.html",
}

CELL_STATUSES = ("pass", "fail", "not_applicable", "incomplete", "error", "unsupported")
# A (subject, version) slot of the grid can also be a cell folder whose cell.json is not written
# yet, or no cell at all (a subject not run on that version).
PENDING = "pending"
# Worst first: a group's status is the first of these any of its cells has.
_SEVERITY = ("fail", "error", "incomplete", PENDING, "pass", "not_applicable", "unsupported")
# Statuses the merge exits 0 on.
_OK = frozenset({"pass", "not_applicable", "unsupported"})

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INPUT = 2

_CELL_DIR = re.compile(r"^(?P<subject>.+)--vllm-(?P<vllm>[^/\\]+)$")


# ---- version order --------------------------------------------------------------------------

_VERSION = re.compile(
    r"^v?(?P<release>\d+(?:\.\d+)*)(?:[.\-_]?(?P<tag>dev|a|alpha|b|beta|rc|post)[.\-_]?(?P<n>\d*))?(?P<rest>.*)$",
    re.IGNORECASE,
)
_TAG_RANK = {"dev": -4, "a": -3, "alpha": -3, "b": -2, "beta": -2, "rc": -1, "post": 1}


def version_key(version: str) -> tuple[Any, ...]:
    """Sort key for vLLM versions: numeric per component (0.9 < 0.10 < 0.10.1), pre-releases before
    their release (0.33.0rc1 < 0.33.0); anything that is not a version (a branch name) sorts last,
    by name. Own parsing, so the merge needs nothing beyond the standard library."""
    m = _VERSION.match(version.strip())
    if m is None:
        return (1, (), 0, 0, version)
    release = [int(x) for x in m["release"].split(".")]
    while len(release) > 1 and release[-1] == 0:  # 0.30 and 0.30.0 are one version
        release.pop()
    tag = (m["tag"] or "").lower()
    return (0, tuple(release), _TAG_RANK.get(tag, 0), int(m["n"] or 0), m["rest"])


def sort_versions(versions: Iterable[str]) -> list[str]:
    return sorted(set(versions), key=version_key)


def _subject_key(subject: str) -> tuple[int, str]:
    # upstream checked against itself is the matrix's baseline: its row comes first.
    return (0 if subject == "upstream" else 1, subject)


# ---- loading cells --------------------------------------------------------------------------


class CellError(ValueError):
    """A ``cell.json`` (or an input path) the merge cannot use; the message is one line naming the
    file and, when one is at fault, the field."""

    def __init__(self, path: Path | str, problem: str, field: str | None = None) -> None:
        self.path = str(path)
        self.field = field
        self.problem = problem
        where = f"{self.path}: field {field!r}: " if field else f"{self.path}: "
        super().__init__(where + problem)


@dataclass
class Cell:
    """One finished cell: its folder, its checked ``cell.json`` and its compat report if readable."""

    path: Path  # the cell folder, absolute
    data: dict[str, Any]
    report: dict[str, Any] | None = None
    # Why the compat report the cell names could not be used (missing file, not JSON...).
    report_problem: str | None = None

    @property
    def subject(self) -> str:
        return str(self.data["subject"])

    @property
    def vllm(self) -> str:
        return str(self.data["vllm"])

    @property
    def key(self) -> tuple[str, str]:
        return (self.subject, self.vllm)

    @property
    def finished_at(self) -> _dt.datetime | None:
        return _parse_time(self.data.get("finished_at"))


@dataclass
class Unfinished:
    """A cell folder with no ``cell.json`` yet: the matrix was interrupted or is still running."""

    path: Path
    subject: str
    vllm: str


@dataclass
class CellSet:
    """What ``load_cells`` found: the cells the report uses (one per (subject, vLLM) pair), the
    duplicates they won over (winner, losers), and unfinished cell folders."""

    cells: list[Cell]
    duplicates: list[tuple[Cell, list[Cell]]] = field(default_factory=list)
    unfinished: list[Unfinished] = field(default_factory=list)
    sources: list[Path] = field(default_factory=list)


def _parse_time(value: Any) -> _dt.datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        t = _dt.datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    # Naive timestamps are taken as UTC, so cells from machines that wrote either form compare.
    return t if t.tzinfo is not None else t.replace(tzinfo=_dt.UTC)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def check_cell(data: Any, path: Path | str) -> dict[str, Any]:
    """``data`` (a parsed ``cell.json``) with optional fields defaulted; ``CellError`` naming the
    field when one is missing or has the wrong type."""
    if not isinstance(data, dict):
        raise CellError(path, f"not a JSON object but {type(data).__name__}")

    def bad(name: str, problem: str) -> CellError:
        return CellError(path, problem, name)

    if "schema" not in data:
        raise bad("schema", f"missing (expected {CELL_SCHEMA_ID!r})")
    if data["schema"] != CELL_SCHEMA_ID:
        raise bad("schema", f"{data['schema']!r} is not {CELL_SCHEMA_ID!r}")
    for name in ("subject", "vllm"):
        if name not in data:
            raise bad(name, "missing")
        if not isinstance(data[name], str) or not data[name].strip():
            raise bad(name, f"must be a non-empty string, got {data[name]!r}")
    if "status" not in data:
        raise bad("status", "missing")
    if data["status"] not in CELL_STATUSES:
        raise bad("status", f"{data['status']!r} is not one of {', '.join(CELL_STATUSES)}")

    out = dict(data)
    optional_str = ("started_at", "finished_at", "error", "log", "report")
    for name in optional_str:
        value = out.setdefault(name, None)
        if value is not None and not isinstance(value, str):
            raise bad(name, f"must be a string or null, got {value!r}")
    for name in ("started_at", "finished_at"):
        if out[name] is not None and _parse_time(out[name]) is None:
            raise bad(name, f"{out[name]!r} is not an ISO 8601 time")
    if not _str_list(out.setdefault("extras", [])):
        raise bad("extras", "must be a list of strings")
    env = out.setdefault("environment", {})
    if not isinstance(env, dict):
        raise bad("environment", f"must be an object, got {env!r}")
    out["environment"] = {str(k): str(v) for k, v in env.items()}
    if not isinstance(out.setdefault("untested_vllm", False), bool):
        raise bad("untested_vllm", f"must be true or false, got {out['untested_vllm']!r}")
    if out.setdefault("exit_code", None) is not None and not _is_int(out["exit_code"]):
        raise bad("exit_code", f"must be an integer or null, got {out['exit_code']!r}")
    duration = out.setdefault("duration_s", None)
    if duration is not None and (not _is_number(duration) or duration < 0):
        raise bad("duration_s", f"must be a number >= 0 or null, got {duration!r}")
    out["upstream_tests"] = _check_upstream_tests(out.get("upstream_tests"), bad)
    return out


def _check_upstream_tests(value: Any, bad: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad("upstream_tests", f"must be an object or null, got {value!r}")
    out = dict(value)
    for name in ("passed", "failed", "skipped", "errors", "total"):
        v = out.setdefault(name, 0)
        if not _is_int(v) or v < 0:
            raise bad(f"upstream_tests.{name}", f"must be an integer >= 0, got {v!r}")
    for name in ("failing", "baseline_failing"):
        if not _str_list(out.setdefault(name, [])):
            raise bad(f"upstream_tests.{name}", "must be a list of strings")
    d = out.setdefault("duration_s", None)
    if d is not None and (not _is_number(d) or d < 0):
        raise bad("upstream_tests.duration_s", f"must be a number >= 0 or null, got {d!r}")
    return out


def _read_cell(cell_json: Path) -> Cell:
    try:
        text = cell_json.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CellError(cell_json, f"cannot be read: {exc}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CellError(
            cell_json, f"not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None
    data = check_cell(raw, cell_json)
    cell = Cell(path=cell_json.parent.resolve(), data=data)
    if data["report"]:
        report_path = cell.path / data["report"]
        try:
            report = json.loads(report_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            cell.report_problem = f"its compat report {data['report']} is missing"
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            detail = " ".join(str(exc).split())
            cell.report_problem = f"its compat report {data['report']} is unreadable: {detail}"
        else:
            if isinstance(report, dict) and isinstance(report.get("summary"), dict):
                cell.report = report
            else:
                cell.report_problem = f"its compat report {data['report']} is not a compat report"
    return cell


# Folders never holding cells, and big ones (virtual environments the matrix builds) not worth
# walking.
_SKIP_DIRS = frozenset({"site-packages", "node_modules", "__pycache__"})


def _walk(top: Path) -> tuple[list[Path], list[Unfinished]]:
    found: list[Path] = []
    candidates: list[Path] = []  # folders named like a cell, without a cell.json
    for root, dirs, files in os.walk(top):
        here = Path(root)
        if CELL_FILE in files:
            found.append(here / CELL_FILE)
            dirs[:] = []  # a cell folder holds no further cells
            continue
        if "pyvenv.cfg" in files:
            dirs[:] = []
            continue
        if _CELL_DIR.match(here.name):
            candidates.append(here)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIP_DIRS)
    # A folder named like a cell may only wrap one (a CI artifact named after its cell holds the
    # cell folder): it is unfinished only when no cell, and no deeper cell-named folder, is in it.
    inner = [*(f.parent for f in found), *candidates]
    unfinished = []
    for c in candidates:
        if any(c in p.parents for p in inner):
            continue
        m = _CELL_DIR.match(c.name)
        assert m is not None
        unfinished.append(Unfinished(c.resolve(), m["subject"], m["vllm"]))
    return found, unfinished


def load_cells(paths: Iterable[str | Path]) -> CellSet:
    """The cells under ``paths`` (matrix output folders, ``cells/`` folders, cell folders or
    ``cell.json`` files), one per (subject, vLLM version): of several copies of one cell (say,
    from several machines) the one with the newest ``finished_at`` wins (on a tie, or without
    times, the one found last). ``CellError`` when a path does not exist, a ``cell.json`` is
    malformed, or no ``cell.json`` was found at all."""
    sources = [Path(p) for p in paths]
    if not sources:
        raise CellError("merge", "no input path given")
    cell_files: list[Path] = []
    unfinished: list[Unfinished] = []
    for src in sources:
        if src.is_file() and src.name == CELL_FILE:
            cell_files.append(src)
        elif src.is_dir():
            found, pending = _walk(src)
            cell_files += found
            unfinished += pending
        elif src.exists():
            raise CellError(src, f"neither a folder nor a {CELL_FILE}")
        else:
            raise CellError(src, "no such file or folder")
    seen: set[Path] = set()
    cells: list[Cell] = []
    for f in cell_files:
        real = f.resolve()
        if real in seen:  # one file reached through two overlapping input paths
            continue
        seen.add(real)
        cells.append(_read_cell(f))
    if not cells:
        where = ", ".join(str(s) for s in sources)
        more = f" ({len(unfinished)} cell folder(s) without one yet)" if unfinished else ""
        raise CellError(where, f"no {CELL_FILE} found{more}")
    result = resolve_duplicates(cells)
    done = {c.key for c in cells}
    uniq: dict[Path, Unfinished] = {}
    for u in unfinished:
        if (u.subject, u.vllm) not in done:  # finished elsewhere (another machine's copy)
            uniq.setdefault(u.path, u)
    result.unfinished = list(uniq.values())
    result.sources = sources
    return result


def resolve_duplicates(cells: Iterable[Cell]) -> CellSet:
    """One cell per (subject, vLLM version): the newest ``finished_at``, later ones on a tie."""
    floor = _dt.datetime.min.replace(tzinfo=_dt.UTC)
    groups: dict[tuple[str, str], list[Cell]] = {}
    for c in cells:
        groups.setdefault(c.key, []).append(c)
    chosen: list[Cell] = []
    duplicates: list[tuple[Cell, list[Cell]]] = []
    for group in groups.values():
        # max() keeps the first of equal keys; scanning in reverse makes the last found win.
        winner = max(reversed(group), key=lambda c: c.finished_at or floor)
        chosen.append(winner)
        if len(group) > 1:
            duplicates.append((winner, [c for c in group if c is not winner]))
    return CellSet(cells=chosen, duplicates=duplicates)


# ---- building the report --------------------------------------------------------------------


def _rel(path: Path, base: Path) -> str:
    """``path`` relative to ``base`` (POSIX separators), absolute only when no relative path
    exists (another drive)."""
    try:
        return Path(os.path.relpath(path, base)).as_posix()
    except ValueError:
        return path.as_posix()


def _locate_trace(recorded: str, cell_dir: Path) -> Path | None:
    """The trace file a compat report names, looked for next to the cell: as recorded (absolute,
    or relative to the cell folder where the check ran), by what follows the cell folder's name in
    a path recorded on another machine, or by its name one level below the cell folder."""
    p = Path(recorded)
    candidates = [p if p.is_absolute() else cell_dir / p]
    if cell_dir.name in p.parts:
        parts = p.parts
        i = len(parts) - 1 - parts[::-1].index(cell_dir.name)
        if parts[i + 1 :]:
            candidates.append(cell_dir.joinpath(*parts[i + 1 :]))
    candidates.append(cell_dir / p.name)
    try:
        candidates += [d / p.name for d in sorted(cell_dir.iterdir()) if d.is_dir()]
    except OSError:
        pass
    for c in candidates:
        if c.is_file():
            return c
    return None


def _counts(summary: Mapping[str, Any]) -> dict[str, int]:
    names = ("tests", "ran", "passed", "failed", "error", "not_applicable", "not_run", "violations")
    return {n: int(summary.get(n) or 0) for n in names}


_CLAUSE_STATUSES = frozenset({"pass", "fail", "not_applicable", "not_run"})


def _clause_entries(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    failures = report.get("failures") or []
    na = report.get("not_applicable") or []
    not_run = report.get("not_run") or []
    out = []

    def cites(entry: Mapping[str, Any], cid: str) -> bool:
        return cid in (entry.get("clauses") or ())

    for c in report.get("clauses") or []:
        cid = str(c.get("id"))
        status = str(c.get("status") or "not_run")
        detail: str | None = None
        if status not in _CLAUSE_STATUSES:
            status, detail = "not_run", f"clause status {status!r} unknown to this merge"
        if status == "fail":
            msgs = [str(f.get("message") or "violation") for f in failures if cites(f, cid)]
            detail = "\n".join(dict.fromkeys(msgs)) or "violation"
        elif status == "not_applicable":
            detail = "; ".join(dict.fromkeys(str(n.get("reason")) for n in na if cites(n, cid)))
            detail = detail or "not applicable"
        elif status == "not_run" and detail is None:
            why = [str(n.get("reason")) for n in not_run if cites(n, cid)]
            detail = "; ".join(dict.fromkeys(why)) or None  # None: no test covered it
        out.append(
            {
                "id": cid,
                "invariant": str(c.get("invariant") or "unknown"),
                "status": status,
                "detail": detail,
            }
        )
    return out


_DIFF_KEYS = ("step", "op", "path", "upstream", "subject")


def _difference(value: Any) -> dict[str, Any] | None:
    if isinstance(value, dict) and all(k in value for k in _DIFF_KEYS):
        return value
    return None


def _digest(report: Mapping[str, Any], cell_dir: Path, base: Path) -> dict[str, Any]:
    """What the merged report keeps of a cell's compat report; raises ``KeyError`` /
    ``TypeError`` / ``AttributeError`` / ``ValueError`` on a report it cannot read."""
    failures = []
    for f in report.get("failures") or []:
        trace = f.get("trace")
        found = _locate_trace(str(trace), cell_dir) if trace else None
        failures.append(
            {
                "test": str(f.get("test")),
                "clauses": [str(c) for c in f.get("clauses") or []],
                "message": str(f.get("message") or ""),
                "first_difference": _difference(f.get("first_difference")),
                "trace": _rel(found, base) if found else (str(trace) if trace else None),
                "trace_found": found is not None,
            }
        )
    return {
        "counts": _counts(report["summary"]),
        "clauses": _clause_entries(report),
        "failures": failures,
        "not_run": [
            {"test": str(n.get("test")), "reason": str(n.get("reason"))}
            for n in report.get("not_run") or []
        ],
    }


def _cell_entry(cell: Cell, base: Path) -> dict[str, Any]:
    d = cell.data
    notes: list[str] = []
    status = d["status"]
    report = cell.report
    digest: dict[str, Any] = {"counts": None, "clauses": [], "failures": [], "not_run": []}
    if report is not None:
        try:
            digest = _digest(report, cell.path, base)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            notes.append(
                f"its compat report {d['report']} is not one this merge can read "
                f"({type(exc).__name__}: {exc})"
            )
            report = None
    if cell.report_problem:
        notes.append(cell.report_problem)
    if report is None and status in ("pass", "fail", "not_applicable", "incomplete"):
        if not d["report"]:
            notes.append("it names no compat report")
        if status in ("pass", "not_applicable"):
            # A pass nobody can look at is not shown as one.
            notes.append(f"shown as incomplete: the cell says {status} but its results are missing")
            status = "incomplete"
    if isinstance(d.get("upstream_tests_error"), str):
        notes.append(f"upstream tests did not run: {d['upstream_tests_error']}")
    installed = d["environment"].get("vllm")
    if installed and installed != d["vllm"]:
        notes.append(f"vLLM {installed} was installed, not the requested {d['vllm']}")
    if report is not None and report.get("status") not in (None, d["status"]):
        if not (d["status"] == "error" or report.get("status") == "not_run"):
            notes.append(f"its compat report says {report.get('status')}")

    upstream = d["upstream_tests"]
    if upstream is not None:
        baseline = set(upstream["baseline_failing"])
        upstream = {
            **upstream,
            "new_failing": [t for t in upstream["failing"] if t not in baseline],
        }

    def rel_in_cell(name: str | None) -> str | None:
        return _rel(cell.path / name, base) if name else None

    return {
        "id": cell.path.name,
        "subject": cell.subject,
        "vllm": cell.vllm,
        "status": status,
        "untested_vllm": d["untested_vllm"],
        "extras": list(d["extras"]),
        "environment": d["environment"],
        "exit_code": d["exit_code"],
        "duration_s": d["duration_s"],
        "started_at": d["started_at"],
        "finished_at": d["finished_at"],
        "error": d["error"],
        "path": _rel(cell.path, base),
        "log": rel_in_cell(d["log"]),
        "report": rel_in_cell(d["report"]) if report is not None else None,
        "report_status": str(report.get("status")) if report is not None else None,
        **digest,
        "upstream_tests": upstream,
        "notes": notes,
    }


def _worst(statuses: Iterable[str]) -> str:
    seen = set(statuses)
    for s in _SEVERITY:
        if s in seen:
            return s
    return "unsupported"


def _rollup(entries: list[dict[str, Any]], pending: int) -> dict[str, Any]:
    by: dict[str, int] = {s: 0 for s in (*CELL_STATUSES, PENDING)}
    for e in entries:
        by[e["status"]] += 1
    by[PENDING] = pending
    statuses = [e["status"] for e in entries] + ([PENDING] * bool(pending))
    status = _worst(statuses)
    return {
        "status": "incomplete" if status == PENDING else status,
        "cells": by,
        "untested": sum(1 for e in entries if e["untested_vllm"]),
    }


class MatrixReport(dict[str, Any]):
    """The report's JSON object, remembering the folder its relative paths start from (``base``),
    so ``write_matrix_report`` can re-anchor them when it writes somewhere else."""

    base: Path | None = None


def rebase(report: Mapping[str, Any], old: str | Path, new: str | Path) -> MatrixReport:
    """A copy of ``report`` whose relative paths, anchored at folder ``old``, start from ``new``.
    Absolute paths and traces that were not found with their cell (recorded paths) are kept."""
    old_dir, new_dir = Path(old).resolve(), Path(new).resolve()

    def move(p: str | None) -> str | None:
        if p is None or Path(p).is_absolute():
            return p
        return _rel(Path(os.path.normpath(old_dir / p)), new_dir)

    out = MatrixReport(json.loads(json.dumps(report, default=str)))
    out.base = new_dir
    for c in out["cells"]:
        c["path"] = move(c["path"])
        c["log"] = move(c["log"])
        c["report"] = move(c["report"])
        for f in c["failures"]:
            if f["trace_found"]:
                f["trace"] = move(f["trace"])
    for u in out["unfinished"]:
        u["path"] = move(u["path"])
    for d in out["duplicates"]:
        for ref in (d["used"], *d["superseded"]):
            ref["path"] = move(ref["path"])
    out["sources"] = [move(p) for p in out["sources"]]
    return out


def build_matrix_report(
    cells: CellSet | Iterable[Cell],
    *,
    out_dir: str | Path | None = None,
    release_changes: Sequence[Mapping[str, Any]] | None = None,
) -> MatrixReport:
    """The merged matrix report (schema ``omni-conformance-matrix-report/1``).

    ``cells`` is what ``load_cells`` returned (or plain cells, whose duplicates are resolved
    here). Paths in the report are relative to ``out_dir``, the folder the report will be written
    to (default: the current folder); pass the same folder to ``write_matrix_report``.
    ``release_changes`` fills the optional "upstream changes between releases" section.
    (``write_matrix_report`` re-anchors the paths when it writes to another folder.)
    """
    cs = cells if isinstance(cells, CellSet) else resolve_duplicates(cells)
    base = Path(out_dir if out_dir is not None else ".").resolve()
    entries = [_cell_entry(c, base) for c in cs.cells]
    entries.sort(key=lambda e: (_subject_key(e["subject"]), version_key(e["vllm"])))
    unfinished = sorted(
        (
            {"id": u.path.name, "subject": u.subject, "vllm": u.vllm, "path": _rel(u.path, base)}
            for u in cs.unfinished
        ),
        key=lambda u: (_subject_key(u["subject"]), version_key(u["vllm"])),
    )
    subjects = sorted(
        {e["subject"] for e in entries} | {u["subject"] for u in unfinished}, key=_subject_key
    )
    versions = sort_versions([e["vllm"] for e in entries] + [u["vllm"] for u in unfinished])

    overall = _rollup(entries, len(unfinished))
    by_subject = []
    for s in subjects:
        mine = [e for e in entries if e["subject"] == s]
        waiting = [u for u in unfinished if u["subject"] == s]
        by_subject.append(
            {
                "subject": s,
                **_rollup(mine, len(waiting)),
                "versions": sort_versions(e["vllm"] for e in mine + waiting),
            }
        )
    by_version = []
    for v in versions:
        mine = [e for e in entries if e["vllm"] == v]
        waiting = [u for u in unfinished if u["vllm"] == v]
        by_version.append(
            {
                "vllm": v,
                **_rollup(mine, len(waiting)),
                "subjects": sorted({e["subject"] for e in mine + waiting}, key=_subject_key),
            }
        )

    tests = {n: 0 for n in ("passed", "failed", "error", "not_applicable", "not_run")}
    for e in entries:
        for n in tests:
            tests[n] += (e["counts"] or {}).get(n, 0)
    upstream_total: dict[str, int] | None = None
    for e in entries:
        u = e["upstream_tests"]
        if u is None:
            continue
        upstream_total = upstream_total or dict.fromkeys(
            ("passed", "failed", "skipped", "errors", "total", "new_failing"), 0
        )
        for n in ("passed", "failed", "skipped", "errors", "total"):
            upstream_total[n] += u[n]
        upstream_total["new_failing"] += len(u["new_failing"])

    def brief(c: Cell) -> dict[str, Any]:
        return {
            "path": _rel(c.path, base),
            "finished_at": c.data["finished_at"],
            "status": c.data["status"],
        }

    ordered = sorted(
        cs.duplicates, key=lambda d: (_subject_key(d[0].subject), version_key(d[0].vllm))
    )
    duplicates: list[dict[str, Any]] = [
        {
            "subject": winner.subject,
            "vllm": winner.vllm,
            "rule": "newest finished_at",
            "used": brief(winner),
            "superseded": [brief(c) for c in losers],
        }
        for winner, losers in ordered
    ]

    report = MatrixReport(
        schema=SCHEMA_ID,
        generated_at=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        status=overall["status"],
        ok=overall["status"] in _OK,
        subjects=subjects,
        versions=versions,
        summary={
            "cells": len(entries),
            "by_status": overall["cells"],
            "untested": overall["untested"],
            "unfinished": len(unfinished),
            "duplicates": len(duplicates),
            "duration_s": round(sum(e["duration_s"] or 0.0 for e in entries), 3),
            "tests": tests,
            "upstream_tests": upstream_total,
        },
        by_subject=by_subject,
        by_version=by_version,
        cells=entries,
        unfinished=unfinished,
        duplicates=duplicates,
        sources=[_rel(p.resolve(), base) for p in cs.sources],
        release_changes=[dict(r) for r in release_changes or ()],
    )
    report.base = base
    return report


def exit_code(report: Mapping[str, Any]) -> int:
    """0 when every cell passed or is not applicable / unsupported, else 1."""
    return EXIT_OK if report["status"] in _OK else EXIT_FAILED


# ---- shared text helpers --------------------------------------------------------------------

_ICON = {
    "pass": "✅",
    "fail": "❌",
    "not_applicable": "➖",
    "error": "💥",
    "unsupported": "⛔",
    "incomplete": "⚠️",
    PENDING: "⏳",
}
_WORD = {
    "pass": "pass",
    "fail": "fail",
    "not_applicable": "n/a",
    "error": "error",
    "unsupported": "unsupported",
    "incomplete": "incomplete",
    PENDING: "pending",
}
_MEANING = {
    "pass": "every check that ran passed",
    "fail": "a violation: the first difference is below",
    "not_applicable": "no check applies to this subject",
    "error": "the cell could not run (see its error line)",
    "unsupported": "the subject does not support this vLLM version",
    "incomplete": "nothing failed, but a promised check could not run",
    PENDING: "the cell has not finished (no cell.json yet)",
}
UNTESTED_MARK = "🧪"
_UNTESTED_MEANING = "vLLM outside the harness's supported range, run by explicit opt-in"


def _short(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _cell_label(e: Mapping[str, Any] | None, pending: bool = False) -> str:
    if e is None:
        return f"{_ICON[PENDING]} pending" if pending else ""
    label = f"{_ICON[e['status']]} {_WORD[e['status']]}"
    c = e.get("counts")
    if c and e["status"] in ("pass", "fail", "incomplete"):
        label += f" {c['passed']}/{c['ran']}"
    if e["untested_vllm"]:
        label += f" {UNTESTED_MARK}"
    return label


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min"


def _grid(report: Mapping[str, Any]) -> list[tuple[str, list[tuple[dict[str, Any] | None, bool]]]]:
    """Rows of (subject, [(cell entry or None, pending?) per version])."""
    index = {(e["subject"], e["vllm"]): e for e in report["cells"]}
    waiting = {(u["subject"], u["vllm"]) for u in report["unfinished"]}
    return [
        (s, [(index.get((s, v)), (s, v) in waiting) for v in report["versions"]])
        for s in report["subjects"]
    ]


def _counts_sentence(report: Mapping[str, Any]) -> str:
    by = report["summary"]["by_status"]
    parts = [f"{by[s]} {_WORD[s]}" for s in (*CELL_STATUSES, PENDING) if by.get(s)]
    return ", ".join(parts) or "no cells"


def _title(report: Mapping[str, Any]) -> str:
    n_s, n_v = len(report["subjects"]), len(report["versions"])
    return (
        f"omni-conformance matrix: {report['status'].upper()} — {report['summary']['cells']} "
        f"cells, {n_s} subject{'s' * (n_s != 1)} × {n_v} vLLM version{'s' * (n_v != 1)}"
    )


def _failing(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [e for e in report["cells"] if e["status"] == "fail"]


def _change_text(change: Any) -> str:
    if isinstance(change, str):
        return change
    if isinstance(change, Mapping):
        for key in ("summary", "title", "description", "text"):
            if isinstance(change.get(key), str):
                return str(change[key])
    return json.dumps(change, default=str, sort_keys=True)


# ---- Markdown -------------------------------------------------------------------------------


def _md_line(text: Any) -> str:
    """One line, no column breaks: safe inside a Markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _md(text: Any) -> str:
    # GitHub renders (or strips) what looks like an HTML tag; "<cp311>" must stay visible.
    return _md_line(text).replace("<", "&lt;")


def _md_code(text: Any) -> str:
    # Entities are literal inside code, so no escaping beyond the table's; a backtick would end
    # the code span early and is shown as a lookalike.
    return "`" + _md_line(text).replace("`", "ʼ") + "`"


def render_markdown(report: Mapping[str, Any]) -> str:
    s = report["summary"]
    lines = [f"## {_title(report)}", "", _counts_sentence(report) + "."]
    t = s["tests"]
    lines += [
        "",
        f"Tests across cells: {t['passed']} passed, {t['failed']} failed, {t['error']} errors, "
        f"{t['not_applicable']} not applicable, {t['not_run']} could not run · "
        f"total time {_duration(s['duration_s'])}",
        "",
        "| subject | " + " | ".join(f"vLLM {v}" for v in report["versions"]) + " | overall |",
        "|---|" + "---|" * len(report["versions"]) + "---|",
    ]
    rollup = {r["subject"]: r for r in report["by_subject"]}
    for subject, row in _grid(report):
        cells = " | ".join(_md(_cell_label(e, p)) or "·" for e, p in row)
        r = rollup[subject]
        lines.append(
            f"| **{_md(subject)}** | {cells} | {_ICON[r['status']]} {_WORD[r['status']]} |"
        )
    per_version = " | ".join(
        f"{_ICON[v['status']]} {_WORD[v['status']]}" for v in report["by_version"]
    )
    lines.append(f"| *all subjects* | {per_version} | |")
    legend = " · ".join(f"{_ICON[k]} {_WORD[k]}: {_MEANING[k]}" for k in _MEANING)
    lines += [
        "",
        f"<sub>{legend} · {UNTESTED_MARK} {_UNTESTED_MEANING} · (·) no cell. "
        "Pass counts are passed/ran.</sub>",
    ]

    failing = _failing(report)
    if failing:
        lines += ["", "### Failing cells", ""]
        for e in failing:
            lines += _md_failure(e)
    incomplete = [e for e in report["cells"] if e["status"] == "incomplete"]
    if incomplete:
        lines += ["", "### Incomplete cells", ""]
        for e in incomplete:
            why = [f"`{_md(n['test'])}`: {_md(n['reason'])}" for n in e["not_run"][:3]]
            why += [_md(n) for n in e["notes"]]
            lines.append(
                f"- **{_md(e['subject'])}** on vLLM {_md(e['vllm'])}: "
                + ("; ".join(why) or "a promised check could not run")
            )
    errored = [e for e in report["cells"] if e["status"] in ("error", "unsupported")]
    if errored:
        lines += ["", "### Cells that did not run", "", "| subject | vLLM | status | why | log |"]
        lines.append("|---|---|---|---|---|")
        for e in errored:
            log = _md_code(e["log"]) if e["log"] else "—"
            lines.append(
                f"| {_md(e['subject'])} | {_md(e['vllm'])} | {_ICON[e['status']]} "
                f"{_WORD[e['status']]} | {_md(e['error'] or 'no error line recorded')} | {log} |"
            )
    lines += _md_upstream(report)
    lines += _md_notes(report)
    lines += _md_release_changes(report)
    lines += ["", f"<sub>generated {report['generated_at']}</sub>"]
    return "\n".join(lines) + "\n"


def _md_failure(e: Mapping[str, Any]) -> list[str]:
    n = len(e["failures"])
    head = f"#### ❌ {_md(e['subject'])} on vLLM {_md(e['vllm'])}"
    head += f" — {n} violation{'s' * (n != 1)}" if n else ""
    lines = [head, ""]
    if not e["failures"]:
        lines += [f"No failure details: {_md('; '.join(e['notes']) or 'no compat report')}", ""]
        return lines
    first = e["failures"][0]
    clauses = ", ".join(first["clauses"]) or "no clause"
    lines.append(f"First failure: `{_md(first['test'])}` ({clauses})")
    diff = first["first_difference"]
    if diff:
        lines += [
            "",
            "| step | op | field | upstream | subject |",
            "|---:|---|---|---|---|",
            f"| {_md(diff.get('step'))} | {_md(diff.get('op'))} | {_md_code(diff.get('path'))} | "
            f"{_md_code(_short(diff.get('upstream')))} | {_md_code(_short(diff.get('subject')))} |",
            "",
        ]
    else:
        lines += ["", f"> {_md(_short(first['message'], 200))}", ""]
    if first["trace"]:
        where = "" if first["trace_found"] else " (recorded path, not found with the cell)"
        lines.append(
            f"- trace: {_md_code(first['trace'])}{where} — replay it in that cell's environment "
            f"with `omni-conformance replay TRACE`"
        )
    for other in e["failures"][1:]:
        lines.append(f"- also `{_md(other['test'])}`: {_md(_short(other['message'], 160))}")
    oracle = str((e["environment"] or {}).get("oracle") or "in-process")
    if oracle != "in-process":
        lines.append(f"- oracle: {_md(_short(oracle, 200))}")
    if e["report"]:
        lines.append(f"- cell report: {_md_code(e['report'])}")
    lines.append("")
    return lines


def _md_upstream(report: Mapping[str, Any]) -> list[str]:
    rows = [e for e in report["cells"] if e["upstream_tests"] is not None]
    if not rows:
        return []
    lines = [
        "",
        "### Upstream tests",
        "",
        "vLLM's own tests run against the subject; *new failures* fail with the subject but not "
        "with upstream's own classes on that release.",
        "",
        "| subject | vLLM | passed | failed | skipped | errors | total | new failures | time |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for e in rows:
        u = e["upstream_tests"]
        new = u["new_failing"]
        shown = ", ".join(_md_code(t) for t in new[:3]) + (
            f" +{len(new) - 3} more" if len(new) > 3 else ""
        )
        lines.append(
            f"| {_md(e['subject'])} | {_md(e['vllm'])} | {u['passed']} | {u['failed']} | "
            f"{u['skipped']} | {u['errors']} | {u['total']} | {shown or '—'} | "
            f"{_duration(u['duration_s'])} |"
        )
    return lines


def _note_texts(
    report: Mapping[str, Any], text: Callable[[Any], str], code: Callable[[Any], str]
) -> list[str]:
    """The report's notes (duplicate cells, unfinished cells, per-cell notes), each rendered
    with ``text`` for plain values and ``code`` for paths: Markdown and HTML share them."""
    notes: list[str] = []
    for d in report["duplicates"]:
        others = ", ".join(
            f"{code(x['path'])} ({text(x['finished_at'] or 'no finish time')})"
            for x in d["superseded"]
        )
        notes.append(
            f"{text(d['subject'])} on vLLM {text(d['vllm'])} was found more than once: used "
            f"{code(d['used']['path'])} (finished {text(d['used']['finished_at'] or '?')}, the "
            f"newest), not {others}"
        )
    for u in report["unfinished"]:
        notes.append(
            f"{text(u['subject'])} on vLLM {text(u['vllm'])} has not finished: "
            f"{code(u['path'])} has no cell.json yet"
        )
    for e in report["cells"]:
        if e["status"] == "incomplete":
            continue  # already listed with the incomplete cells
        notes += [f"{text(e['subject'])} on vLLM {text(e['vllm'])}: {text(n)}" for n in e["notes"]]
    return notes


def _md_notes(report: Mapping[str, Any]) -> list[str]:
    notes = [f"- {n}" for n in _note_texts(report, _md, _md_code)]
    return ["", "### Notes", "", *notes] if notes else []


def _md_release_changes(report: Mapping[str, Any]) -> list[str]:
    items = report.get("release_changes") or []
    if not items:
        return []
    lines = ["", "### Upstream changes between releases", ""]
    for item in items:
        lines.append(f"- **vLLM {_md(item.get('from', '?'))} → {_md(item.get('to', '?'))}**")
        for change in item.get("changes") or []:
            lines.append(f"  - {_md(_change_text(change))}")
    return lines


# ---- JUnit XML ------------------------------------------------------------------------------


def _attr(text: Any) -> str:
    return _xml_escape(str(text), {'"': "&quot;", "\n": "&#10;"})


def _case(classname: str, name: str, body: str = "", time: float | None = None) -> str:
    t = f' time="{time:.3f}"' if time is not None else ""
    return f'    <testcase classname="{_attr(classname)}" name="{_attr(name)}"{t}>{body}</testcase>'


def _junit_suite(
    e: Mapping[str, Any] | None, pending: Mapping[str, Any] | None = None
) -> tuple[str, list[int]]:
    """One suite per cell: a case per clause of its compat report, or one case for a cell that
    did not run. Each failing clause is counted once, as one ``failure``."""
    src = e if e is not None else pending
    assert src is not None
    subject, vllm = src["subject"], src["vllm"]
    cls = f"omni_conformance[{subject}@vllm-{vllm}]"
    cases: list[str] = []
    failures = errors = skipped = 0
    status = e["status"] if e is not None else PENDING
    if e is None:
        skipped += 1
        msg = f"not finished: {src['path']} has no cell.json yet"
        cases.append(_case(cls, "cell", f'<skipped message="{_attr(msg)}"/>'))
    elif status in ("error", "unsupported") or not e["clauses"]:
        why = e["error"] or "; ".join(e["notes"]) or status
        if status == "unsupported":
            skipped += 1
            body = f'<skipped type="unsupported" message="{_attr("unsupported: " + why)}"/>'
        elif status in ("pass", "not_applicable"):
            body = ""
        elif status == "fail":
            failures += 1
            body = f'<failure message="{_attr(why)}">{_xml_escape(why)}</failure>'
        else:
            errors += 1
            body = (
                f'<error type="{_attr(status)}" message="{_attr(why)}">{_xml_escape(why)}</error>'
            )
        cases.append(_case(cls, "cell", body, e["duration_s"]))
    else:
        for c in e["clauses"]:
            body = ""
            detail = c["detail"]
            if c["status"] == "fail":
                failures += 1
                first = (detail or "violation").splitlines()[0]
                body = f'<failure message="{_attr(first)}">{_xml_escape(detail or "")}</failure>'
            elif c["status"] == "not_applicable":
                skipped += 1
                body = f'<skipped message="{_attr("not applicable: " + (detail or ""))}"/>'
            elif c["status"] == "not_run" and detail:
                errors += 1
                msg = "could not run: " + detail
                body = f'<error type="not_run" message="{_attr(msg)}">{_xml_escape(msg)}</error>'
            elif c["status"] == "not_run":
                skipped += 1
                body = '<skipped message="no test covered this clause"/>'
            cases.append(_case(f"{cls}.{c['invariant']}", c["id"], body))
        # A failing test that cites no clause would otherwise vanish from the clause view.
        for f in e["failures"]:
            if not f["clauses"]:
                failures += 1
                msg = f["message"] or "failed"
                body = f'<failure message="{_attr(msg)}">{_xml_escape(msg)}</failure>'
                cases.append(_case(f"{cls}.unclaused", f["test"], body))
    props = {"status": status, "subject": subject, "vllm": vllm}
    if e is not None:
        props.update(
            untested_vllm=str(e["untested_vllm"]).lower(),
            log=e["log"] or "",
            report=e["report"] or "",
        )
    prop_xml = "".join(
        f'<property name="{_attr(k)}" value="{_attr(v)}"/>' for k, v in props.items()
    )
    time = f' time="{float(e["duration_s"]):.3f}"' if e is not None and e["duration_s"] else ""
    return (
        f'  <testsuite name="{_attr(f"omni-conformance[{subject} @ vLLM {vllm}]")}" '
        f'tests="{len(cases)}" failures="{failures}" errors="{errors}" skipped="{skipped}"{time}>\n'
        f"    <properties>{prop_xml}</properties>\n" + "\n".join(cases) + "\n  </testsuite>"
    ), [len(cases), failures, errors, skipped]


def render_junit(report: Mapping[str, Any]) -> str:
    """One suite per cell (and one per unfinished cell folder); the totals are the suites' sums."""
    built = [_junit_suite(e) for e in report["cells"]]
    built += [_junit_suite(None, u) for u in report["unfinished"]]
    suites = [xml for xml, _ in built]
    totals = [sum(n[i] for _, n in built) for i in range(4)]
    tests, failures, errors, skipped = totals
    return (
        '<?xml version="1.0" encoding="utf-8"?>\n'
        f'<testsuites name="omni-conformance matrix" tests="{tests}" failures="{failures}" '
        f'errors="{errors}" skipped="{skipped}">\n' + "\n".join(suites) + "\n</testsuites>\n"
    )


# ---- HTML -----------------------------------------------------------------------------------

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:2em auto;max-width:1200px;
padding:0 1em;color:#1f2328}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.8em 0}
th,td{border:1px solid #d0d7de;padding:.35em .6em;text-align:left;vertical-align:top}
th{background:#f6f8fa}
td.cell{text-align:center;white-space:nowrap}
td.num{text-align:right}
code{font:12px ui-monospace,SFMono-Regular,Menlo,monospace;background:#f6f8fa;padding:0 .2em;
word-break:break-all}
.pass{background:#d3f5d0}.fail{background:#ffc9c9}.error{background:#ffb27a}
.incomplete{background:#fff0a8}.not_applicable{background:#eceff1;color:#444}
.unsupported{background:#d9d9d9;color:#555}.pending{background:#d6e8ff}.none{color:#aaa}
.untested{box-shadow:inset 0 0 0 3px #8250df}
.legend span{display:inline-block;margin:.2em .6em .2em 0;padding:.15em .5em;border:1px solid #ccc}
.muted{color:#666;font-size:.9em}
"""


def _h(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _href(path: str | None, label: str) -> str:
    # Relative links only: the page works from the folder it was written to, offline.
    if not path or Path(path).is_absolute():
        return f"<code>{_h(path or label)}</code>"
    return f'<a href="{_h(path)}"><code>{_h(label)}</code></a>'


def render_html(report: Mapping[str, Any]) -> str:
    s = report["summary"]
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_h(_title(report))}</title>",
        f"<style>{_CSS}</style></head><body>",
        f'<h1 class="{_h(report["status"])}">{_h(_title(report))}</h1>',
        f"<p>{_h(_counts_sentence(report))}. Tests across cells: {s['tests']['passed']} passed, "
        f"{s['tests']['failed']} failed, {s['tests']['error']} errors, "
        f"{s['tests']['not_applicable']} not applicable, {s['tests']['not_run']} could not run. "
        f"Total time {_h(_duration(s['duration_s']))}.</p>",
        "<table><thead><tr><th>subject</th>",
    ]
    out += [f"<th>vLLM {_h(v)}</th>" for v in report["versions"]]
    out.append("<th>overall</th></tr></thead><tbody>")
    rollup = {r["subject"]: r for r in report["by_subject"]}
    for subject, row in _grid(report):
        out.append(f"<tr><th>{_h(subject)}</th>")
        for e, pending in row:
            if e is None:
                cls = PENDING if pending else "none"
                text = _cell_label(None, pending) or "·"
                title = _MEANING[PENDING] if pending else "no cell"
                out.append(f'<td class="cell {cls}" title="{_h(title)}">{_h(text)}</td>')
                continue
            cls = e["status"] + (" untested" if e["untested_vllm"] else "")
            tip = e["error"] or _MEANING[e["status"]]
            if e["untested_vllm"]:
                tip += f" — {_UNTESTED_MEANING}"
            link = e["report"] or e["log"]
            label = _h(_cell_label(e))
            if link and not Path(link).is_absolute():
                label = f'<a href="{_h(link)}">{label}</a>'
            out.append(f'<td class="cell {_h(cls)}" title="{_h(tip)}">{label}</td>')
        r = rollup[subject]
        out.append(
            f'<td class="cell {_h(r["status"])}">{_h(_ICON[r["status"]] + " " + _WORD[r["status"]])}</td></tr>'
        )
    out.append("<tr><th><em>all subjects</em></th>")
    for v in report["by_version"]:
        out.append(
            f'<td class="cell {_h(v["status"])}">{_h(_ICON[v["status"]] + " " + _WORD[v["status"]])}</td>'
        )
    out.append("<td></td></tr></tbody></table>")
    out.append('<p class="legend">')
    for k, meaning in _MEANING.items():
        out.append(f'<span class="{k}">{_h(_ICON[k] + " " + _WORD[k])}: {_h(meaning)}</span>')
    out.append(
        f'<span class="untested">{UNTESTED_MARK} untested: {_h(_UNTESTED_MEANING)}</span>'
        '<span class="none">· no cell</span></p>'
        '<p class="muted">Counts in a cell are tests passed / tests that ran.</p>'
    )

    failing = _failing(report)
    if failing:
        out.append("<h2>Failing cells</h2>")
        for e in failing:
            out += _html_failure(e)
    incomplete = [e for e in report["cells"] if e["status"] == "incomplete"]
    if incomplete:
        out.append("<h2>Incomplete cells</h2><ul>")
        for e in incomplete:
            why = [f"<code>{_h(n['test'])}</code>: {_h(n['reason'])}" for n in e["not_run"][:3]]
            why += [_h(n) for n in e["notes"]]
            out.append(
                f"<li><b>{_h(e['subject'])}</b> on vLLM {_h(e['vllm'])}: "
                + ("; ".join(why) or "a promised check could not run")
                + "</li>"
            )
        out.append("</ul>")
    errored = [e for e in report["cells"] if e["status"] in ("error", "unsupported")]
    if errored:
        out.append(
            "<h2>Cells that did not run</h2><table><thead><tr><th>subject</th><th>vLLM</th>"
            "<th>status</th><th>why</th><th>log</th></tr></thead><tbody>"
        )
        for e in errored:
            out.append(
                f"<tr><td>{_h(e['subject'])}</td><td>{_h(e['vllm'])}</td>"
                f'<td class="{_h(e["status"])}">{_h(_ICON[e["status"]] + " " + _WORD[e["status"]])}</td>'
                f"<td>{_h(e['error'] or 'no error line recorded')}</td>"
                f"<td>{_href(e['log'], e['log'] or '—') if e['log'] else '—'}</td></tr>"
            )
        out.append("</tbody></table>")
    out += _html_upstream(report)
    out += _html_notes(report)
    out += _html_release_changes(report)
    out.append(
        f'<p class="muted">Generated {_h(report["generated_at"])} · {_h(report["schema"])}</p>'
    )
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _html_failure(e: Mapping[str, Any]) -> list[str]:
    n = len(e["failures"])
    out = [
        f"<h3>❌ {_h(e['subject'])} on vLLM {_h(e['vllm'])}"
        + (f" — {n} violation{'s' * (n != 1)}" if n else "")
        + "</h3>"
    ]
    if not e["failures"]:
        out.append(f"<p>No failure details: {_h('; '.join(e['notes']) or 'no compat report')}</p>")
        return out
    first = e["failures"][0]
    out.append(
        f"<p>First failure: <code>{_h(first['test'])}</code> "
        f"({_h(', '.join(first['clauses']) or 'no clause')})</p>"
    )
    diff = first["first_difference"]
    if diff:
        out.append(
            "<table><thead><tr><th>step</th><th>op</th><th>field</th><th>upstream</th>"
            "<th>subject</th></tr></thead><tbody><tr>"
            f'<td class="num">{_h(diff.get("step"))}</td><td>{_h(diff.get("op"))}</td>'
            f"<td><code>{_h(diff.get('path'))}</code></td>"
            f"<td><code>{_h(_short(diff.get('upstream'), 160))}</code></td>"
            f"<td><code>{_h(_short(diff.get('subject'), 160))}</code></td></tr></tbody></table>"
        )
    else:
        out.append(f"<blockquote>{_h(_short(first['message'], 300))}</blockquote>")
    if first["trace"]:
        where = "" if first["trace_found"] else " (recorded path, not found with the cell)"
        shown = (
            _href(first["trace"], first["trace"])
            if first["trace_found"]
            else f"<code>{_h(first['trace'])}</code>"
        )
        out.append(
            f"<p>Trace: {shown}{_h(where)} — replay it in that cell's environment with "
            "<code>omni-conformance replay TRACE</code></p>"
        )
    if n > 1:
        out.append("<ul>")
        out += [
            f"<li>also <code>{_h(o['test'])}</code>: {_h(_short(o['message'], 200))}</li>"
            for o in e["failures"][1:]
        ]
        out.append("</ul>")
    if e["report"]:
        out.append(f"<p>Cell report: {_href(e['report'], e['report'])}</p>")
    return out


def _html_upstream(report: Mapping[str, Any]) -> list[str]:
    rows = [e for e in report["cells"] if e["upstream_tests"] is not None]
    if not rows:
        return []
    out = [
        "<h2>Upstream tests</h2>",
        "<p>vLLM's own tests run against the subject; <em>new failures</em> fail with the subject "
        "but not with upstream's own classes on that release.</p>",
        "<table><thead><tr><th>subject</th><th>vLLM</th><th>passed</th><th>failed</th>"
        "<th>skipped</th><th>errors</th><th>total</th><th>new failures</th><th>time</th></tr>"
        "</thead><tbody>",
    ]
    for e in rows:
        u = e["upstream_tests"]
        new = "<br>".join(f"<code>{_h(t)}</code>" for t in u["new_failing"]) or "—"
        cls = "fail" if u["new_failing"] else "pass"
        out.append(
            f"<tr><td>{_h(e['subject'])}</td><td>{_h(e['vllm'])}</td>"
            + "".join(
                f'<td class="num">{u[k]}</td>'
                for k in ("passed", "failed", "skipped", "errors", "total")
            )
            + f'<td class="{cls}">{new}</td><td class="num">{_h(_duration(u["duration_s"]))}</td></tr>'
        )
    out.append("</tbody></table>")
    return out


def _html_notes(report: Mapping[str, Any]) -> list[str]:
    items = [f"<li>{n}</li>" for n in _note_texts(report, _h, lambda t: f"<code>{_h(t)}</code>")]
    return ["<h2>Notes</h2><ul>", *items, "</ul>"] if items else []


def _html_release_changes(report: Mapping[str, Any]) -> list[str]:
    items = report.get("release_changes") or []
    if not items:
        return []
    out = ["<h2>Upstream changes between releases</h2>"]
    for item in items:
        out.append(f"<h3>vLLM {_h(item.get('from', '?'))} → {_h(item.get('to', '?'))}</h3><ul>")
        out += [f"<li>{_h(_change_text(c))}</li>" for c in item.get("changes") or []]
        out.append("</ul>")
    return out


# ---- writing, validating --------------------------------------------------------------------


def write_matrix_report(report: Mapping[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write the report's JSON and its Markdown, JUnit and HTML renderings into ``out_dir``; paths
    in a report built for another folder are re-anchored at ``out_dir`` first."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    base = getattr(report, "base", None)
    if base is not None and base != d.resolve():
        report = rebase(report, base, d)
    paths = {kind: d / name for kind, name in FILES.items()}
    paths["json"].write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    paths["markdown"].write_text(render_markdown(report), encoding="utf-8")
    paths["junit"].write_text(render_junit(report), encoding="utf-8")
    paths["html"].write_text(render_html(report), encoding="utf-8")
    return paths


def load_schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def validate(report: Mapping[str, Any]) -> None:
    """Raise ``jsonschema.ValidationError`` when the report does not match its schema."""
    import jsonschema

    jsonschema.validate(dict(report), load_schema())


# ---- the merge command ----------------------------------------------------------------------

_SHORT = {
    "pass": "pass",
    "fail": "FAIL",
    "not_applicable": "n/a",
    "error": "ERROR",
    "unsupported": "unsupp.",
    "incomplete": "INCOMPL.",
    PENDING: "pending",
}


def summary_text(report: Mapping[str, Any]) -> str:
    """The grid in a few plain-text lines (``*`` marks an untested vLLM)."""
    width = max([len(s) for s in report["subjects"]] + [7]) + 2
    cols = [max(len(v), 9) + 1 for v in report["versions"]]
    lines = [f"{_title(report)}: {_counts_sentence(report)}"]
    lines.append(
        " " * width + "".join(f"{v:<{w}}" for v, w in zip(report["versions"], cols, strict=True))
    )
    for subject, row in _grid(report):
        texts = []
        for e, pending in row:
            if e is None:
                texts.append(_SHORT[PENDING] if pending else "-")
            else:
                texts.append(_SHORT[e["status"]] + ("*" if e["untested_vllm"] else ""))
        lines.append(
            f"{subject:<{width}}" + "".join(f"{t:<{w}}" for t, w in zip(texts, cols, strict=True))
        )
    if any(e["untested_vllm"] for e in report["cells"]):
        lines.append(f"* {_UNTESTED_MEANING}")
    for e in _failing(report):
        if e["failures"]:
            f = e["failures"][0]
            lines.append(f"FAIL {e['subject']} @ vLLM {e['vllm']}: {_short(f['message'], 140)}")
    for e in report["cells"]:
        if e["status"] == "error":
            lines.append(
                f"ERROR {e['subject']} @ vLLM {e['vllm']}: {e['error'] or 'no error line'}"
            )
    if report["duplicates"]:
        n = len(report["duplicates"])
        lines.append(f"note: {n} cell(s) found more than once; used the newest finished_at")
    if report["unfinished"]:
        n = len(report["unfinished"])
        lines.append(
            f"note: {n} cell folder(s) without cell.json yet (unfinished); merged the rest"
        )
    return "\n".join(lines)


# Where ``matrix --release-diff`` leaves its list of compared release pairs, under its --out.
RELEASE_DIFF_PAIRS = Path("release-diff") / "release-diff.json"


def release_changes_in(folder: str | Path) -> list[dict[str, Any]]:
    """The release pairs ``matrix --release-diff`` wrote under ``folder`` (none if it did not
    run there, or the file is unreadable: the section is optional)."""
    try:
        data = json.loads((Path(folder) / RELEASE_DIFF_PAIRS).read_text())
    except (OSError, ValueError):
        return []
    pairs = data.get("pairs") if isinstance(data, dict) else None
    return [p for p in pairs if isinstance(p, dict)] if isinstance(pairs, list) else []


def merge(
    paths: Sequence[str | Path], out_dir: str | Path = DEFAULT_OUT
) -> tuple[dict[str, Any], dict[str, Path]]:
    """Load the cells under ``paths`` and write the merged report into ``out_dir``; release
    pairs found in those folders (``matrix --release-diff``) fill "upstream changes between
    releases", one entry per pair (the last folder named wins)."""
    cells = load_cells(paths)
    pairs: dict[tuple[Any, Any], dict[str, Any]] = {}
    for path in paths:
        for pair in release_changes_in(path):
            pairs[(pair.get("from"), pair.get("to"))] = pair
    ordered = sorted(pairs.values(), key=lambda p: version_key(str(p.get("from", ""))))
    report = build_matrix_report(cells, out_dir=out_dir, release_changes=ordered)
    return report, write_matrix_report(report, out_dir)


def cmd_merge(args: argparse.Namespace) -> int:
    try:
        report, paths = merge(args.paths, args.out)
    except CellError as exc:
        print(f"omni-conformance: error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except OSError as exc:
        print(f"omni-conformance: error: cannot write the report: {exc}", file=sys.stderr)
        return EXIT_INPUT
    print(summary_text(report))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return exit_code(report)


def add_merge_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``merge`` on the ``omni-conformance`` subparsers."""
    m = sub.add_parser(
        "merge",
        help="merge matrix cells (from one or several machines) into one report",
        description=(
            "Merge the cells of `omni-conformance matrix` runs into one report: JSON, Markdown, "
            "JUnit XML and HTML. Exit 0 when every cell passed or is not applicable / "
            "unsupported, 1 when a cell failed, errored or is incomplete, 2 when no cell.json "
            "was found or one is malformed."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="a matrix output folder, a cells/ folder, a cell folder or a cell.json; folders "
        "are searched for cell.json",
    )
    m.add_argument("--out", default=DEFAULT_OUT, help="folder to write the merged report into")
    m.set_defaults(func=cmd_merge)
    return m
