"""The upstream-compat report: per invariant and per contract clause, as JSON, Markdown and JUnit.

``ReportBuilder`` accumulates one ``TestRecord`` per test (outcome, the clauses it declares,
examples run, steps compared, tolerated differences by registry id, its first difference and
failure trace, or why it did not apply) and renders the report. The JSON is the source of truth
(its schema is ``conformance/schemas/compat-report.schema.json``); Markdown (a CI job summary, the
template ``conformance/templates/compat-report.md.j2``) and JUnit XML (one test case per clause,
then one per test, written by ``conformance._core.render``) are renderings of it, and
``render_from_json`` rebuilds them.

Outcomes are honest about what ran. A test pytest skipped (a feature the subject lacks, a worker
it does not provide) is ``not_applicable`` with pytest's skip reason, never a pass; a clause or
invariant whose tests were all not applicable has status ``not_applicable`` (``not_run`` means no
test covered it at all). A failure's message leads with its cause: the first difference
(``step N (op) field: upstream=... subject=...``) when the harness found one.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance._core import clauses as clause_table
from conformance._core import schemas
from conformance._core.render import Case, Suite, junit_xml, render

SCHEMA_ID = "omni-conformance-compat-report/2"

# The invariants the report rolls clauses up into, and clause -> the invariant (or contract
# group) it belongs to: both from the one clause table, ``conformance._core.clauses``.
INVARIANTS: dict[str, str] = dict(clause_table.INVARIANTS)
CLAUSES: dict[str, str] = {cid: c.invariant for cid, c in clause_table.CLAUSES.items()}


@dataclass
class TestRecord:
    __test__ = False  # not a pytest test class, despite the name

    nodeid: str
    outcome: str  # passed | failed | error | not_applicable (pytest's "skipped") | not_run
    clauses: list[str] = field(default_factory=list)
    examples: int = 0
    steps_compared: int = 0
    tolerated: dict[str, int] = field(default_factory=dict)
    exercised: dict[str, int] = field(default_factory=dict)
    duration: float = 0.0
    message: str | None = None
    first_difference: dict[str, Any] | None = None
    trace: str | None = None
    # A statistics difference the run set aside to compare the rest ({first_difference, trace}).
    set_aside: dict[str, Any] | None = None
    # Why a not-applicable test did not apply (pytest's skip reason), or why a not-run test
    # could not run here (a missing tool, an unreadable file).
    reason: str | None = None

    def __post_init__(self) -> None:
        if self.outcome == "skipped":
            self.outcome = NOT_APPLICABLE

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TestRecord:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def headline(self) -> str:
        """The failure's one-line cause: the first difference when there is one."""
        if self.first_difference:
            return difference_headline(self.first_difference)
        return self.message or ""


NOT_APPLICABLE = "not_applicable"
# A check the subject's capabilities promise that could not run here: never a pass.
NOT_RUN = "not_run"
OUTCOMES = ("passed", "failed", "error", NOT_APPLICABLE, NOT_RUN)


def _short(value: Any, limit: int = 120) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def difference_headline(diff: Mapping[str, Any]) -> str:
    """``step N (op) field: upstream=... subject=...`` for a first difference (JSON form)."""
    return (
        f"step {diff.get('step')} ({diff.get('op')}) {diff.get('path')}: "
        f"upstream={_short(diff.get('upstream'))} subject={_short(diff.get('subject'))}"
    )


def _set_aside_entry(found: Mapping[str, Any]) -> dict[str, Any]:
    """A set-aside difference as a failure lists it: with its one-line headline."""
    return {**found, "message": difference_headline(found["first_difference"])}


def _installed(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "missing"


def _status(outcomes: Iterable[str]) -> str:
    seen = set(outcomes)
    if seen & {"failed", "error"}:
        return "fail"
    if NOT_RUN in seen:
        return "not_run"
    if "passed" in seen:
        return "pass"
    if NOT_APPLICABLE in seen:
        return NOT_APPLICABLE
    return "not_run"


def _rollup(statuses: Iterable[str]) -> str:
    """An invariant's status from its clauses': fail, else pass, else not applicable."""
    seen = set(statuses)
    for status in ("fail", "pass", NOT_APPLICABLE):
        if status in seen:
            return status
    return "not_run"


def _merge(into: dict[str, int], more: Mapping[str, int]) -> None:
    for k, v in more.items():
        into[k] = into.get(k, 0) + int(v)


class ReportBuilder:
    def __init__(
        self,
        *,
        subject: str,
        profile: str,
        seed: Any,
        environment: Mapping[str, str],
    ) -> None:
        self.subject = subject
        self.profile = profile
        self.seed = seed
        self.environment = dict(environment)
        # The hypothesis release decides, with the profile, which examples every test ran: a
        # report without it could not say why two runs' step counts differ.
        self.environment.setdefault("hypothesis", _installed("hypothesis"))
        self.records: list[TestRecord] = []

    def add(self, record: TestRecord) -> None:
        self.records.append(record)

    def build(self) -> dict[str, Any]:
        def blank(cid: str, invariant: str) -> dict[str, Any]:
            return {
                "id": cid,
                "invariant": invariant,
                "status": "not_run",
                "examples": 0,
                "steps_compared": 0,
                "tolerated": {},
                "tests": [],
            }

        clauses = {cid: blank(cid, inv) for cid, inv in CLAUSES.items()}
        outcomes: dict[str, list[str]] = {}
        for r in self.records:
            for cid in r.clauses:
                entry = clauses.setdefault(cid, blank(cid, "unknown"))
                entry["examples"] += r.examples
                entry["steps_compared"] += r.steps_compared
                _merge(entry["tolerated"], r.tolerated)
                entry["tests"].append(r.nodeid)
                outcomes.setdefault(cid, []).append(r.outcome)
        for cid, outs in outcomes.items():
            clauses[cid]["status"] = _status(outs)

        invariants = []
        for iid, title in INVARIANTS.items():
            members = [c for c in clauses.values() if c["invariant"] == iid]
            member_ids = {c["id"] for c in members}
            status = _rollup(c["status"] for c in members)
            # Count each test once per invariant, however many of its clauses it covers.
            covering = [r for r in self.records if member_ids & set(r.clauses)]
            tolerated: dict[str, int] = {}
            for r in covering:
                _merge(tolerated, r.tolerated)
            invariants.append(
                {
                    "id": iid,
                    "title": title,
                    "status": status,
                    "clauses": [c["id"] for c in members],
                    "examples": sum(r.examples for r in covering),
                    "steps_compared": sum(r.steps_compared for r in covering),
                    "tolerated": tolerated,
                }
            )
        failures = [
            {
                "test": r.nodeid,
                "clauses": r.clauses,
                "message": r.headline(),
                "first_difference": r.first_difference,
                "trace": r.trace,
                **({"set_aside": _set_aside_entry(r.set_aside)} if r.set_aside else {}),
            }
            for r in self.records
            if r.outcome in ("failed", "error")
        ]
        not_applicable = [
            {"test": r.nodeid, "clauses": r.clauses, "reason": r.reason or "skipped"}
            for r in self.records
            if r.outcome == NOT_APPLICABLE
        ]
        not_run = [
            {"test": r.nodeid, "clauses": r.clauses, "reason": r.reason or "could not run"}
            for r in self.records
            if r.outcome == NOT_RUN
        ]
        counts = {k: sum(1 for r in self.records if r.outcome == k) for k in OUTCOMES}
        if failures:
            status = "fail"
        elif not_run:
            status = "incomplete"
        elif counts["passed"]:
            status = "pass"
        else:
            status = NOT_APPLICABLE if counts[NOT_APPLICABLE] else "not_run"
        tolerated_total: dict[str, int] = {}
        for r in self.records:
            _merge(tolerated_total, r.tolerated)
        return {
            "schema": SCHEMA_ID,
            "generated_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "subject": self.subject,
            "profile": self.profile,
            "seed": self.seed
            if isinstance(self.seed, int | str) or self.seed is None
            else str(self.seed),
            "environment": self.environment,
            "status": status,
            "summary": {
                "tests": len(self.records),
                "ran": len(self.records) - counts[NOT_APPLICABLE] - counts[NOT_RUN],
                **counts,
                "violations": len(failures),
                "examples": sum(r.examples for r in self.records),
                "steps_compared": sum(r.steps_compared for r in self.records),
                "tolerated": tolerated_total,
            },
            "invariants": invariants,
            "clauses": list(clauses.values()),
            "tests": [{**r.__dict__, "message": r.headline() or None} for r in self.records],
            "failures": failures,
            "not_applicable": not_applicable,
            "not_run": not_run,
        }


# ---- renderings ---------------------------------------------------------------------------

_ICON = {
    "pass": "✅ pass",
    "fail": "❌ FAIL",
    NOT_APPLICABLE: "➖ not applicable",
    "not_run": "— not run",
    "incomplete": "⚠️ INCOMPLETE",
}


def mark_incomplete(report: Mapping[str, Any], reason: str) -> dict[str, Any]:
    """The report of a run cut short (``reason``, e.g. "interrupted by SIGINT"): the tests that
    finished keep their records; ``complete`` is false, and a run in which nothing failed is
    ``incomplete``, never ``pass`` (a violation found before the stop still fails it)."""
    out = dict(report)
    out["complete"] = False
    out["incomplete_reason"] = reason
    if out["status"] != "fail":
        out["status"] = "incomplete"
    return out


def _tol(t: Mapping[str, int]) -> str:
    return ", ".join(f"{k}×{v}" for k, v in sorted(t.items())) or "—"


def counts_line(summary: Mapping[str, Any]) -> str:
    """``N tests: R ran (P passed, F failed, E errors), A not applicable``."""
    return (
        f"{summary['tests']} tests: {summary['ran']} ran ({summary['passed']} passed, "
        f"{summary['failed']} failed, {summary['error']} errors), "
        f"{summary['not_applicable']} not applicable"
        + (f", {summary['not_run']} could not run" if summary.get("not_run") else "")
    )


def render_markdown(report: Mapping[str, Any]) -> str:
    blocked = {c for n in report.get("not_run", ()) for c in n["clauses"]}
    uncovered = [
        c["id"] for c in report["clauses"] if c["status"] == "not_run" and c["id"] not in blocked
    ]
    return render(
        "compat-report.md.j2",
        report=report,
        blocked=sorted(blocked),
        uncovered=uncovered,
        icon=_ICON,
        tol=_tol,
        counts_line=counts_line,
    )


def _reasons(report: Mapping[str, Any], clause: str) -> str:
    found = [n["reason"] for n in report["not_applicable"] if clause in n["clauses"]]
    return "; ".join(dict.fromkeys(found)) or "not applicable"


def _clause_case(report: Mapping[str, Any], c: Mapping[str, Any]) -> Case:
    case = Case(
        f"omni_conformance.{c['invariant']}",
        c["id"],
        properties={
            "examples": c["examples"],
            "steps_compared": c["steps_compared"],
            "tolerated": _tol(c["tolerated"]),
        },
    )
    if c["status"] == "fail":
        msgs = [f["message"] for f in report["failures"] if c["id"] in f["clauses"]]
        case.result, case.message = "failure", msgs[0] if msgs else "violation"
        case.detail = "\n".join(msgs)
    elif c["status"] == NOT_APPLICABLE:
        case.result, case.message = "skipped", "not applicable: " + _reasons(report, c["id"])
    elif c["status"] == "not_run":
        why = [n["reason"] for n in report.get("not_run", ()) if c["id"] in n["clauses"]]
        if why:  # a covering test could not run here: an error, not a skip
            msg = "could not run: " + "; ".join(dict.fromkeys(why))
            case.result, case.kind, case.message, case.detail = "failure", "not_run", msg, msg
        else:
            case.result, case.message = "skipped", "no test covered this clause"
    return case


def _test_case(t: Mapping[str, Any]) -> Case:
    module, _, name = t["nodeid"].rpartition("::")
    case = Case(module or name, name, time=float(t.get("duration") or 0.0))
    message = t.get("message") or t["outcome"]
    if t["outcome"] in ("failed", "error"):
        case.result = "failure" if t["outcome"] == "failed" else "error"
        case.message = case.detail = message
    elif t["outcome"] == NOT_APPLICABLE:
        case.result, case.kind = "skipped", "not_applicable"
        case.message = t.get("reason") or "not applicable"
    elif t["outcome"] == NOT_RUN:
        reason = "could not run: " + (t.get("reason") or "unknown")
        case.result, case.kind, case.message, case.detail = "error", "not_run", reason, reason
    return case


def junit_suites(report: Mapping[str, Any]) -> list[Suite]:
    """Two suites: one test case per clause (the contract view), then one per test."""
    subject = report["subject"]
    tests = [_test_case(t) for t in report["tests"]]
    if report.get("complete") is False:
        # An interrupted run is an error to a CI reader, whatever the tests that ran say.
        reason = str(report.get("incomplete_reason") or "the run was cut short")
        tests.append(
            Case("omni-conformance", "run complete", "error", message=f"INCOMPLETE: {reason}")
        )
    clauses = [_clause_case(report, c) for c in report["clauses"]]
    return [
        Suite(f"omni-conformance[{subject}]", clauses),
        Suite(f"omni-conformance[{subject}] tests", tests),
    ]


def render_junit(report: Mapping[str, Any]) -> str:
    return junit_xml(junit_suites(report))


def write_report(report: Mapping[str, Any], out_dir: str | Path) -> dict[str, Path]:
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": d / "compat-report.json",
        "markdown": d / "compat-report.md",
        "junit": d / "compat-report.junit.xml",
    }
    paths["json"].write_text(json.dumps(report, indent=2, default=str))
    paths["markdown"].write_text(render_markdown(report))
    paths["junit"].write_text(render_junit(report), encoding="utf-8")
    return paths


def validate(report: Mapping[str, Any]) -> None:
    """Raise ``jsonschema.ValidationError`` when the report does not match its schema."""
    schemas.validate("compat-report", dict(report))


def render_from_json(path: str | Path, out_dir: str | Path | None = None) -> dict[str, Path]:
    p = Path(path)
    report = json.loads(p.read_text())
    return write_report(report, out_dir or p.parent)
