"""Bad input to either command is one line on stderr and exit code 2, never a traceback.

Each case is a mistake a user makes: a pipeline file with a cycle, an unknown stage, a missing
model folder or a field of the wrong type; an output path whose folder is a file; a token limit
below one; a trace that is truncated or written by a newer harness; a subject that is not one; an
unknown profile; a report folder that cannot be written; a "report" that is not one. The commands run in this process (``main(argv)``), so the table
costs no interpreter starts; each case asserts the exit code, that stderr is exactly one line
naming the offending field or path, and that no stage ran (no WAV, no report).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conformance import cli as gate_cli
from omni_runtime import cli as runtime_cli

DEFAULT = json.loads(
    (Path(runtime_cli.__file__).parent / "configs" / "default_pipeline.json").read_text()
)
TRACE = Path(__file__).parent / "data" / "vllm_omni" / "preempted-in-flight-token-dropped.json"


def _pipeline(tmp_path: Path, change: Callable[[dict[str, Any]], None]) -> str:
    data = copy.deepcopy(DEFAULT)
    change(data)
    path = tmp_path / "pipeline.json"
    path.write_text(json.dumps(data))
    return str(path)


def _set(stage: int, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda data: data["stages"][stage].__setitem__(key, value)


# name -> (pipeline change, what the one line must name)
PIPELINES = {
    "cycle (talker feeds the thinker)": (_set(1, "downstream", ["thinker"]), "downstream"),
    "cycle (the decoder feeds back)": (_set(2, "downstream", ["thinker"]), "unknown keys"),
    "unknown stage": (_set(0, "downstream", ["vocoder"]), "'vocoder'"),
    "missing model folder": (_set(0, "model", "/nonexistent/model"), "stages[0].model"),
    "wrong field type": (_set(0, "max_num_seqs", "sixteen"), "stages[0].max_num_seqs"),
    "boolean as a count": (_set(1, "block_size", True), "stages[1].block_size"),
    "token id as text": (_set(0, "stop_token_ids", ["2"]), "stages[0].stop_token_ids"),
    "ray resources not an object": (_set(1, "ray_resources", 2), "stages[1].ray_resources"),
    "ray resources, unknown key": (_set(0, "ray_resources", {"cpus": 1}), "unknown keys"),
    "processor that does not exist": (
        _set(0, "chunk_processor", "omni_runtime.sched.processors.NoSuchForwarder"),
        "stages[0] (thinker).chunk_processor",
    ),
    "processor path without a module": (
        _set(1, "chunk_processor", "CodecTokenStreamer"),
        "stages[1] (talker).chunk_processor",
    ),
    "processor that is not callable": (
        _set(0, "chunk_processor", "omni_runtime.config.ADDITIONAL_CONFIG_KEY"),
        "stages[0] (thinker).chunk_processor",
    ),
}


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    # vLLM may log while importing; the command's own output is the last line, and the only
    # one that is ours.
    ours = [line for line in err if line.startswith(("omni-runtime", "omni-conformance"))]
    assert len(ours) == 1, err
    assert not any("Traceback" in line for line in err), err
    return ours[0]


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_a_bad_pipeline_file_is_one_line(name, tmp_path, capsys):
    change, names = PIPELINES[name]
    out = tmp_path / "out.wav"
    argv = ["run", "--prompt", "hi", "--pipeline-config", _pipeline(tmp_path, change)]
    rc = runtime_cli.main([*argv, "--out", str(out)])
    line = _one_line(capsys)
    assert rc == 2, line
    assert line.startswith("omni-runtime: error: ") and names in line, line
    assert not out.exists()


def test_an_output_folder_that_is_a_file_is_refused_before_any_stage_runs(tmp_path, capsys):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    rc = runtime_cli.main(["run", "--prompt", "hi", "--out", str(blocker / "x.wav")])
    line = _one_line(capsys)
    assert rc == 2 and f"{blocker} is a file" in line, line


def test_a_usage_mistake_is_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        runtime_cli.main(["run"])
    assert info.value.code == 2
    assert "--prompt" in _one_line(capsys)
    with pytest.raises(SystemExit) as info:
        gate_cli.main(["check", "--profile", "nope"])
    assert info.value.code == 2
    assert "invalid choice: 'nope'" in _one_line(capsys)


def test_a_ray_address_without_the_ray_backend_is_one_line(capsys):
    rc = runtime_cli.main(["run", "--prompt", "hi", "--ray-address", "127.0.0.1:6379"])
    line = _one_line(capsys)
    assert rc == 2 and "--ray-address needs --backend ray" in line, line


def test_a_ray_address_nobody_answers_is_one_line_not_a_hang(capsys):
    pytest.importorskip("ray")
    # A port nothing listens on: refused at once (Ray itself would retry it for minutes).
    argv = ["run", "--prompt", "hi", "--backend", "ray", "--ray-address", "127.0.0.1:1"]
    rc = runtime_cli.main(argv)
    line = _one_line(capsys)
    assert rc == 2 and "--ray-address 127.0.0.1:1: no Ray cluster answers there" in line, line


@pytest.mark.parametrize("value", ["-3", "0", "many"])
def test_a_token_limit_below_one_is_one_line(value, capsys):
    with pytest.raises(SystemExit) as info:
        runtime_cli.main(["run", "--prompt", "hi", "--max-codec-tokens", value])
    assert info.value.code == 2
    line = _one_line(capsys)
    assert "--max-codec-tokens" in line and "at least 1" in line, line


@pytest.mark.parametrize("what", ["a text file", "a folder"])
def test_a_report_that_is_not_one_is_one_line(what, tmp_path, capsys):
    path = tmp_path
    if what == "a text file":
        path = tmp_path / "notes.txt"
        path.write_text("not json")
    assert gate_cli.main(["report", str(path)]) == 2
    line = _one_line(capsys)
    assert str(path) in line and ("not a compat report" in line or "is a folder" in line), line


def test_a_truncated_trace_is_one_line(tmp_path, capsys):
    cut = tmp_path / "cut.json"
    cut.write_text(TRACE.read_text()[:300])
    assert gate_cli.main(["replay", str(cut)]) == 2
    assert "not a valid trace (truncated or not JSON" in _one_line(capsys)


def test_a_trace_from_a_newer_harness_says_so(tmp_path, capsys):
    data = json.loads(TRACE.read_text())
    data["format"] = "omni-conformance-trace/2"
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps(data))
    assert gate_cli.main(["replay", str(newer)]) == 2
    assert "written by a newer omni-conformance" in _one_line(capsys)


def test_something_that_is_not_a_subject_is_refused_before_the_suite(tmp_path, capsys):
    rc = gate_cli.main(["check", "--subject", "os:path", "--report-dir", str(tmp_path / "r")])
    line = _one_line(capsys)
    assert rc == 2 and "cannot load subject 'os:path'" in line, line
    assert not (tmp_path / "r" / "compat-report.json").exists()


def test_a_report_folder_that_cannot_be_written_is_refused_before_the_suite(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc = gate_cli.main(["check", "--subject", "upstream", "--report-dir", str(blocker / "report")])
    line = _one_line(capsys)
    assert rc == 2 and "--report-dir" in line and "cannot write there" in line, line
