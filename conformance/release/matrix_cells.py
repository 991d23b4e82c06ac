"""The cells of an ``omni-conformance matrix`` run, as the merge reads them.

A cell is a folder ``cells/<subject>--vllm-<version>/`` holding a ``cell.json`` (schema
``conformance/schemas/matrix-cell.schema.json``, id ``omni-conformance-matrix-cell/1``) and, when
the suite ran, the check's compat report. ``load_cells(paths)`` finds the ``cell.json`` files
under matrix output folders, ``cells/`` folders or single cell folders (also cells copied from
several machines into one folder), checks each against its schema (``CellError``: one line naming
the file and the field), reads and checks the cell's compat report, resolves duplicates of one
(subject, vLLM) cell by the newest ``finished_at``, and notes cell folders that have no
``cell.json`` yet (an interrupted or still running matrix). ``version_key`` orders vLLM versions.
``conformance.release.matrix_report`` builds the merged report from what this returns.
"""

from __future__ import annotations

import copy
import datetime as _dt
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance._core import schemas

CELL_SCHEMA_ID = "omni-conformance-matrix-cell/1"
CELL_FILE = "cell.json"
CELL_STATUSES = ("pass", "fail", "not_applicable", "incomplete", "error", "unsupported")

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


def subject_key(subject: str) -> tuple[int, str]:
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


# What a cell.json may leave out, and the value the merge reads for it.
_CELL_DEFAULTS: dict[str, Any] = {
    "started_at": None,
    "finished_at": None,
    "error": None,
    "log": None,
    "report": None,
    "extras": [],
    "environment": {},
    "untested_vllm": False,
    "exit_code": None,
    "duration_s": None,
    "upstream_tests": None,
}
_UPSTREAM_DEFAULTS: dict[str, Any] = {
    **dict.fromkeys(("passed", "failed", "skipped", "errors", "total"), 0),
    "failing": [],
    "baseline_failing": [],
    "duration_s": None,
}


def check_cell(data: Any, path: Path | str) -> dict[str, Any]:
    """``data`` (a parsed ``cell.json``) with optional fields defaulted; ``CellError`` naming the
    field when it does not match ``conformance/schemas/matrix-cell.schema.json``."""
    if not isinstance(data, dict):
        raise CellError(path, f"not a JSON object but {type(data).__name__}")
    found = schemas.problem("matrix-cell", data)
    if found is not None:
        raise CellError(path, found.text, found.field)
    out = {**copy.deepcopy(_CELL_DEFAULTS), **data}
    if out["upstream_tests"] is not None:
        out["upstream_tests"] = {**copy.deepcopy(_UPSTREAM_DEFAULTS), **out["upstream_tests"]}
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
            found = schemas.problem("compat-report", report)
            if found is None:
                cell.report = report
            else:
                cell.report_problem = (
                    f"its compat report {data['report']} is not one this merge can read "
                    f"(it does not match its schema: {found})"
                )
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
