"""``omni-conformance check`` is the project's CI gate: it must fail, loudly and precisely.

Run end to end (a real ``pytest -m invariants`` subprocess on the installed suite) against a
planted broken subject given as ``module:attr``: the exit code is non-zero, the output names the
first difference (field path), the compat report is written in all three formats and validates
against its schema, and the failing trace is saved where ``replay`` finds it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance._core.report import validate
from conformance.cli import main

pytestmark = pytest.mark.clauses("C-01", "C-03")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_check_fails_on_a_broken_subject_and_names_the_first_difference(
    tmp_path, capsys, run_check
):
    run = run_check(
        tmp_path,
        "tests.mutants.harness_mutants:forward_free",
        tests=(str(ROOT / "invariants" / "test_ar_inv_001_lockstep.py"),),
        pytest_args=("-x",),
        extra_env={"OMNI_CONFORMANCE_SHRINK_SECONDS": "5"},
    )
    report_dir, failures, out = run.report_dir, run.failures_dir, run.output
    assert run.returncode != 0, out[-3000:]
    assert "first difference" in out and "block_pool.free_order" in out, out[-3000:]
    report = json.loads((report_dir / "compat-report.json").read_text())
    validate(report)
    assert report["status"] == "fail"
    assert report["subject"] == "tests.mutants.harness_mutants:forward_free"
    assert {"vllm", "torch", "python"} <= set(report["environment"])
    inv = {i["id"]: i for i in report["invariants"]}
    assert inv["AR-INV-001"]["status"] == "fail"
    assert (report_dir / "compat-report.md").read_text().startswith("## omni-conformance: FAIL")
    assert "<failure" in (report_dir / "compat-report.junit.xml").read_text()
    saved = sorted(failures.glob("*.json"))
    assert saved, "no failure trace written"
    # Replayed in this process (another process wrote it): the same first difference.
    assert main(["replay", str(saved[0])]) == 1
    replayed = capsys.readouterr().out
    assert "block_pool.free_order" in replayed
    assert json.loads(saved[0].read_text())["meta"]["first_difference"]["path"] in replayed


def test_a_test_interrupted_before_its_call_ended_is_not_counted_passed() -> None:
    """The partial report of an interrupted run: a test whose setup passed but whose call never
    reported is 'pending' while the run goes on, and never becomes 'passed'."""
    import pytest as _pytest

    from conformance.plugin import _CLAUSES_PROP, ConformanceSession

    session = ConformanceSession(config=None)  # type: ignore[arg-type]

    def report(nodeid: str, when: str) -> _pytest.TestReport:
        return _pytest.TestReport(
            nodeid,
            ("x.py", 0, nodeid),
            {},
            "passed",
            None,
            when,
            user_properties=[(_CLAUSES_PROP, ["C-01"])],
        )

    session.pytest_runtest_logreport(report("t::done", "setup"))
    session.pytest_runtest_logreport(report("t::done", "call"))
    session.pytest_runtest_logreport(report("t::cut", "setup"))
    assert session.tests["t::done"]["outcome"] == "passed"
    assert session.tests["t::cut"]["outcome"] == "pending"
