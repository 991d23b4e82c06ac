"""The package's one Markdown escaper, one JUnit XML writer, and the schemas that refuse a bad
``cell.json`` and a bad recording line by naming the field.

The escaper replaced two that disagreed: the matrix report's (``<`` as ``&lt;`` in text, a
backtick in code swapped for ``ʼ``) and the release diff's (``<`` left to be read as an HTML tag,
every backtick swapped for ``'``, in text and code alike). What a reader sees is checked by
rendering GitHub-style tables with markdown-it (CommonMark plus GFM tables).
"""

from __future__ import annotations

import html
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import jsonschema
import pytest

from conformance._core import schemas
from conformance._core.render import Case, Suite, environment, junit_xml, md, md_code

# Inputs on which the two old escapers gave different Markdown, and what else a value from a
# test id, an error line or a JSON value can hold.
DISAGREED = ["<cp311>", "a`b", "`edge`", "op `abort` <r1>"]
HARD = ["a|b", "x & y &lt; z", "back\\slash", "two\nlines   here", "a | `b` | c", "``x``", "a\\|b"]


def _shown(value: object) -> tuple[str, str]:
    """What a GFM renderer shows for ``md(value)`` and ``md_code(value)`` in one table row."""
    markdown_it = pytest.importorskip("markdown_it", reason="markdown-it-py renders the tables")
    parser = markdown_it.MarkdownIt("commonmark").enable("table")
    page = parser.render(f"| text | code |\n|---|---|\n| {md(value)} | {md_code(value)} |\n")
    text, code = re.findall(r"<td>(.*?)</td>", page, re.S)
    inner = re.fullmatch(r"<code>(.*)</code>", code, re.S)
    assert inner is not None, f"{md_code(value)!r} is not one code span: {page}"
    assert "<code>" not in text, f"{md(value)!r} opened a code span: {page}"
    return html.unescape(text), html.unescape(inner.group(1))


@pytest.mark.parametrize("value", DISAGREED + HARD)
def test_text_and_code_show_exactly_the_value_on_one_line(value: str) -> None:
    want = " ".join(value.split())
    assert _shown(value) == (want, want)


def test_where_the_old_escapers_disagreed() -> None:
    # text: a tag-like value is an entity, not a tag GitHub would strip; a backtick is escaped,
    # not swapped for a lookalike
    assert md("no wheel <cp311>") == "no wheel &lt;cp311>"
    assert md("a`b") == "a\\`b"
    # code: entities are literal there, so "<" stays; a backtick is kept by a longer fence
    assert md_code("<cp311>") == "`<cp311>`"
    assert md_code("a`b") == "``a`b``"
    assert md_code("`edge`") == "`` `edge` ``"
    # both: one line, and a pipe never ends the table cell
    assert md("a|b\nc") == "a\\|b c" and md_code("a|b") == "`a\\|b`"


def test_only_html_templates_are_autoescaped() -> None:
    # Markdown templates escape through md / md_code; HTML-escaping them too would show "&lt;"
    # where the value has "<" inside code spans.
    autoescape = environment().autoescape
    assert callable(autoescape)
    assert autoescape("matrix-report.html.j2") is True
    for name in ("matrix-report.md.j2", "compat-report.md.j2", "release-diff.md.j2"):
        assert autoescape(name) is False


# ---- JUnit ----------------------------------------------------------------------------------


def _suites() -> list[Suite]:
    return [
        Suite(
            "clauses",
            [
                Case("inv", "C-01", properties={"examples": 3}),
                Case("inv", "C-02", "failure", 'step 4: <x> & "y"', "line 1\nline 2"),
                Case("inv", "C-03", "skipped", "not applicable: no worker", kind="not_applicable"),
            ],
            properties={"subject": "omni"},
            time=1.5,
        ),
        Suite(
            "tests", [Case("m.py", "t", "error", "boom\x1b[31m red", "trace\x00back", time=0.25)]
        ),
    ]


def test_junit_counts_come_from_the_cases_and_text_survives_escaping(tmp_path: Path) -> None:
    path = tmp_path / "r.junit.xml"
    path.write_text(junit_xml(_suites(), name="omni-conformance"), encoding="utf-8")
    root = ET.parse(path).getroot()
    assert root.get("name") == "omni-conformance"
    assert [root.get(k) for k in ("tests", "failures", "errors", "skipped")] == ["4", "1", "1", "1"]
    clauses, tests = root.findall("testsuite")
    assert [clauses.get(k) for k in ("tests", "failures", "errors", "skipped")] == [
        "3",
        "1",
        "0",
        "1",
    ]
    assert clauses.get("time") == "1.500" and tests.get("time") is None
    assert clauses.find("properties/property[@name='subject']").get("value") == "omni"  # type: ignore[union-attr]
    failure = clauses.find("testcase[@name='C-02']/failure")
    assert failure is not None
    assert failure.get("message") == 'step 4: <x> & "y"' and failure.text == "line 1\nline 2"
    skipped = clauses.find("testcase[@name='C-03']/skipped")
    assert skipped is not None and skipped.get("type") == "not_applicable" and skipped.text is None
    assert clauses.find("testcase[@name='C-01']/properties/property").get("value") == "3"  # type: ignore[union-attr]
    error = tests.find("testcase/error")
    assert error is not None and tests.find("testcase").get("time") == "0.250"  # type: ignore[union-attr]
    # characters XML cannot hold (a colour code, a NUL) are replaced, so the file still parses
    assert error.get("message") == "boom\ufffd[31m red" and error.text == "trace\ufffdback"


def test_junit_refuses_an_unknown_result() -> None:
    with pytest.raises(ValueError, match="'skip'"):
        Case("c", "n", "skip")


def test_junit_of_no_suite_is_an_empty_document() -> None:
    root = ET.fromstring(junit_xml([]))
    assert root.tag == "testsuites" and root.get("tests") == "0" and list(root) == []


# ---- schemas --------------------------------------------------------------------------------

CELL = {
    "schema": "omni-conformance-matrix-cell/1",
    "subject": "omni",
    "vllm": "0.33.0",
    "status": "pass",
    "finished_at": "2025-06-01T10:00:00+00:00",
    "upstream_tests": {"passed": 1, "failing": []},
}


@pytest.mark.parametrize(
    ("change", "field", "says"),
    [
        ({"status": "passed"}, "status", "'passed' is not one of pass, fail"),
        ({"vllm": " "}, "vllm", "not a non-blank name"),
        ({"finished_at": "2025-13-01T10:00:00Z"}, "finished_at", "not an ISO 8601 time"),
        ({"exit_code": 1.5}, "exit_code", "should be an integer or null, got number"),
        ({"upstream_tests": {"failing": ["a", 3]}}, "upstream_tests.failing[1]", "a string"),
        ({"environment": {"vllm": 33}}, "environment.vllm", "should be a string"),
    ],
)
def test_a_bad_cell_is_refused_naming_the_field(change: dict, field: str, says: str) -> None:
    assert schemas.problem("matrix-cell", CELL) is None
    found = schemas.problem("matrix-cell", {**CELL, **change})
    assert found is not None and found.field == field and says in found.text
    with pytest.raises(jsonschema.ValidationError):
        schemas.validate("matrix-cell", {**CELL, **change})


def test_a_missing_cell_field_is_named() -> None:
    found = schemas.problem("matrix-cell", {k: v for k, v in CELL.items() if k != "vllm"})
    assert found is not None and str(found) == "field 'vllm' is missing"


RUN = {"ops": ["add r0", "step"], "drain": 1, "steps": [{}, {"queues": {}}]}
WORKLOAD = {"workload": "gen-0000", "source": "generated", "trace": {}, "modes": {"sync": RUN}}


@pytest.mark.parametrize(
    ("line", "text"),
    [
        (
            {**WORKLOAD, "modes": {"sync": {**RUN, "steps": [{}, []]}}},
            "field 'modes.sync.steps[1]' should be an object, got array",
        ),
        (
            {**WORKLOAD, "modes": {"sync": {**RUN, "drain": -1}}},
            "field 'modes.sync.drain' must be >= 0, got -1",
        ),
        ({**WORKLOAD, "modes": {"fast": RUN}}, "field 'modes': 'fast' is not one of sync, async"),
        (
            {**WORKLOAD, "source": "elsewhere"},
            "field 'source': 'elsewhere' is not 'generated' or 'trace:FILE'",
        ),
        ({k: v for k, v in WORKLOAD.items() if k != "trace"}, "field 'trace' is missing"),
        ({"schema": "omni-conformance-recording/1", "vllm": "0.33.0"}, "field 'torch' is missing"),
    ],
)
def test_a_bad_recording_line_is_refused_naming_the_field(line: dict, text: str) -> None:
    assert schemas.problem("recording", WORKLOAD) is None
    assert text in str(schemas.problem("recording", line))


def test_the_reader_names_file_line_and_field_of_a_bad_recording(tmp_path: Path) -> None:
    from conformance.release.record import RecordingError, load_recording

    header = {
        "schema": "omni-conformance-recording/1",
        **dict.fromkeys(("vllm", "torch", "python"), "x"),
        "pythonhashseed": "0",
        "corpus": {"seed": 0, "size": 1, "traces": [], "digest": "0" * 64},
        "config": {},
        "modes": ["sync"],
        "max_drain": 300,
        "absent_fields": [],
        "seconds": 0.5,
    }
    bad = {**WORKLOAD, "modes": {"sync": {**RUN, "ops": ["add r0", 7]}}}
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in (header, WORKLOAD)))
    assert list(load_recording(path).workloads) == ["gen-0000"]
    path.write_text("".join(json.dumps(x) + "\n" for x in (header, bad)))
    with pytest.raises(RecordingError) as info:
        load_recording(path)
    assert str(info.value) == (
        f"{path}: line 2 (workload gen-0000): field 'modes.sync.ops[1]' should be a string, "
        "got integer"
    )


SCHEMA_NAMES = sorted(
    p.name.removesuffix(".schema.json") for p in schemas.SCHEMA_DIR.glob("*.json")
)


def test_the_schema_folder_holds_every_report_file_s_schema() -> None:
    assert SCHEMA_NAMES == [
        "compat-report",
        "matrix-cell",
        "matrix-report",
        "reach",
        "recording",
        "release-diff",
        "release-diff-pairs",
    ]


PAIRS = {
    "schema": "omni-conformance-release-diffs/1",
    "pairs": [
        {"from": "0.32.0", "to": "0.33.0", "changes": ["identical on 8 workloads"]},
        {"from": "0.31.0", "to": "0.32.0", "changes": [{"id": "R1", "summary": "R1: x"}]},
    ],
}


@pytest.mark.parametrize(
    "change, says",
    [
        ({"to": None}, "field 'pairs[0].to'"),
        ({"changes": [7]}, "field 'pairs[0].changes[0]'"),
        ({"from": ""}, "field 'pairs[0].from'"),
    ],
)
def test_a_bad_release_pair_is_refused_naming_the_field(change: dict, says: str) -> None:
    assert schemas.problem("release-diff-pairs", PAIRS) is None
    bad = {**PAIRS, "pairs": [{**PAIRS["pairs"][0], **change}, PAIRS["pairs"][1]]}
    assert says in str(schemas.problem("release-diff-pairs", bad))


def test_the_merge_refuses_a_pairs_file_its_schema_does_not_allow(tmp_path: Path) -> None:
    from conformance.release.matrix_cells import CellError
    from conformance.release.matrix_report import RELEASE_DIFF_PAIRS, release_changes_in

    assert release_changes_in(tmp_path) == []  # the section is optional
    path = tmp_path / RELEASE_DIFF_PAIRS
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(PAIRS))
    assert [p["from"] for p in release_changes_in(tmp_path)] == ["0.32.0", "0.31.0"]
    path.write_text(json.dumps({**PAIRS, "pairs": [{"from": "0.32.0", "changes": []}]}))
    with pytest.raises(CellError) as info:
        release_changes_in(tmp_path)
    assert str(info.value) == f"{path}: field 'pairs[0].to': is missing"


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_every_schema_is_a_valid_json_schema(name: str) -> None:
    schema = schemas.load(name)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert str(schema["$id"]).endswith(f"/{name}.schema.json")
