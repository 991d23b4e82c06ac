"""``release-diff --shrink-with``: a change's trace shrunk against both releases.

The default tests run this interpreter on both sides with a planted difference (side B runs every
trace with ``max_num_seqs=2``), so the children, the pipe, the first-difference comparison and the
shrinker all run for real on the one installed release; a found trace longer than 12 operations
must come out at most 12. A test that needs another release's environment is ``slow`` and skips
when the environment is missing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conformance._core import schemas
from conformance._core.lockstep import Shrinker
from conformance._core.machine import PREFIXES, TIGHT
from conformance._core.replay import load_trace
from conformance._core.workload import AddRequest, Step, Trace
from conformance.cli import main
from conformance.release import record as record_module
from conformance.release.record import load_recording, record
from conformance.release.release_diff import diff_recordings, release_diff
from conformance.release.release_shrink import (
    ReleaseProcess,
    ReleaseProcessError,
    ReleaseShrinker,
    resolve_python,
)

PLANT = {"max_num_seqs": 2}
LIMIT = 12  # the acceptance bound on a release-diff trace


def _long_trace() -> Trace:
    """Three requests at once only after many steps: with two sequences at most (the plant) the
    third waits, so the runs first differ at operation 19 of 19."""
    ops: list[Any] = [AddRequest("r0", tuple(range(100, 110)), max_tokens=40, ignore_eos=True)]
    ops += [Step() for _ in range(8)]
    ops.append(AddRequest("r1", tuple(range(120, 130)), max_tokens=30, ignore_eos=True))
    ops += [Step() for _ in range(7)]
    ops.append(AddRequest("r2", tuple(range(140, 148)), max_tokens=10, ignore_eos=True))
    ops.append(Step())
    return Trace(config=TIGHT, ops=ops, prefixes=dict(PREFIXES))


def _planted(monkeypatch: pytest.MonkeyPatch) -> None:
    """``record`` as side B records: every trace with the planted configuration."""
    original = record_module.run_workload

    def run(trace: Trace, mode: str, *args: Any) -> dict[str, Any]:
        changed = dataclasses.replace(trace, config=trace.config.with_(**PLANT))
        return original(changed, mode, *args)

    monkeypatch.setattr(record_module, "run_workload", run)


@pytest.fixture(scope="module")
def recordings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("release-shrink")
    traces = root / "traces"
    _long_trace().save(traces / "late-third-request.json")
    a, b = root / "a.jsonl", root / "b.jsonl"
    record(a, seed=0, size=0, traces=traces, modes=("sync",))
    with pytest.MonkeyPatch.context() as mp:
        _planted(mp)
        record(b, seed=0, size=0, traces=traces, modes=("sync",))
    return {"root": root, "a": a, "b": b, "traces": traces}


def test_a_planted_change_is_shrunk_against_both_interpreters(
    recordings: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "diff"
    said: list[str] = []
    report = release_diff(
        recordings["a"],
        recordings["b"],
        out,
        shrink_with=(sys.executable, sys.executable),
        shrink_seconds=90,
        progress=said.append,
        config_changes=(None, PLANT),
    )
    schemas.validate("release-diff", report)
    assert report["shrink"]["problem"] is None
    assert report["shrink"]["a"]["vllm"] == report["a"]["vllm"]
    (change,) = report["changes"]
    assert change["pattern"] == "sched_out.num_scheduled_tokens.*"
    how = change["shrink"]
    assert how["status"] == "shrunk", how
    assert how["found_length"] == change["shortest"]["length"] == len(_long_trace().ops)
    assert how["found_length"] > LIMIT >= how["length"], how
    assert how["path"].startswith("sched_out.num_scheduled_tokens.") and how["runs"] > 0
    trace = load_trace(out / change["trace"])
    assert len(trace.ops) == how["length"]
    assert trace.meta["shrunk"]["found_length"] == how["found_length"]
    assert f"(shrunk {how['found_length']} -> {how['length']} ops)" in change["summary"]
    md = (out / "release-diff.md").read_text()
    assert f"{how['found_length']} → {how['length']} (shrunk)" in md
    assert any("C1: shrunk" in line for line in said)

    # Independently of the pipes: the shrunk trace recorded as each side records it shows the
    # same change at its last operation.
    folder = tmp_path / "shrunk"
    folder.mkdir()
    trace.save(folder / "shrunk.json")
    a, b = tmp_path / "sa.jsonl", tmp_path / "sb.jsonl"
    record(a, seed=0, size=0, traces=folder, modes=("sync",))
    _planted(monkeypatch)
    record(b, seed=0, size=0, traces=folder, modes=("sync",))
    (d,) = diff_recordings(load_recording(a), load_recording(b)).differences
    assert (d.pattern, d.op_kind, d.length) == (change["pattern"], "step", how["length"])


def test_without_interpreters_the_trace_is_cut_and_the_report_says_so(
    recordings: dict[str, Path], tmp_path: Path
) -> None:
    report = release_diff(recordings["a"], recordings["b"], tmp_path)
    assert report["shrink"] is None
    (change,) = report["changes"]
    how = change["shrink"]
    assert how["status"] == "cut" and how["found_length"] == how["length"] == 19
    assert "--shrink-with" in how["why"]
    assert len(load_trace(tmp_path / change["trace"]).ops) == 19
    md = (tmp_path / "release-diff.md").read_text()
    assert "19 → 19 (cut)" in md and "not shrunk (cut:" in md


class _AgreeingPair:
    """Stands in for ``ReleasePair``: two interpreters of the recordings' release that never
    differ (no child processes: the real pair is the planted test's)."""

    def __init__(self, python_a: Any, python_b: Any, **kw: Any) -> None:
        from conformance._core import vllm_compat as vc

        self.versions = (vc.vllm_version(), vc.vllm_version())
        self.sides = [
            dataclasses.make_dataclass("S", ["python"])(str(p)) for p in (python_a, python_b)
        ]
        self.runs = 0

    def first_difference(self, trace: Trace, mode: str) -> None:
        self.runs += 1
        return None

    def close(self) -> None:
        pass


def test_a_change_the_interpreters_do_not_show_is_not_reproduced(
    recordings: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the CLI: interpreters that agree on the found trace leave it as found, and the
    report says why it was not shrunk."""
    from conformance.release import release_shrink

    monkeypatch.setattr(release_shrink, "ReleasePair", _AgreeingPair)
    out = tmp_path / "diff"
    args = ["release-diff", str(recordings["a"]), str(recordings["b"]), "--out", str(out)]
    rc = main([*args, "--shrink-with", sys.executable, sys.executable, "--shrink-seconds", "20"])
    assert rc == 1
    report = json.loads((out / "release-diff.json").read_text())
    how = report["changes"][0]["shrink"]
    assert how["status"] == "not reproduced" and how["length"] == how["found_length"] == 19
    assert "no difference" in how["why"]
    assert len(load_trace(out / report["changes"][0]["trace"]).ops) == 19
    assert "(cut, not shrunk: not reproduced)" in capsys.readouterr().out


def test_interpreters_of_other_releases_than_the_recordings_fail_every_change(
    recordings: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from conformance.release import release_shrink

    class OtherRelease(_AgreeingPair):
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **kw)
            self.versions = ("0.0.1", self.versions[1])

    monkeypatch.setattr(release_shrink, "ReleasePair", OtherRelease)
    report = release_diff(recordings["a"], recordings["b"], tmp_path, shrink_with=("pa", "pb"))
    problem = report["shrink"]["problem"]
    assert problem is not None and problem.startswith("--shrink-with: pa runs vLLM 0.0.1 but")
    how = report["changes"][0]["shrink"]
    assert how["status"] == "failed" and how["why"] == problem and how["length"] == 19
    assert f"It was not shrunk: {problem}" in (tmp_path / "release-diff.md").read_text()


def test_bad_shrink_options_are_one_line_exit_2(
    recordings: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["release-diff", str(recordings["a"]), str(recordings["b"]), "--out", str(tmp_path)]
    assert main([*args, "--shrink-with", "no-such-env", sys.executable]) == 2
    assert "--shrink-with no-such-env: not a python executable" in capsys.readouterr().err
    assert main([*args, "--shrink-seconds", "0"]) == 2
    assert "--shrink-seconds 0.0: must be more than 0" in capsys.readouterr().err


def test_interpreters_are_named_by_file_folder_environment_or_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def env(name: str) -> Path:
        python = tmp_path / name / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text("")
        return python

    exact, digest = env("vllm-0.29.0"), env("vllm-0.30.0+abc12345")
    assert resolve_python(str(exact)) == exact
    assert resolve_python(str(tmp_path / "vllm-0.29.0")) == exact
    assert resolve_python("vllm-0.29.0", tmp_path) == exact
    assert resolve_python("vllm-0.30.0", tmp_path) == digest
    env("vllm-0.30.0+def67890")
    with pytest.raises(ValueError, match="several environments match"):
        resolve_python("vllm-0.30.0", tmp_path)
    with pytest.raises(ValueError, match="not a python executable"):
        resolve_python("vllm-0.31.0", tmp_path)
    on_path = tmp_path / "path" / "python-on-path"
    on_path.parent.mkdir()
    on_path.write_text("")
    on_path.chmod(0o755)
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert resolve_python("python-on-path", tmp_path) == on_path


def test_a_child_that_dies_is_an_error_naming_it() -> None:
    side = ReleaseProcess(sys.executable, None)
    side.kill()
    with pytest.raises(ReleaseProcessError, match="ended"):
        side.ready()
    side.close()


def test_a_step_is_traded_for_a_few_prompt_tokens() -> None:
    """A difference at a block boundary: the prompt must stay short of the block and the steps
    must walk it there. The gate's trade (a whole block) cannot pass it; the finer one can."""

    def at_boundary(t: Trace) -> bool:
        (add,) = [op for op in t.ops if isinstance(op, AddRequest)]
        steps = sum(isinstance(op, Step) for op in t.ops[t.ops.index(add) :])
        return steps >= 1 and len(add.prompt) < 32 <= len(add.prompt) + steps

    found = Trace(TIGHT, [AddRequest("r0", tuple(range(100, 120)))] + [Step()] * 12)
    assert at_boundary(found)
    gate = Shrinker(found, at_boundary, time_budget=30).run().trace
    ours = ReleaseShrinker(found, at_boundary, time_budget=30).run().trace
    assert len(gate.ops) == 13 and len(ours.ops) == 2
    assert at_boundary(ours) and len(ours.ops[0].prompt) == 31


def test_a_request_is_shrunk_in_prompt_and_max_tokens_together() -> None:
    """A difference at a request's end, when prompt and output together end on the right step:
    shortening one field alone moves the end off it, so the one-field passes stop at 17
    operations; the joint pass (for a trace longer than 12) finds 6."""

    def at_end(t: Trace) -> Trace | bool:
        if not t.ops or not isinstance(t.ops[0], AddRequest) or len(t.ops[0].prompt) == 0:
            return False
        if any(isinstance(op, AddRequest) for op in t.ops[1:]):
            return False
        total = len(t.ops[0].prompt) + t.ops[0].max_tokens
        step = total // 2
        if total % 11 or len(t.ops) <= step:
            return False
        return Trace(t.config, list(t.ops[: step + 1]), dict(t.prefixes), dict(t.meta))

    found = Trace(TIGHT, [AddRequest("r0", tuple(range(100, 126)), max_tokens=7)] + [Step()] * 20)
    gate = Shrinker(found, at_end, time_budget=30).run().trace
    ours = ReleaseShrinker(found, at_end, time_budget=30).run().trace
    assert len(gate.ops) == 17 and len(ours.ops) == 6


# ---- another release ----------------------------------------------------------------------


def _pipeline_trace() -> Trace:
    """The shortest corpus workload (gen-0066 of seed 0, 21 operations) of a change between
    vLLM 0.30.0 and 0.33.0 with four pipeline stages and two speculative tokens: when a block
    filled by decoding gets its hash (``block_pool.num_cached_hashes``)."""
    config = TIGHT.with_(num_speculative_tokens=2, pipeline_parallel_size=4)
    r1 = AddRequest("r1", tuple(range(100, 127)), prefix="sys", max_tokens=11)
    ops: list[Any] = [AddRequest("r0", (211,), max_tokens=19), *([Step()] * 6), r1]
    ops += [Step()] * 13
    return Trace(config=config, ops=ops, prefixes=dict(PREFIXES))


@pytest.mark.slow
def test_a_real_change_between_releases_shrinks_to_at_most_12_operations(
    tmp_path: Path,
) -> None:
    """vLLM 0.30.0's environment (built by the matrix) against this interpreter."""
    from conformance._core import vllm_compat as vc

    try:
        python = resolve_python("vllm-0.30.0")
    except ValueError:
        pytest.skip("no vllm-0.30.0 environment (omni-conformance matrix builds it)")
    if vc.vllm_version() == "0.30.0":
        pytest.skip("this interpreter runs vLLM 0.30.0 too")
    traces = tmp_path / "traces"
    _pipeline_trace().save(traces / "pipeline.json")
    old, new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root)}
    cmd = [str(python), "-m", "conformance.cli", "record", "--out", str(old), "--size", "0"]
    cmd += ["--traces", str(traces), "--modes", "sync"]
    subprocess.run(cmd, cwd=root, env=env, check=True, capture_output=True, timeout=900)
    record(new, seed=0, size=0, traces=traces, modes=("sync",))
    report = release_diff(old, new, tmp_path / "diff", shrink_with=(python, sys.executable))
    found = {c["pattern"]: c for c in report["changes"]}
    change = found["block_pool.num_cached_hashes"]
    how = change["shrink"]
    assert how["status"] == "shrunk" and how["found_length"] == 21, how
    assert how["length"] <= LIMIT, how


def test_the_matrix_shrinks_with_the_environments_it_recorded_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from conformance.release import matrix
    from conformance.release import release_diff as release_diff_module
    from conformance.release.envs import Environment, EnvSpec

    def env_of(spec: EnvSpec, *args: Any) -> tuple[Environment, None]:
        root = tmp_path / "envs" / spec.name
        return Environment(spec, root, root / "bin" / "python", "uv"), None

    def recorded(cmd: list[str], log_path: Path, env: dict[str, str], timeout: float) -> int:
        Path(cmd[cmd.index("--out") + 1]).write_text("")
        return 0

    asked: list[Any] = []

    def diff(a: Path, b: Path, out: Path, **kw: Any) -> dict[str, Any]:
        asked.append(kw["shrink_with"])
        side = {"vllm": a.stem.removeprefix("vllm-")}
        return {
            "status": "identical",
            "workloads": 0,
            "identical_workloads": 0,
            "a": side,
            "b": {"vllm": b.stem.removeprefix("vllm-")},
        }

    monkeypatch.setattr(matrix, "_environment_for", env_of)
    monkeypatch.setattr(matrix, "_run_logged", recorded)
    monkeypatch.setattr(release_diff_module, "release_diff", diff)
    opts = matrix.MatrixOptions(out=tmp_path, envs_dir=tmp_path / "envs", release_diff="only")
    matrix.run_release_diff(["0.30.0", "0.28.0"], opts, lambda line: None)
    envs = tmp_path / "envs"
    assert asked == [(envs / "vllm-0.28.0/bin/python", envs / "vllm-0.30.0/bin/python")]
