"""The merged matrix report: cells of a vLLM-version × subject matrix become one report.

Synthetic cell folders (the layout ``omni-conformance matrix`` writes: ``cells/<subject>--vllm-
<version>/cell.json`` plus the check's compat report, built here with the real ``ReportBuilder``)
cover every cell status, an untested vLLM, a cell copied from two machines and an interrupted
matrix. Nothing here imports vLLM or runs the gate.
"""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from conformance._core import schemas
from conformance._core.report import ReportBuilder, TestRecord, write_report
from conformance._core.report import validate as validate_compat_report
from conformance.cli import main
from conformance.release.matrix_cells import CELL_SCHEMA_ID
from conformance.release.matrix_report import (
    build_matrix_report,
    load_cells,
    render_html,
    render_junit,
    render_markdown,
    sort_versions,
    write_matrix_report,
)

DIFF = {
    "step": 7,
    "op": "step",
    "path": "scheduled.num_scheduled_tokens",
    "upstream": {"r1": 16, "r2": 4},
    "subject": {"r1": 16, "r2": 5},
    "request_id": "r2",
    "mode": "sync",
    "not_applicable": [],
}
TRACE_NAME = "test_scheduler_parity-1a2b.json"
ERROR_LINE = "environment build failed: no wheel for vllm-omni==0.28.0 <cp311>"
UNSUPPORTED_LINE = "omni supports vLLM 0.33 only"


def _compat_report(cell_dir: Path, subject: str, vllm: str, kind: str, trace: str | None = None):
    b = ReportBuilder(
        subject=subject,
        profile="ci",
        seed=0,
        environment={"python": "3.11.7", "vllm": vllm, "torch": "2.13.0"},
    )
    if kind == "not_applicable":
        b.add(
            TestRecord(
                "inv/test_payload.py::test_a", "not_applicable", ["C-10"], reason="no worker"
            )
        )
    else:
        b.add(TestRecord("inv/test_sched.py::test_order", "passed", ["C-03"], examples=3))
        b.add(
            TestRecord(
                "inv/test_payload.py::test_a", "not_applicable", ["C-10"], reason="no worker"
            )
        )
    if kind == "not_applicable":
        pass
    elif kind == "fail":
        b.add(
            TestRecord(
                "inv/test_sched.py::test_parity",
                "failed",
                ["C-01", "C-02"],
                examples=1,
                steps_compared=7,
                first_difference=DIFF,
                trace=trace,
            )
        )
    else:
        b.add(TestRecord("inv/test_sched.py::test_parity", "passed", ["C-01", "C-02"], examples=2))
    report = b.build()
    assert report["status"] == kind
    validate_compat_report(report)  # every file the package writes matches its schema
    write_report(report, cell_dir)


def _cell(
    cells: Path,
    subject: str,
    vllm: str,
    status: str,
    *,
    finished_at: str = "2025-06-01T10:00:00+00:00",
    untested: bool = False,
    error: str | None = None,
    upstream_tests: dict[str, Any] | None = None,
    trace: str | None = None,
    **overrides: Any,
) -> Path:
    d = cells / f"{subject}--vllm-{vllm}"
    d.mkdir(parents=True)
    (d / "cell.log").write_text("log\n")
    has_report = status in ("pass", "fail", "not_applicable")
    if has_report:
        _compat_report(d, subject, vllm, status, trace)
    data = {
        "schema": CELL_SCHEMA_ID,
        "subject": subject,
        "vllm": vllm,
        "extras": [],
        "environment": {"python": "3.11.7", "vllm": vllm, "torch": "2.13.0"} if has_report else {},
        "status": status,
        "untested_vllm": untested,
        "exit_code": {"pass": 0, "not_applicable": 0, "fail": 1}.get(status, 2),
        "duration_s": 61.2,
        "started_at": "2025-06-01T09:59:00+00:00",
        "finished_at": finished_at,
        "error": error,
        "log": "cell.log",
        "report": "compat-report.json" if has_report else None,
        "upstream_tests": upstream_tests,
        **overrides,
    }
    schemas.validate("matrix-cell", data)
    (d / "cell.json").write_text(json.dumps(data, indent=2))
    return d


@pytest.fixture()
def matrix(tmp_path: Path) -> dict[str, Path]:
    """A matrix output folder with every kind of cell, and a newer copy of one cell from a second
    machine."""
    out = tmp_path / "matrix-out"
    cells = out / "cells"
    upstream_tests = {
        "passed": 40,
        "failed": 2,
        "skipped": 3,
        "errors": 0,
        "total": 45,
        "failing": [
            "tests/v1/core/test_scheduler.py::test_new",
            "tests/v1/core/test_x.py::test_old",
        ],
        "baseline_failing": ["tests/v1/core/test_x.py::test_old"],
        "duration_s": 12.5,
    }
    _cell(cells, "upstream", "0.28.0", "pass", upstream_tests=upstream_tests)
    _cell(cells, "upstream", "0.10.0", "pass", untested=True)
    _cell(cells, "upstream", "0.9.0", "not_applicable")
    # The trace as the check recorded it on the CI runner: an absolute path of that machine.
    recorded = (
        f"/home/runner/work/x/matrix-out/cells/omni--vllm-0.28.0/conformance-failures/{TRACE_NAME}"
    )
    # fields the merge does not know (the matrix's env record) are tolerated, not refused
    env = {"path": "/home/runner/.cache/envs/vllm-0.28.0", "installer": "uv", "reused": False}
    fail = _cell(cells, "omni", "0.28.0", "fail", trace=recorded, env=env)
    (fail / "conformance-failures").mkdir()
    (fail / "conformance-failures" / TRACE_NAME).write_text("{}")
    _cell(cells, "omni", "0.9.0", "unsupported", error=UNSUPPORTED_LINE)
    _cell(cells, "omni", "0.10.0", "error", error="stale: superseded by machine b")
    _cell(cells, "vllm-omni", "0.28.0", "error", error=ERROR_LINE)
    _cell(
        tmp_path / "machine-b" / "cells",
        "omni",
        "0.10.0",
        "pass",
        finished_at="2025-06-01T11:30:00Z",
    )
    return {"root": tmp_path, "out": out, "machine_b": tmp_path / "machine-b"}


def _merged(matrix: dict[str, Path]) -> tuple[dict[str, Any], Path]:
    dest = matrix["out"] / "report"
    # machine b first: the newest finished_at wins, not the order of the paths
    cells = load_cells([matrix["machine_b"], matrix["out"]])
    report = build_matrix_report(cells, out_dir=dest)
    write_matrix_report(report, dest)
    return report, dest


def _cell_of(report: dict[str, Any], subject: str, vllm: str) -> dict[str, Any]:
    (found,) = [c for c in report["cells"] if (c["subject"], c["vllm"]) == (subject, vllm)]
    return found


def test_versions_sort_numerically() -> None:
    got = sort_versions(["0.10.0", "main", "0.9", "0.33.0", "0.33.0rc1", "0.9.1", "0.28.0"])
    assert got == ["0.9", "0.9.1", "0.10.0", "0.28.0", "0.33.0rc1", "0.33.0", "main"]


def test_report_matches_schema_and_orders_grid(matrix: dict[str, Path]) -> None:
    report, dest = _merged(matrix)
    schemas.validate("matrix-report", report)
    schemas.validate("matrix-report", json.loads((dest / "matrix-report.json").read_text()))
    assert report["versions"] == ["0.9.0", "0.10.0", "0.28.0"]
    assert report["subjects"] == ["upstream", "omni", "vllm-omni"]
    assert report["status"] == "fail" and report["ok"] is False
    by = report["summary"]["by_status"]
    assert (by["pass"], by["fail"], by["error"], by["unsupported"], by["not_applicable"]) == (
        3,
        1,
        1,
        1,
        1,
    )
    assert report["release_changes"] == []
    rollup = {r["subject"]: r["status"] for r in report["by_subject"]}
    assert rollup == {"upstream": "pass", "omni": "fail", "vllm-omni": "error"}
    assert {v["vllm"]: v["status"] for v in report["by_version"]}["0.9.0"] == "not_applicable"

    fail = _cell_of(report, "omni", "0.28.0")
    assert fail["counts"]["passed"] == 1 and fail["counts"]["failed"] == 1
    first = fail["failures"][0]
    assert first["first_difference"]["path"] == DIFF["path"]
    assert first["trace_found"] is True
    up = _cell_of(report, "upstream", "0.28.0")["upstream_tests"]
    assert up["new_failing"] == ["tests/v1/core/test_scheduler.py::test_new"]


def test_duplicate_cell_newest_finished_at_wins(matrix: dict[str, Path]) -> None:
    report, _ = _merged(matrix)
    cell = _cell_of(report, "omni", "0.10.0")
    assert cell["status"] == "pass" and "machine-b" in cell["path"]
    (dup,) = report["duplicates"]
    assert dup["used"]["finished_at"] == "2025-06-01T11:30:00Z"
    assert [s["status"] for s in dup["superseded"]] == ["error"]
    assert "found more than once" in render_markdown(report)


def test_paths_are_relative_to_the_report_and_survive_a_copy(
    matrix: dict[str, Path], tmp_path: Path
) -> None:
    report, dest = _merged(matrix)
    text = (dest / "matrix-report.json").read_text()
    assert str(matrix["root"]) not in text
    fail = _cell_of(report, "omni", "0.28.0")
    assert fail["path"] == "../cells/omni--vllm-0.28.0"
    assert fail["report"] == "../cells/omni--vllm-0.28.0/compat-report.json"
    assert fail["failures"][0]["trace"] == (
        f"../cells/omni--vllm-0.28.0/conformance-failures/{TRACE_NAME}"
    )
    moved = shutil.copytree(matrix["root"], tmp_path.parent / f"{tmp_path.name}-copy")
    copied = json.loads((moved / "matrix-out" / "report" / "matrix-report.json").read_text())
    base = moved / "matrix-out" / "report"
    for cell in copied["cells"]:
        assert (base / cell["path"] / "cell.json").is_file()
        assert cell["log"] is None or (base / cell["log"]).is_file()
        for f in cell["failures"]:
            assert (base / f["trace"]).is_file()


def test_markdown_grid_and_details(matrix: dict[str, Path]) -> None:
    report, dest = _merged(matrix)
    md = (dest / "matrix-report.md").read_text()
    assert md == render_markdown(report)
    header = next(line for line in md.splitlines() if line.startswith("| subject |"))
    assert header.index("vLLM 0.9.0") < header.index("vLLM 0.10.0") < header.index("vLLM 0.28.0")
    rows = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| **")}
    cells = [c.strip() for c in rows["**omni**"].split("|")[2:5]]
    assert cells == ["⛔ unsupported", "✅ pass 2/2", "❌ fail 1/2"]
    upstream = [c.strip() for c in rows["**upstream**"].split("|")[2:5]]
    assert upstream == ["➖ n/a", "✅ pass 2/2 🧪", "✅ pass 2/2"]
    assert "💥 error" in rows["**vllm-omni**"] and "·" in rows["**vllm-omni**"]
    # the failing cell's first difference: step, op, field and both values
    assert "| 7 | step | `scheduled.num_scheduled_tokens` |" in md
    assert '`{"r1": 16, "r2": 4}`' in md and '`{"r1": 16, "r2": 5}`' in md
    assert f"conformance-failures/{TRACE_NAME}" in md
    assert "no wheel for vllm-omni==0.28.0 &lt;cp311>" in md and UNSUPPORTED_LINE in md
    assert "### Upstream tests" in md and "test_scheduler.py::test_new" in md
    assert "test_x.py::test_old" not in md.split("### Upstream tests")[1].split("###")[0]
    assert "Upstream changes between releases" not in md


def test_long_values_are_truncated(matrix: dict[str, Path]) -> None:
    report, _ = _merged(matrix)
    fail = _cell_of(report, "omni", "0.28.0")
    fail["failures"][0]["first_difference"]["upstream"] = list(range(500))
    md = render_markdown(report)
    line = next(x for x in md.splitlines() if x.startswith("| 7 | step"))
    assert "…" in line and len(line) < 400


def test_html_is_one_self_contained_page(matrix: dict[str, Path]) -> None:
    report, dest = _merged(matrix)
    page = (dest / "matrix-report.html").read_text()
    assert page == render_html(report)
    assert "<script" not in page and "<link" not in page
    assert "http://" not in page and "https://" not in page and "@import" not in page
    assert "<style>" in page
    assert 'class="cell fail"' in page and 'class="cell pass untested"' in page
    assert "⛔ unsupported" in page and "💥 error" in page
    assert "&lt;cp311&gt;" in page and "<cp311>" not in page  # escaped text
    assert "scheduled.num_scheduled_tokens" in page and TRACE_NAME in page
    assert "Upstream tests" in page and "test_scheduler.py::test_new" in page
    assert report["generated_at"] in page
    assert "legend" in page


def _n(element: ET.Element | None, attr: str) -> int:
    assert element is not None
    return int(element.get(attr) or -1)


def test_junit_one_suite_per_cell_failures_counted_once(matrix: dict[str, Path]) -> None:
    report, dest = _merged(matrix)
    root = ET.fromstring((dest / "matrix-report.junit.xml").read_text())
    suites = root.findall("testsuite")
    assert len(suites) == len(report["cells"]) == 7
    for attr in ("tests", "failures", "errors", "skipped"):
        assert _n(root, attr) == sum(_n(s, attr) for s in suites)
    assert _n(root, "failures") == len(list(root.iter("failure")))
    assert _n(root, "errors") == len(list(root.iter("error")))
    by_name = {s.get("name"): s for s in suites}
    fail = by_name["omni-conformance[omni @ vLLM 0.28.0]"]
    failed = [c.get("name") for c in fail.iter("testcase") if c.find("failure") is not None]
    assert failed == ["C-01", "C-02"]  # one failure per failing clause, none per test on top
    assert _n(fail, "failures") == 2
    assert fail.find("testcase[@name='C-10']/skipped") is not None
    errored = by_name["omni-conformance[vllm-omni @ vLLM 0.28.0]"]
    (case,) = errored.findall("testcase")
    error = case.find("error")
    assert error is not None and error.get("message") == ERROR_LINE
    unsupported = by_name["omni-conformance[omni @ vLLM 0.9.0]"]
    (case,) = unsupported.findall("testcase")
    assert case.find("skipped") is not None and _n(unsupported, "failures") == 0
    assert _n(root, "failures") == 2 and _n(root, "errors") == 1
    assert render_junit(report) == (dest / "matrix-report.junit.xml").read_text()


def test_a_report_built_elsewhere_is_re_anchored_where_it_is_written(
    matrix: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # as `omni-conformance matrix` does: build without out_dir, write into the output folder
    monkeypatch.chdir(matrix["root"])
    report = build_matrix_report(load_cells([matrix["out"] / "cells"]))
    assert _cell_of(report, "omni", "0.28.0")["path"] == "matrix-out/cells/omni--vllm-0.28.0"
    write_matrix_report(report, matrix["out"])
    written = json.loads((matrix["out"] / "matrix-report.json").read_text())
    schemas.validate("matrix-report", written)
    fail = _cell_of(written, "omni", "0.28.0")
    assert fail["path"] == "cells/omni--vllm-0.28.0"
    assert (matrix["out"] / fail["failures"][0]["trace"]).is_file()
    assert written["sources"] == ["cells"]
    md = (matrix["out"] / "matrix-report.md").read_text()
    assert "`cells/omni--vllm-0.28.0/compat-report.json`" in md


def test_release_changes_render_only_when_present(matrix: dict[str, Path]) -> None:
    cells = load_cells([matrix["out"]])
    changes = [{"from": "0.9.0", "to": "0.10.0", "changes": ["Scheduler.schedule split", {"x": 1}]}]
    report = build_matrix_report(cells, out_dir=matrix["out"], release_changes=changes)
    schemas.validate("matrix-report", report)
    assert "Scheduler.schedule split" in render_markdown(report)
    assert "Scheduler.schedule split" in render_html(report)


def test_a_pass_without_its_report_is_not_shown_as_pass(tmp_path: Path) -> None:
    d = _cell(tmp_path / "cells", "omni", "0.33.0", "pass")
    (d / "compat-report.json").unlink()
    report = build_matrix_report(load_cells([tmp_path]), out_dir=tmp_path)
    schemas.validate("matrix-report", report)
    cell = _cell_of(report, "omni", "0.33.0")
    assert cell["status"] == "incomplete" and any("missing" in n for n in cell["notes"])


def test_a_compat_report_the_merge_cannot_read_is_a_note(tmp_path: Path) -> None:
    d = _cell(tmp_path / "cells", "omni", "0.33.0", "pass")
    (d / "compat-report.json").write_text(json.dumps({"summary": {}, "failures": [1]}))
    report = build_matrix_report(load_cells([tmp_path]), out_dir=tmp_path)
    schemas.validate("matrix-report", report)
    cell = _cell_of(report, "omni", "0.33.0")
    assert cell["status"] == "incomplete" and "not one this merge can read" in cell["notes"][0]
    assert "does not match its schema: field 'schema' is missing" in cell["notes"][0]
    assert "not one this merge can read" in render_markdown(report)


def test_the_matrix_does_not_write_a_cell_the_merge_would_refuse(tmp_path: Path) -> None:
    from conformance.release.matrix import _write_cell
    from conformance.release.matrix_report import CellError

    good = {"schema": CELL_SCHEMA_ID, "subject": "omni", "vllm": "0.33.0", "status": "pass"}
    with pytest.raises(CellError, match="field 'status': 'passed' is not one of"):
        _write_cell(tmp_path, {**good, "status": "passed"})
    assert not (tmp_path / "cell.json").exists()
    _write_cell(tmp_path, good)
    assert len(load_cells([tmp_path]).cells) == 1


# ---- the merge command ----------------------------------------------------------------------


def test_merge_exits_1_on_failures_and_writes_four_files(matrix, capsys) -> None:
    dest = matrix["root"] / "merged"
    rc = main(["merge", str(matrix["out"]), str(matrix["machine_b"]), "--out", str(dest)])
    out = capsys.readouterr().out
    assert rc == 1
    for name in ("json", "md", "junit.xml", "html"):
        assert (dest / f"matrix-report.{name}").is_file()
        assert f"matrix-report.{name}" in out
    assert "FAIL" in out and "unsupp." in out and "pass*" in out
    assert len(out.splitlines()) < 20


def test_merge_exits_0_when_every_cell_passed_or_does_not_apply(tmp_path, capsys) -> None:
    cells = tmp_path / "cells"
    _cell(cells, "upstream", "0.33.0", "pass")
    _cell(cells, "omni", "0.33.0", "not_applicable")
    _cell(cells, "omni", "0.32.0", "unsupported", error=UNSUPPORTED_LINE)
    assert main(["merge", str(cells), "--out", str(tmp_path / "r")]) == 0
    assert "PASS" in capsys.readouterr().out


def test_merge_single_cell_folder(tmp_path, capsys) -> None:
    d = _cell(tmp_path / "cells", "upstream", "0.33.0", "pass")
    assert main(["merge", str(d), "--out", str(tmp_path / "r")]) == 0
    capsys.readouterr()


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in captured.err, captured
    return err


def test_merge_exits_2_when_no_cell_is_found(tmp_path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["merge", str(tmp_path / "empty"), "--out", str(tmp_path / "r")]) == 2
    assert "no cell.json found" in _one_line_error(capsys)
    assert main(["merge", str(tmp_path / "missing"), "--out", str(tmp_path / "r")]) == 2
    assert "no such file or folder" in _one_line_error(capsys)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"status": "passed"}, "status"),
        ({"subject": ""}, "subject"),
        ({"schema": "omni-conformance-matrix-cell/9"}, "schema"),
        ({"untested_vllm": "no"}, "untested_vllm"),
        ({"finished_at": "yesterday"}, "finished_at"),
        ({"upstream_tests": {"passed": -1}}, "upstream_tests.passed"),
    ],
)
def test_merge_names_file_and_field_of_a_malformed_cell(tmp_path, capsys, change, field) -> None:
    _cell(tmp_path / "cells", "upstream", "0.33.0", "pass")
    bad = _cell(tmp_path / "cells", "omni", "0.33.0", "pass")
    data = json.loads((bad / "cell.json").read_text())
    (bad / "cell.json").write_text(json.dumps({**data, **change}))
    assert main(["merge", str(tmp_path / "cells"), "--out", str(tmp_path / "r")]) == 2
    err = _one_line_error(capsys)
    assert str(bad / "cell.json") in err and f"field {field!r}" in err
    assert not (tmp_path / "r").exists()


def test_merge_names_a_cell_json_that_is_not_json(tmp_path, capsys) -> None:
    d = _cell(tmp_path / "cells", "upstream", "0.33.0", "pass")
    (d / "cell.json").write_text('{"schema": ')
    assert main(["merge", str(tmp_path), "--out", str(tmp_path / "r")]) == 2
    err = _one_line_error(capsys)
    assert str(d / "cell.json") in err and "not valid JSON" in err
    (d / "cell.json").write_text("[]")
    assert main(["merge", str(tmp_path), "--out", str(tmp_path / "r")]) == 2
    assert "not a JSON object" in _one_line_error(capsys)


def test_interrupted_matrix_merges_what_finished(tmp_path, capsys) -> None:
    cells = tmp_path / "matrix-out" / "cells"
    _cell(cells, "upstream", "0.32.0", "pass")
    _cell(cells, "upstream", "0.33.0", "pass")
    running = cells / "omni--vllm-0.33.0"
    running.mkdir()
    (running / "cell.log").write_text("building the environment...\n")
    (cells / "omni--vllm-0.32.0" / "venv").mkdir(parents=True)  # not started beyond its env
    (cells / "omni--vllm-0.32.0" / "venv" / "pyvenv.cfg").write_text("home = /usr\n")

    dest = tmp_path / "report"
    assert main(["merge", str(tmp_path / "matrix-out"), "--out", str(dest)]) == 1
    out = capsys.readouterr().out
    assert "pending" in out and "unfinished" in out
    report = json.loads((dest / "matrix-report.json").read_text())
    schemas.validate("matrix-report", report)
    assert [c["id"] for c in report["cells"]] == ["upstream--vllm-0.32.0", "upstream--vllm-0.33.0"]
    assert {u["id"] for u in report["unfinished"]} == {"omni--vllm-0.32.0", "omni--vllm-0.33.0"}
    assert report["status"] == "incomplete" and report["summary"]["by_status"]["pending"] == 2
    assert "⏳ pending" in (dest / "matrix-report.md").read_text()
    assert "has no cell.json yet" in (dest / "matrix-report.html").read_text()
    junit = ET.fromstring((dest / "matrix-report.junit.xml").read_text())
    assert len(junit.findall("testsuite")) == 4 and junit.get("failures") == "0"


def test_unfinished_folder_finished_on_another_machine_is_not_pending(tmp_path) -> None:
    (tmp_path / "a" / "cells" / "omni--vllm-0.33.0").mkdir(parents=True)
    _cell(tmp_path / "b" / "cells", "omni", "0.33.0", "pass")
    cells = load_cells([tmp_path / "a", tmp_path / "b"])
    assert cells.unfinished == [] and len(cells.cells) == 1


def test_overlapping_inputs_are_not_duplicates(matrix) -> None:
    cells = load_cells([matrix["out"], matrix["out"] / "cells"])
    assert cells.duplicates == [] and len(cells.cells) == 7


def test_ci_artifact_layout_merges(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # download-artifact puts each artifact (named after its cell) in a folder of its own
    downloaded = tmp_path / "matrix-cells"
    _cell(downloaded / "matrix-cell-upstream--vllm-0.33.0", "upstream", "0.33.0", "pass")
    _cell(downloaded / "matrix-cell-omni--vllm-0.33.0", "omni", "0.33.0", "pass")
    (downloaded / "matrix-cell-omni--vllm-0.32.0" / "omni--vllm-0.32.0").mkdir(parents=True)
    assert main(["merge", str(downloaded), "--out", str(tmp_path / "matrix-report")]) == 1
    capsys.readouterr()
    report = json.loads((tmp_path / "matrix-report" / "matrix-report.json").read_text())
    assert report["subjects"] == ["upstream", "omni"]
    assert [u["id"] for u in report["unfinished"]] == ["omni--vllm-0.32.0"]
    assert (
        report["cells"][0]["path"]
        == "../matrix-cells/matrix-cell-upstream--vllm-0.33.0/upstream--vllm-0.33.0"
    )
