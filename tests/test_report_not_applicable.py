"""The compat report is honest about what ran.

A test the subject cannot run (pytest skipped it: a capability the subject lacks) is *not
applicable*, with the reason — never counted as a pass, never lost. A clause or invariant whose
tests were all not applicable says so (``not_applicable``), distinct from ``pass``, ``fail`` and
``not_run`` (no test covered it). A failure's headline leads with its cause: the first
difference when there is one, else the exception — never hypothesis's boilerplate; a subject
that cannot be loaded is recognised by its error's type, and says so in one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import jsonschema
import pytest

from conformance._core.report import (
    ReportBuilder,
    TestRecord,
    render_junit,
    render_markdown,
    validate,
    write_report,
)
from conformance.cli import main
from conformance.cli.check import _plugin_installed, _summary
from conformance.plugin import _first_line, _skip_reason

pytestmark = pytest.mark.clauses("C-03")

ENV = {"vllm": "0.33.0", "torch": "2.x", "python": "3.11.7"}
DIFF = {
    "step": 4,
    "op": "step",
    "path": "queues.waiting",
    "upstream": ["q2", "q5"],
    "subject": ["q5", "q2"],
    "request_id": None,
    "mode": "sync",
    "not_applicable": [],
}
NO_WORKER = "subject 'third-party' provides no real worker"


def _build(*records: TestRecord) -> dict:
    b = ReportBuilder(subject="third-party", profile="ci", seed=0, environment=ENV)
    for r in records:
        b.add(r)
    return b.build()


def _passed(nodeid: str, clauses: list[str]) -> TestRecord:
    return TestRecord(nodeid, "passed", clauses, examples=2, steps_compared=30)


def _na(nodeid: str, clauses: list[str], reason: str = NO_WORKER) -> TestRecord:
    return TestRecord(nodeid, "not_applicable", clauses, reason=reason)


def _by_id(items: list[dict]) -> dict[str, dict]:
    return {i["id"]: i for i in items}


def test_all_tests_of_an_invariant_not_applicable():
    report = _build(
        _passed("inv/test_lockstep.py::test_parity[sync]", ["C-01", "C-02"]),
        _na("inv/test_workers.py::test_executes_assigned", ["C-20", "C-21"]),
        _na("inv/test_workers.py::test_no_sends", ["C-21"], "no chunk delivery"),
    )
    validate(report)
    assert report["status"] == "pass"
    inv = _by_id(report["invariants"])
    assert inv["AR-INV-001"]["status"] == "pass"
    assert inv["AR-INV-003"]["status"] == "not_applicable"
    assert inv["AR-INV-002"]["status"] == "not_run"  # no test covered it at all
    clauses = _by_id(report["clauses"])
    assert clauses["C-20"]["status"] == clauses["C-21"]["status"] == "not_applicable"
    assert clauses["C-22"]["status"] == "not_run"
    s = report["summary"]
    assert (s["tests"], s["ran"], s["passed"], s["failed"], s["not_applicable"]) == (3, 1, 1, 0, 2)
    tests = {t["nodeid"]: t for t in report["tests"]}
    worker = tests["inv/test_workers.py::test_executes_assigned"]
    assert worker["outcome"] == "not_applicable" and worker["reason"] == NO_WORKER
    assert report["not_applicable"] == [
        {
            "test": "inv/test_workers.py::test_executes_assigned",
            "clauses": ["C-20", "C-21"],
            "reason": NO_WORKER,
        },
        {
            "test": "inv/test_workers.py::test_no_sends",
            "clauses": ["C-21"],
            "reason": "no chunk delivery",
        },
    ]


def test_a_clause_with_one_passing_test_passes_and_a_failure_wins():
    report = _build(
        _passed("a::ran", ["C-20"]),
        _na("a::could_not", ["C-20"]),
        TestRecord("b::broke", "failed", ["C-01"], message="AssertionError", first_difference=DIFF),
        _na("b::could_not", ["C-01"]),
    )
    validate(report)
    clauses = _by_id(report["clauses"])
    assert clauses["C-20"]["status"] == "pass"
    assert clauses["C-01"]["status"] == "fail"
    assert report["status"] == "fail"
    # The headline leads with the first difference, not the generic exception line.
    assert report["failures"][0]["message"] == (
        'step 4 (step) queues.waiting: upstream=["q2", "q5"] subject=["q5", "q2"]'
    )


def test_everything_not_applicable_is_not_a_pass():
    report = _build(_na("a::x", ["C-20"]), _na("a::y", ["C-21"]))
    validate(report)
    assert report["status"] == "not_applicable"
    assert report["summary"]["ran"] == 0


def test_legacy_skipped_outcome_is_read_as_not_applicable():
    rec = TestRecord.from_dict({"nodeid": "a::x", "outcome": "skipped", "reason": "off"})
    assert rec.outcome == "not_applicable"
    validate(_build(rec))


def test_schema_rejects_what_it_should():
    report = _build(_passed("a::ok", ["C-01"]), _na("a::na", ["C-20"]))
    broken = json.loads(json.dumps(report))
    broken["tests"][1]["outcome"] = "skipped"  # the old word is not an outcome any more
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)
    broken = json.loads(json.dumps(report))
    del broken["tests"][1]["reason"]  # not applicable without a reason
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)
    broken = json.loads(json.dumps(report))
    broken["clauses"][0]["status"] = "skipped"
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)


def test_markdown_has_a_not_applicable_table_and_counts():
    report = _build(
        _passed("inv/test_lockstep.py::test_parity[sync]", ["C-01"]),
        _na("inv/test_workers.py::test_executes_assigned", ["C-20"], "no worker | none at all"),
    )
    md = render_markdown(report)
    assert "2 tests: 1 ran (1 passed, 0 failed, 0 errors), 1 not applicable" in md
    lines = md.splitlines()
    at = lines.index("### Not applicable")
    assert lines[at + 2 : at + 5] == [
        "| Test | Reason |",
        "|---|---|",
        "| `inv/test_workers.py::test_executes_assigned` | no worker \\| none at all |",
    ]
    assert "| C-20 | AR-INV-003 | ➖ not applicable |" in md
    assert "AR-INV-003 Workers execute assigned work | ➖ not applicable" in md
    # a reason that looks like a tag stays visible, and a multi-line failure stays one list item
    report = _build(
        _na("a::na", ["C-20"], "needs <worker>"),
        TestRecord("a::broke", "failed", ["C-01"], message="boom\nFalsifying example: ..."),
    )
    md = render_markdown(report)
    assert "| `a::na` | needs &lt;worker> |" in md
    assert "- `a::broke` (C-01): boom Falsifying example: ..." in md.splitlines()


def test_junit_marks_not_applicable_skipped_with_the_reason():
    report = _build(
        _passed("inv/test_lockstep.py::test_parity[sync]", ["C-01"]),
        _na("inv/test_workers.py::test_executes_assigned", ["C-20"]),
        TestRecord("inv/test_x.py::test_broke", "failed", ["C-02"], first_difference=DIFF),
    )
    root = ET.fromstring(render_junit(report))
    clauses, tests = root.findall("testsuite")
    c20 = next(c for c in clauses if c.get("name") == "C-20")
    skipped = c20.find("skipped")
    assert skipped is not None and skipped.get("message") == f"not applicable: {NO_WORKER}"
    assert clauses.get("failures") == "1"
    cases = {c.get("name"): c for c in tests}
    assert tests.get("tests") == "3" and tests.get("skipped") == "1"
    assert tests.get("failures") == "1"
    na = cases["test_executes_assigned"].find("skipped")
    assert na is not None and na.get("message") == NO_WORKER
    assert cases["test_executes_assigned"].get("classname") == "inv/test_workers.py"
    failure = cases["test_broke"].find("failure")
    assert failure is not None and failure.get("message", "").startswith("step 4 (step) queues")
    assert cases["test_parity[sync]"].find("skipped") is None


def test_cli_summary_and_rerender_show_the_counts(tmp_path, capsys):
    report = _build(_passed("a::ok", ["C-01"]), _na("a::na", ["C-20"]))
    text = _summary(report)
    assert "2 tests: 1 ran (1 passed, 0 failed, 0 errors), 1 not applicable" in text
    assert f"not applicable a::na: {NO_WORKER}" in text
    paths = write_report(report, tmp_path)
    validate(json.loads(paths["json"].read_text()))  # the file written matches its schema
    assert main(["report", str(paths["json"]), "--out", str(tmp_path / "again")]) == 0
    assert "### Not applicable" in capsys.readouterr().out


# ---- the plugin's per-test entries ------------------------------------------------------


def _report(longrepr, outcome="failed", when="call", **extra):
    return SimpleNamespace(longrepr=longrepr, outcome=outcome, when=when, **extra)


class _Repr:
    """What pytest's ``longrepr`` offers ``_first_line``: a crash message and the full text."""

    def __init__(self, message: str, text: str) -> None:
        self.reprcrash = SimpleNamespace(message=message)
        self._text = text

    def __str__(self) -> str:
        return self._text


def test_skip_reason_comes_from_the_longrepr_tuple():
    rep = _report(("inv/test_workers.py", 41, "Skipped: subject 'x' provides no real worker"))
    assert _skip_reason(rep) == "subject 'x' provides no real worker"
    assert _skip_reason(_report(None, wasxfail="known bug")) == "expected failure: known bug"


@pytest.mark.parametrize(
    ("message", "text", "want"),
    [
        # hypothesis appends its boilerplate to the exception's own message
        (
            "AssertionError: C-06: subject: 3 free blocks, expected 14\nFalsifying example:\n"
            "state = M()\nstate.add(...)\n\nYou can reproduce this example by ...",
            "",
            "AssertionError: C-06: subject: 3 free blocks, expected 14",
        ),
        # a rewritten assert: the type is AssertionError
        ("assert 1 == 2\n +  where 1 = f()", "", "AssertionError: assert 1 == 2"),
        # a bare AssertionError: the message is found in the E lines
        (
            "AssertionError",
            "    raise X\nE   AssertionError\nE   leaked omni state for r3",
            "AssertionError: leaked omni state for r3",
        ),
        # a crash message that is only boilerplate: the exception line from the report text
        (
            "Falsifying example:\nstate = M()",
            "E   ValueError: bad block table",
            "ValueError: bad block table",
        ),
        (
            "conformance._core.lockstep.SubjectBroken: first difference at step 3 (step) [sync]: "
            "queues.waiting: upstream=[1] subject=[2]\nFalsifying example:",
            "",
            "first difference at step 3 (step) [sync]: queues.waiting: upstream=[1] subject=[2]",
        ),
    ],
)
def test_failure_headline_leads_with_the_cause(message, text, want):
    assert _first_line(_report(_Repr(message, text))) == want


def test_failure_headline_prefers_the_recorded_first_difference():
    rep = _report(_Repr("AssertionError\nFalsifying example:", ""))
    assert _first_line(rep, DIFF) == (
        'step 4 (step) queues.waiting: upstream=["q2", "q5"] subject=["q5", "q2"]'
    )


@pytest.mark.slow
def test_a_subject_that_cannot_be_loaded_is_one_line_per_test(tmp_path):
    (tmp_path / "test_needs_subject.py").write_text(
        "import pytest\n\n\n"
        "@pytest.mark.clauses('C-01')\n"
        "def test_needs_subject(conformance_subject):\n"
        "    pass\n"
    )
    plugin = [] if _plugin_installed() else ["-p", "conformance.plugin"]
    report_dir = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *plugin, "-o", "addopts=", "-q", "-p", "no:cacheprovider"]
        + ["--conformance-subject", "no_such_runtime_here:subject"]
        + ["--conformance-report-dir", str(report_dir), str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, (proc.stdout + proc.stderr)[-3000:]
    report = json.loads((report_dir / "compat-report.json").read_text())
    (test,) = report["tests"]
    assert test["outcome"] == "error" and test["clauses"] == ["C-01"]
    assert test["message"].startswith("cannot load subject 'no_such_runtime_here:subject': ")
    assert len(test["message"].splitlines()) == 1
