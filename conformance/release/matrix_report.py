"""The merged upstream-compat report of a vLLM-version × subject matrix, and ``omni-conformance merge``.

``conformance.release.matrix_cells`` loads the cells an ``omni-conformance matrix`` run left (one
``cell.json`` per (subject, vLLM) folder, checked against its schema); this module owns the rest:

* ``build_matrix_report(cells, out_dir=...)``: the merged report, a JSON document (schema
  ``conformance/schemas/matrix-report.schema.json``) with per-cell results, an overall summary and
  rollups per subject and per vLLM version; its paths are relative to the folder it is written to;
* ``write_matrix_report(report, out_dir)``: ``matrix-report.json`` and its renderings, Markdown and
  one self-contained HTML page (templates ``conformance/templates/matrix-report.*``) and JUnit XML
  (one suite per cell);
* ``cmd_merge`` / ``add_merge_parser``: the ``merge`` command.

Outcomes stay honest: a ``pass`` without a readable compat report shows as ``incomplete``, a failing
test that cites no clause is still a JUnit failure, and unfinished cell folders make it incomplete.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from markupsafe import Markup, escape

from conformance._core import schemas
from conformance._core.render import Case, Suite, junit_xml, md, md_code, render
from conformance.release.matrix_cells import (
    CELL_STATUSES,
    Cell,
    CellError,
    CellSet,
    load_cells,
    resolve_duplicates,
    sort_versions,
    subject_key,
    version_key,
)

SCHEMA_ID = "omni-conformance-matrix-report/1"
DEFAULT_OUT = "matrix-report"
JUNIT_NAME = "omni-conformance matrix"
FILES = {
    "json": "matrix-report.json",
    "markdown": "matrix-report.md",
    "junit": "matrix-report.junit.xml",
    "html": "matrix-report.html",
}

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
    entries.sort(key=lambda e: (subject_key(e["subject"]), version_key(e["vllm"])))
    unfinished = sorted(
        (
            {"id": u.path.name, "subject": u.subject, "vllm": u.vllm, "path": _rel(u.path, base)}
            for u in cs.unfinished
        ),
        key=lambda u: (subject_key(u["subject"]), version_key(u["vllm"])),
    )
    subjects = sorted(
        {e["subject"] for e in entries} | {u["subject"] for u in unfinished}, key=subject_key
    )
    versions = sort_versions([e["vllm"] for e in entries] + [u["vllm"] for u in unfinished])

    overall = _rollup(entries, len(unfinished))

    def rollups(
        axis: str, values: list[str], other: str, order: Callable[[str], Any], listed: str
    ) -> list[dict[str, Any]]:
        """One rollup per value of ``axis`` ("subject" or "vllm"), listing the ``other`` values
        it was run on (finished or not) under ``listed``."""
        out = []
        for value in values:
            mine = [e for e in entries if e[axis] == value]
            waiting = [u for u in unfinished if u[axis] == value]
            ran_on = sorted({x[other] for x in mine + waiting}, key=order)
            out.append({axis: value, **_rollup(mine, len(waiting)), listed: ran_on})
        return out

    by_subject = rollups("subject", subjects, "vllm", version_key, "versions")
    by_version = rollups("vllm", versions, "subject", subject_key, "subjects")

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
        cs.duplicates, key=lambda d: (subject_key(d[0].subject), version_key(d[0].vllm))
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


def _why(e: Mapping[str, Any]) -> list[tuple[str | None, str]]:
    """Why a cell is incomplete: (test, reason) of its first checks that could not run, then
    its notes as (None, note)."""
    return [(n["test"], n["reason"]) for n in e["not_run"][:3]] + [(None, n) for n in e["notes"]]


def _context(report: Mapping[str, Any]) -> dict[str, Any]:
    """What the Markdown and HTML templates show, beyond the report itself."""
    return {
        "report": report,
        "title": _title(report),
        "counts": _counts_sentence(report),
        "grid": _grid(report),
        "rollup": {r["subject"]: r for r in report["by_subject"]},
        "failing": _failing(report),
        "incomplete": [e for e in report["cells"] if e["status"] == "incomplete"],
        "errored": [e for e in report["cells"] if e["status"] in ("error", "unsupported")],
        "upstream": [e for e in report["cells"] if e["upstream_tests"] is not None],
        "icon": _ICON,
        "word": _WORD,
        "meaning": _MEANING,
        "untested_mark": UNTESTED_MARK,
        "untested_meaning": _UNTESTED_MEANING,
        "label": _cell_label,
        "short": _short,
        "duration": _duration,
        "change_text": _change_text,
        "why": _why,
        "is_absolute": lambda p: Path(p).is_absolute(),
    }


def render_markdown(report: Mapping[str, Any]) -> str:
    notes = _note_texts(report, md, md_code)
    return render("matrix-report.md.j2", **_context(report), notes=notes)


def render_html(report: Mapping[str, Any]) -> str:
    def code(text: Any) -> str:
        return str(Markup("<code>{}</code>").format(text))

    notes = [Markup(n) for n in _note_texts(report, lambda t: str(escape(t)), code)]
    return render("matrix-report.html.j2", **_context(report), notes=notes)


def _junit_suite(e: Mapping[str, Any] | None, pending: Mapping[str, Any] | None = None) -> Suite:
    """One suite per cell: a case per clause of its compat report, or one case for a cell that
    did not run. Each failing clause is counted once, as one ``failure``."""
    src = e if e is not None else pending
    assert src is not None
    subject, vllm = src["subject"], src["vllm"]
    cls = f"omni_conformance[{subject}@vllm-{vllm}]"
    status = e["status"] if e is not None else PENDING
    suite = Suite(
        f"omni-conformance[{subject} @ vLLM {vllm}]",
        properties={"status": status, "subject": subject, "vllm": vllm},
    )
    if e is None:
        msg = f"not finished: {src['path']} has no cell.json yet"
        suite.cases.append(Case(cls, "cell", "skipped", message=msg))
        return suite
    suite.properties = {
        **suite.properties,
        "untested_vllm": str(e["untested_vllm"]).lower(),
        "log": e["log"] or "",
        "report": e["report"] or "",
    }
    suite.time = float(e["duration_s"]) if e["duration_s"] else None
    if status in ("error", "unsupported") or not e["clauses"]:
        why = e["error"] or "; ".join(e["notes"]) or status
        case = Case(cls, "cell", time=e["duration_s"])
        if status == "unsupported":
            case.result, case.kind, case.message = "skipped", "unsupported", "unsupported: " + why
        elif status == "fail":
            case.result, case.message, case.detail = "failure", why, why
        elif status not in ("pass", "not_applicable"):
            case.result, case.kind, case.message, case.detail = "error", status, why, why
        suite.cases.append(case)
        return suite
    for c in e["clauses"]:
        case = Case(f"{cls}.{c['invariant']}", c["id"])
        detail = c["detail"]
        if c["status"] == "fail":
            first = (detail or "violation").splitlines()[0]
            case.result, case.message, case.detail = "failure", first, detail
        elif c["status"] == "not_applicable":
            case.result, case.message = "skipped", "not applicable: " + (detail or "")
        elif c["status"] == "not_run" and detail:
            msg = "could not run: " + detail
            case.result, case.kind, case.message, case.detail = "error", "not_run", msg, msg
        elif c["status"] == "not_run":
            case.result, case.message = "skipped", "no test covered this clause"
        suite.cases.append(case)
    # A failing test that cites no clause would otherwise vanish from the clause view.
    for f in e["failures"]:
        if not f["clauses"]:
            msg = f["message"] or "failed"
            suite.cases.append(Case(f"{cls}.unclaused", f["test"], "failure", msg, msg))
    return suite


def junit_suites(report: Mapping[str, Any]) -> list[Suite]:
    """One suite per cell (and one per unfinished cell folder)."""
    suites = [_junit_suite(e) for e in report["cells"]]
    return suites + [_junit_suite(None, u) for u in report["unfinished"]]


def render_junit(report: Mapping[str, Any]) -> str:
    return junit_xml(junit_suites(report), name=JUNIT_NAME)


# ---- writing --------------------------------------------------------------------------------


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
    run there: the section is optional); ``CellError`` naming the file and the field when the
    file is there but not one its schema allows."""
    path = Path(folder) / RELEASE_DIFF_PAIRS
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        raise CellError(path, f"cannot be read: {exc}") from None
    found = schemas.problem("release-diff-pairs", data)
    if found is not None:
        raise CellError(path, found.text, found.field)
    return list(data["pairs"])


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
