"""``omni-conformance record`` and ``release-diff``: recordings of the installed vLLM's own
schedulers, their determinism, and a diff that finds exactly what differs (and only that).

One small corpus is recorded once per module (5 generated workloads plus one saved trace, sync and
async); the other tests edit copies of it, so the file stays fast. A test that runs another vLLM
release's environment is ``slow``.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from conformance._core import schemas
from conformance._core.machine import PREFIXES, TIGHT
from conformance._core.workload import AddRequest, Step, Trace
from conformance.cli import main
from conformance.release.first_difference import absent_values, iter_field_differences
from conformance.release.record import (
    SCHEMA,
    generate_workload,
    load_recording,
    record,
)
from conformance.release.release_diff import diff_recordings

SIZE = 5


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(t) for t in path.read_text().splitlines()]


def _write(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(x, sort_keys=True) + "\n" for x in lines))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("release-diff")
    traces = root / "traces"
    saved = Trace(
        config=TIGHT,
        ops=[
            AddRequest("a", tuple(range(100, 130)), prefix="sys", max_tokens=4),
            AddRequest("b", tuple(range(100, 110)), prefix="sys", max_tokens=3),
            Step(),
            Step(),
        ],
        prefixes=dict(PREFIXES),
    )
    saved.save(traces / "two-requests.json")
    first = root / "first.jsonl"
    second = root / "second.jsonl"
    record(first, seed=3, size=SIZE, traces=traces)
    record(second, seed=3, size=SIZE, traces=traces)
    return {"root": root, "first": first, "second": second, "traces": traces}


def test_record_writes_both_modes_of_every_workload(corpus: dict[str, Path]) -> None:
    from conformance._core import vllm_compat as vc

    lines = _lines(corpus["first"])
    for line in lines:  # every record the writer wrote matches the recording schema
        schemas.validate("recording", line)
    header = lines[0]
    assert header["schema"] == SCHEMA
    assert header["vllm"] == vc.vllm_version()
    assert header["corpus"]["seed"] == 3 and header["corpus"]["size"] == SIZE
    assert [t["name"] for t in header["corpus"]["traces"]] == ["trace:two-requests"]
    assert header["modes"] == ["sync", "async"] and header["seconds"] >= 0
    names = [line["workload"] for line in lines[1:]]
    assert names == [f"gen-{i:04d}" for i in range(SIZE)] + ["trace:two-requests"]
    absent = frozenset(header["absent_fields"])
    assert absent == {p for t in vc.RECORDED_FIELDS for p in vc.absent_paths(t)}
    for line in lines[1:]:  # a field the header calls absent is in no observation
        for run in line["modes"].values():
            assert not [f for step in run["steps"] for f, _ in absent_values(step, absent)]
    for line in lines[1:]:
        trace = Trace.from_dict(line["trace"])
        for mode in ("sync", "async"):
            run = line["modes"][mode]
            if "not_applicable" in run:  # an axis this release cannot run in this mode
                assert run["ops"] == run["steps"] == [] and run["not_applicable"]
                continue
            assert len(run["ops"]) == len(run["steps"]) == len(trace.ops) + run["drain"]
            last = run["steps"][-1]
            assert last["requests"] == {}, "drained: nothing held at the end"
            for step in run["steps"]:
                # Hashes are first-seen labels, never a process's NONE_HASH-chained bytes.
                assert all(h.startswith("#") for _, h in step["block_pool"]["hashed_blocks"])


def test_two_recordings_of_one_release_are_byte_identical(corpus: dict[str, Path]) -> None:
    first = corpus["first"].read_text().splitlines()
    second = corpus["second"].read_text().splitlines()
    assert first[1:] == second[1:]
    a, b = json.loads(first[0]), json.loads(second[0])
    for timing in ("seconds", "mode_seconds", "recorded_at"):
        a.pop(timing), b.pop(timing)
    assert a == b


def test_corpus_is_a_function_of_the_seed() -> None:
    assert generate_workload(3, 1).to_dict() == generate_workload(3, 1).to_dict()
    assert generate_workload(3, 1).to_dict() != generate_workload(4, 1).to_dict()


def test_diff_of_a_recording_with_itself_is_identical(
    corpus: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["release-diff", str(corpus["first"]), str(corpus["second"]), "--out", str(tmp_path)])
    assert rc == 0
    assert "identical on 6 workloads (12 runs)" in capsys.readouterr().out
    report = json.loads((tmp_path / "release-diff.json").read_text())
    assert report["status"] == "identical" and report["changes"] == []
    assert "Identical on 6 workloads" in (tmp_path / "release-diff.md").read_text()


def test_a_report_off_its_schema_is_refused_before_it_is_written(
    corpus: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted failure for write_report's own check against release-diff.schema.json."""
    import jsonschema

    from conformance.release import release_diff as rd

    result = diff_recordings(load_recording(corpus["first"]), load_recording(corpus["second"]))
    built = rd.build_report
    monkeypatch.setattr(rd, "build_report", lambda r: {**built(r), "status": "same"})
    with pytest.raises(jsonschema.ValidationError, match="'same' is not one of"):
        rd.write_report(result, tmp_path)
    assert not (tmp_path / "release-diff.json").exists()


def _first_step_with_a_request(line: dict[str, Any], mode: str) -> tuple[int, str] | None:
    run = line["modes"][mode]
    for i, (op, step) in enumerate(zip(run["ops"], run["steps"], strict=True)):
        if op == "step" and step["requests"]:
            return i, sorted(step["requests"])[0]
    return None


def _with_requests(lines: list[dict[str, Any]], mode: str) -> list[tuple[int, int, str]]:
    """(line index, step, request id) of each workload that holds a request after some step."""
    out = []
    for n, line in enumerate(lines[1:], 1):
        found = _first_step_with_a_request(line, mode)
        if found is not None:
            out.append((n, *found))
    assert len(out) >= 2, "the corpus has too few workloads that hold a request after a step"
    return out


def test_an_edited_step_is_found_grouped_and_its_shortest_trace_replays(
    corpus: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Positive control: two edits of one field after a step, in two workloads, are found at
    exactly their step and field, make one change, and its trace is the shorter workload's."""
    from conformance._core.lockstep import run_trace
    from conformance._core.replay import load_trace
    from conformance._core.subjects import UpstreamSubject

    lines = _lines(corpus["first"])
    (n1, s1, r1), (n2, s2, r2) = _with_requests(lines, "sync")[:2]
    edits = [(lines[n1]["workload"], s1, r1), (lines[n2]["workload"], s2, r2)]
    # The later-differing edit goes in first, so "shortest" is not just "first seen".
    edits.sort(key=lambda e: -e[1])
    edited = copy.deepcopy(lines)
    originals = {}
    for name, step, rid in edits:
        line = next(x for x in edited if x.get("workload") == name)
        fields = line["modes"]["sync"]["steps"][step]["requests"][rid]
        originals[name] = fields["num_computed_tokens"]
        fields["num_computed_tokens"] += 1000
    b = _write(tmp_path / "edited.jsonl", edited)

    out = tmp_path / "diff"
    rc = main(["release-diff", str(corpus["first"]), str(b), "--out", str(out)])
    assert rc == 1
    report = json.loads((out / "release-diff.json").read_text())
    found = {
        (d["workload"], d["mode"], d["step"], d["path"]): (d["a"], d["b"])
        for d in report["first_differences"]
    }
    assert found == {
        (name, "sync", step, f"requests.{rid}.num_computed_tokens"): (
            originals[name],
            originals[name] + 1000,
        )
        for name, step, rid in edits
    }
    assert len(report["changes"]) == 1
    change = report["changes"][0]
    assert change["pattern"] == "requests.*.num_computed_tokens" and change["op_kind"] == "step"
    name, step, rid = min(edits, key=lambda e: e[1])
    assert change["shortest"]["workload"] == name and change["shortest"]["length"] == step + 1
    assert "C1: requests.*.num_computed_tokens after step" in capsys.readouterr().out

    # The trace is a workload: it loads, runs on the installed vLLM, and recording it shows the
    # recorded value at the step where the edit was.
    trace_path = out / change["trace"]
    trace = load_trace(trace_path)
    assert len(trace.ops) == step + 1 and trace.config.async_scheduling is False
    assert run_trace(trace, UpstreamSubject()).failure is None
    folder = tmp_path / "change-traces"
    folder.mkdir()
    shutil.copy(trace_path, folder)
    again = tmp_path / "again.jsonl"
    record(again, seed=0, size=0, traces=folder)
    (line,) = _lines(again)[1:]
    assert (
        line["modes"]["sync"]["steps"][step]["requests"][rid]["num_computed_tokens"]
        == (originals[name])
    )


def test_a_field_one_release_lacks_is_not_compared(corpus: dict[str, Path], tmp_path: Path) -> None:
    """An older release's queues (``skipped_waiting``) against this one's: absent fields, not a
    difference; a request missing where the release has the field is a difference."""
    lines = _lines(corpus["first"])
    older = copy.deepcopy(lines)
    mine = set(older[0]["absent_fields"])
    every = {"queues.skipped_waiting", "queues.kv_holding_waiting", "queues.deferred_waiting"}
    older[0]["absent_fields"] = sorted(every - mine)
    for line in older[1:]:
        for run in line["modes"].values():
            for step in run["steps"]:
                queues = step["queues"]
                for f in every - mine:
                    queues.pop(f.split(".", 1)[1], None)
                for f in mine:
                    queues[f.split(".", 1)[1]] = []
    a = _write(tmp_path / "older.jsonl", older)
    result = diff_recordings(load_recording(a), load_recording(corpus["first"]))
    assert result.identical

    n, step, rid = _with_requests(lines, "async")[0]
    name = lines[n]["workload"]
    del older[n]["modes"]["async"]["steps"][step]["requests"][rid]
    _write(a, older)
    result = diff_recordings(load_recording(a), load_recording(corpus["first"]))
    (d,) = result.differences
    assert (d.workload, d.mode, d.step, d.path, d.a) == (
        name,
        "async",
        step,
        f"requests.{rid}",
        "<absent>",
    )


# A step of the older release, and the same step as a newer release records it: a statistics
# field and a KV-event attribute the older release's classes lack, beside fields both have.
_OLD_STEP: dict[str, Any] = {
    "stats": {"num_waiting_reqs": 1},
    "kv_events": [{"events": [{"__kind__": "BlockStored", "block_size": 16}]}],
}
_NEW_STEP: dict[str, Any] = {
    "stats": {"num_waiting_reqs": 1, "ec_connector_stats": None},
    "kv_events": [
        {"events": [{"__kind__": "BlockStored", "block_size": 16, "lookahead_token_ids": None}]}
    ],
}
_NEW_FIELDS = frozenset({"stats.ec_connector_stats", "kv_events.*.events.*.lookahead_token_ids"})


def test_fields_the_older_release_lacks_are_skipped_in_dicts_and_list_items() -> None:
    assert not list(iter_field_differences(_OLD_STEP, _NEW_STEP, _NEW_FIELDS, frozenset()))
    # Without the header's word they are differences, as before.
    found = [".".join(p) for p, _, _ in iter_field_differences(_OLD_STEP, _NEW_STEP)]
    assert found == ["kv_events", "stats.ec_connector_stats"]
    # Skipped only where the release that lacks the field lacks it: the other way round (the
    # newer release named as lacking them) they are still differences.
    swapped = iter_field_differences(_OLD_STEP, _NEW_STEP, frozenset(), _NEW_FIELDS)
    assert [".".join(p) for p, _, _ in swapped] == ["kv_events", "stats.ec_connector_stats"]
    assert dict(absent_values(_NEW_STEP, _NEW_FIELDS)) == {
        "stats.ec_connector_stats": None,
        "kv_events.*.events.*.lookahead_token_ids": None,
    }


def test_a_field_both_releases_have_still_differs_beside_a_new_one() -> None:
    """Planted failure: a changed value of a field both releases have is reported, at its own
    path, in a step where a new field is skipped; inside list items, with the new attribute
    left out of what is shown."""
    new = copy.deepcopy(_NEW_STEP)
    new["stats"]["num_waiting_reqs"] = 2
    new["kv_events"][0]["events"][0]["block_size"] = 32
    found = list(iter_field_differences(_OLD_STEP, new, _NEW_FIELDS, frozenset()))
    assert [(".".join(p), a, b) for p, a, b in found] == [
        (
            "kv_events",
            _OLD_STEP["kv_events"],
            [{"events": [{"__kind__": "BlockStored", "block_size": 32}]}],
        ),
        ("stats.num_waiting_reqs", 1, 2),
    ]
    # A field listed as absent that the older release does record is compared like any other.
    old = copy.deepcopy(_OLD_STEP)
    old["stats"]["ec_connector_stats"] = {"hits": 1}
    found = list(iter_field_differences(old, _NEW_STEP, _NEW_FIELDS, frozenset()))
    assert [(".".join(p), a, b) for p, a, b in found] == [
        ("stats.ec_connector_stats", {"hits": 1}, None)
    ]


def test_a_new_field_is_reported_once_and_hides_no_later_change(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """A field every request of the newer recording has and the older release lacks makes no
    run differ; it is reported once (workloads, runs, values). A change of a field both have,
    later in a run, is that run's first difference."""
    lines = _lines(corpus["first"])
    older, newer = copy.deepcopy(lines), copy.deepcopy(lines)
    older[0]["absent_fields"] = sorted({*older[0]["absent_fields"], "requests.*.brand_new"})
    runs = 0
    for line in newer[1:]:
        for run in line["modes"].values():
            for step in run["steps"]:
                for fields in step["requests"].values():
                    fields["brand_new"] = 7
            runs += any(step["requests"] for step in run["steps"])
    n, step, rid = _with_requests(lines, "sync")[-1]
    a, b = _write(tmp_path / "older.jsonl", older), _write(tmp_path / "newer.jsonl", newer)
    result = diff_recordings(load_recording(a), load_recording(b))
    assert result.identical
    assert result.one_sided["requests.*.brand_new"].runs == runs > 0

    later = newer[n]["modes"]["sync"]["steps"][-2]
    later_step = len(newer[n]["modes"]["sync"]["steps"]) - 2
    later["queues"]["running"] = [*later["queues"]["running"], "planted"]
    _write(b, newer)
    out = tmp_path / "diff"
    assert main(["release-diff", str(a), str(b), "--out", str(out)]) == 1
    report = json.loads((out / "release-diff.json").read_text())
    (d,) = report["first_differences"]
    assert (d["workload"], d["mode"], d["step"], d["path"]) == (
        lines[n]["workload"],
        "sync",
        later_step,
        "queues.running",
    )
    (field,) = report["one_sided_fields"]
    assert field["field"] == "requests.*.brand_new" and field["only_in"] == "b"
    assert field["runs"] == runs and field["examples"] == [7] and field["distinct_values"] == 1
    md = (out / "release-diff.md").read_text()
    assert "## Fields one release lacks" in md and "`requests.*.brand_new`" in md


def test_the_compat_tables_key_each_recorded_field_by_release() -> None:
    """Each table of recorded field paths names the release that added a field, and the
    absent fields of a release are those some release records and it lacks."""
    from conformance._core import vllm_compat as vc

    stats = vc.STATS_FIELDS
    assert "stats.ec_connector_stats" not in stats.at("0.32.0")
    assert "stats.ec_connector_stats" in stats.at("0.33.0")
    assert "stats.num_kv_fetch_reqs_by_stage" in stats.at("0.32.0")
    assert "kv_events.*.events.*.ownership" not in stats.at("0.28.0")
    since = vc.introductions(stats)
    assert since["stats.ec_connector_stats"][0] == "0.33.0"
    assert since["outputs.*.spec_decode_metrics"][0] == "0.29.0"
    assert vc.introductions(vc.QUEUE_FIELDS)["queues.skipped_waiting"][0] == "0.31.0"
    for table in vc.RECORDED_FIELDS:
        for c in table.changes:
            assert c.what and "\n" not in c.what


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_recordings_of_different_corpora_are_refused(
    corpus: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = _lines(corpus["first"])
    other = copy.deepcopy(lines)
    other[0]["corpus"]["seed"] = 4
    b = _write(tmp_path / "seed4.jsonl", other)
    assert main(["release-diff", str(corpus["first"]), str(b), "--out", str(tmp_path / "o")]) == 2
    line = _one_error_line(capsys)
    assert str(b) in line and "'corpus.seed'" in line and "same corpus" in line

    b = _write(tmp_path / "short.jsonl", lines[:-1])
    assert main(["release-diff", str(corpus["first"]), str(b), "--out", str(tmp_path / "o")]) == 2
    line = _one_error_line(capsys)
    assert str(b) in line and "fewer workloads" in line

    other = copy.deepcopy(lines)
    other[2]["trace"]["ops"].append({"op": "step"})
    b = _write(tmp_path / "trace.jsonl", other)
    assert main(["release-diff", str(corpus["first"]), str(b), "--out", str(tmp_path / "o")]) == 2
    line = _one_error_line(capsys)
    assert str(b) in line and lines[2]["workload"] in line and "'trace'" in line


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        ("truncated", "line 3 is not JSON"),
        ("no_modes", "field 'modes' is missing"),
        ("bad_step", "field 'modes.async.steps[0]' should be an object"),
        ("empty", "empty file"),
    ],
)
def test_a_malformed_recording_is_one_line_naming_file_and_field(
    corpus: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    breakage: str,
    expected: str,
) -> None:
    text = corpus["first"].read_text()
    lines = text.splitlines(keepends=True)
    bad = tmp_path / "bad.jsonl"
    if breakage == "truncated":
        bad.write_text("".join(lines[:2]) + lines[2][: len(lines[2]) // 2])
    elif breakage == "empty":
        bad.write_text("")
    else:
        parsed = _lines(corpus["first"])
        if breakage == "no_modes":
            del parsed[0]["modes"]
        else:
            parsed[-1]["modes"]["async"]["steps"][0] = [1, 2]
        _write(bad, parsed)
    rc = main(["release-diff", str(corpus["first"]), str(bad), "--out", str(tmp_path / "o")])
    assert rc == 2
    line = _one_error_line(capsys)
    assert str(bad) in line and expected in line


def test_matrix_report_shows_the_pairs(corpus: dict[str, Path], tmp_path: Path) -> None:
    """The merged report's section lists an identical pair as such and a differing pair's
    changes (the matrix's release-diff output read back, without running environments)."""
    from conformance.release.matrix import (
        RELEASE_DIFF_DIR,
        RELEASE_DIFF_FILE,
        RELEASE_DIFF_SCHEMA,
        release_changes_of,
    )
    from conformance.release.matrix_report import build_matrix_report, render_markdown
    from conformance.release.release_diff import release_diff, summary_entry

    lines = _lines(corpus["first"])
    n, step, rid = _with_requests(lines, "sync")[0]
    lines[n]["modes"]["sync"]["steps"][step]["requests"][rid]["status"] = "PREEMPTED"
    b = _write(tmp_path / "b.jsonl", lines)
    same = release_diff(corpus["first"], corpus["second"], tmp_path / "same")
    other = release_diff(corpus["first"], b, tmp_path / "other")
    folder = tmp_path / RELEASE_DIFF_DIR
    folder.mkdir()
    # Labelled by the releases a matrix would have asked for (both recordings are this one's).
    pairs = [
        {**summary_entry(same, "same"), "from": "0.31.0", "to": "0.32.0"},
        {**summary_entry(other, "other"), "from": "0.32.0", "to": "0.33.0"},
    ]
    document = {"schema": RELEASE_DIFF_SCHEMA, "pairs": pairs}
    (folder / RELEASE_DIFF_FILE).write_text(json.dumps(document))
    changes = release_changes_of(tmp_path)
    report = build_matrix_report([], release_changes=changes)
    schemas.validate("matrix-report", report)  # the pairs fit the merged report's schema
    md = render_markdown(report)
    assert "Upstream changes between releases" in md
    assert "identical on 6 workloads" in md
    assert "requests.*.status after step" in md

    # ``omni-conformance merge`` of that folder (one cell in it) keeps the section.
    from conformance.release import matrix
    from conformance.release.matrix_report import merge

    opts = matrix.MatrixOptions(out=tmp_path, envs_dir=tmp_path / "envs")
    matrix.run_cell(matrix.Cell("picky", "0.33.0", unsupported="no"), None, None, opts)
    merged, paths = merge([tmp_path], tmp_path / "merged")
    assert merged["release_changes"] == changes
    assert "identical on 6 workloads" in paths["markdown"].read_text()


@pytest.mark.slow
def test_a_recording_of_another_release_diffs_against_this_one(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """The 0.32.0 environment (built by the matrix) records the same corpus; the diff runs."""
    from conformance.release.envs import default_envs_dir, env_python

    python = env_python(default_envs_dir() / "vllm-0.32.0")
    if not python.exists():
        pytest.skip("no vllm-0.32.0 environment (omni-conformance matrix builds it)")
    out = tmp_path / "old.jsonl"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1"}
    cmd = [str(python), "-m", "conformance.cli", "record", "--out", str(out), "--seed", "3"]
    cmd += ["--size", str(SIZE), "--traces", str(corpus["traces"])]
    subprocess.run(cmd, cwd=root, env=env, check=True, capture_output=True, timeout=600)
    assert json.loads(out.read_text().splitlines()[0])["vllm"] == "0.32.0"
    result = diff_recordings(load_recording(out), load_recording(corpus["first"]))
    assert len(result.runs) == 2 * (SIZE + 1)


def test_matrix_release_diff_records_each_release_and_diffs_the_pair(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``matrix --release-diff``: one recording per release (here both in this interpreter's
    environment, standing in for two), the pair diffed, the pair in the merged section."""
    import sys

    from conformance.release import matrix
    from conformance.release.envs import Environment, EnvSpec
    from conformance.release.matrix_report import build_matrix_report, render_markdown

    def here(spec: EnvSpec, *args: Any) -> tuple[Environment, None]:
        env = Environment(spec, Path(sys.prefix), Path(sys.executable), "current", current=True)
        return env, None

    def in_process(cmd: list[str], log_path: Path, env: dict[str, str], timeout: float) -> int:
        # The command the matrix runs in an environment, run here (a child interpreter would
        # spend most of this test importing vLLM).
        assert cmd[:3] == [sys.executable, "-m", "conformance.cli"]
        return main(cmd[3:])

    monkeypatch.setattr(matrix, "_environment_for", here)
    monkeypatch.setattr(matrix, "_run_logged", in_process)
    opts = matrix.MatrixOptions(
        out=tmp_path, envs_dir=tmp_path / "envs", release_diff="only", corpus_size=2
    )
    said: list[str] = []
    pairs = matrix.run_release_diff(["0.33.0", "0.32.0"], opts, said.append)
    assert [(p["from"], p["to"]) for p in pairs] == [("0.32.0", "0.33.0")]
    assert pairs[0]["changes"] == ["identical on 2 workloads"]
    folder = tmp_path / matrix.RELEASE_DIFF_DIR
    assert (folder / "recordings" / "vllm-0.32.0.jsonl").is_file()
    assert (folder / "0.32.0--0.33.0" / "release-diff.md").is_file()
    assert matrix.release_changes_of(tmp_path) == pairs
    md = render_markdown(build_matrix_report([], release_changes=pairs))
    assert "vLLM 0.32.0 → 0.33.0" in md and "identical on 2 workloads" in md


def test_record_refuses_bad_input_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    traces = tmp_path / "traces"
    traces.mkdir()
    (traces / "broken.json").write_text('{"format": "omni-conformance-trace/1", "ops": [')
    out = str(tmp_path / "r.jsonl")
    assert main(["record", "--out", out, "--size", "1", "--traces", str(traces)]) == 2
    line = _one_error_line(capsys)
    assert str(traces / "broken.json") in line and "not a valid trace" in line
    assert main(["record", "--out", out, "--size", "0"]) == 2
    assert "--size 0 without --traces" in _one_error_line(capsys)
    assert main(["record", "--out", str(tmp_path), "--size", "1"]) == 2
    assert "is a folder" in _one_error_line(capsys)
    assert not Path(out).exists()


def test_the_corpus_draws_every_scheduler_axis_with_its_request_fields() -> None:
    """Each axis is a corpus variant; its workloads carry the axis's configuration and draw its
    per-request fields (the priority axis: some request has a non-default priority)."""
    from conformance._core.axes import AXES

    seen: dict[str, list[Trace]] = {}
    for i in range(400):
        w = generate_workload(0, i)
        if "axis" in w.meta:
            seen.setdefault(w.meta["axis"], []).append(w)
    assert set(seen) == {a.name for a in AXES}
    for a in AXES:
        for w in seen[a.name]:
            assert all(getattr(w.config, k) == v for k, v in a.changes.items())
        for field, values in a.request_values.items():
            drawn = {getattr(op, field) for w in seen[a.name] for op in w.ops if op.kind == "add"}
            assert drawn - {values[0]}, f"{a.name}: {field} never drawn beyond its default"


def test_an_axis_one_release_cannot_run_is_a_change_without_a_trace(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """Positive control of the axis comparison: a run the other release reports not applicable
    is one change at ``__axis__`` (no trace: nothing to replay); both not applicable is none."""
    from conformance.release.release_diff import AXIS_CHANGE, write_traces

    lines = _lines(corpus["first"])
    older = copy.deepcopy(lines)
    # A workload the installed release runs in sync mode (which axis a workload draws depends
    # on the catalogue, and some axes are not applicable on some releases).
    line = next(x for x in older[1:] if "not_applicable" not in x["modes"]["sync"])
    line["modes"]["sync"] = {"ops": [], "drain": 0, "steps": [], "not_applicable": "absent"}
    a = _write(tmp_path / "older.jsonl", older)
    result = diff_recordings(load_recording(a), load_recording(corpus["first"]))
    assert [c.pattern for c in result.changes] == [AXIS_CHANGE]
    (d,) = result.differences
    assert (d.workload, d.mode, d.a, d.b) == (line["workload"], "sync", "not applicable", "runs")
    write_traces(result, tmp_path / "out")
    assert result.changes[0].trace is None
    newer = copy.deepcopy(older)
    b = _write(tmp_path / "newer.jsonl", newer)
    assert diff_recordings(load_recording(a), load_recording(b)).identical
