"""Saved traces say where they came from, and ``omni-conformance replay`` says plainly what a
re-run showed.

A trace is saved only for a failure, so a replay that finds no difference must not look like a
success (exit 3, "does not reproduce"); one that finds another first difference than the recorded
one must show both; one that runs on another subject or another vLLM than the trace recorded must
say so before its result; a truncated file is one line and exit 2. The traces come from the
planted mutants of ``tests/mutants/harness_mutants.py``.

Shrinking: a real preemption-order divergence (``RequeueAtBack``) found by a long, unshrunk random
program must be saved as a short trace, well within the shrinker's time bound.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from conformance._core.config import HarnessConfig
from conformance._core.lockstep import POOL_FIELDS, Lockstep, run_trace, shrink_seconds
from conformance._core.machine import PREFIXES, TIGHT, random_request
from conformance._core.preflight import EXIT_ENV, EXIT_NOT_REPRODUCED, EXIT_REPRODUCED
from conformance._core.replay import load_trace, record_failure
from conformance._core.scenarios import run_canonical
from conformance._core.vllm_compat import environment_versions
from conformance._core.workload import Abort, DeliverChunks, ResetPrefixCache, Step, Trace
from conformance.cli import main
from tests.mutants import harness_mutants as M

pytestmark = pytest.mark.clauses("C-01")
ROOT = Path(__file__).resolve().parents[1]
SPEC = "tests.mutants.harness_mutants:forward_free"


@pytest.fixture(scope="module")
def forward_free_session():
    session = run_canonical(TIGHT, M.forward_free)
    assert session.failure is not None
    return session


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, forward_free_session):
    return record_failure(
        forward_free_session,
        subject_spec=SPEC,
        name="forward-free",
        folder=tmp_path_factory.mktemp("failures"),
        profile="ci",
        test="tests/test_replay_honesty.py::saved",
    )


@pytest.fixture
def saved(tmp_path, recorded):
    """A fresh copy of the recorded trace (tests damage or edit it)."""
    path, diff = recorded
    copy = tmp_path / path.name
    copy.write_text(path.read_text())
    return copy, diff


def _edit_meta(path: Path, **changes) -> Path:
    data = json.loads(path.read_text())
    data["meta"].update(changes)
    path.write_text(json.dumps(data))
    return path


def _replay(capsys, *argv: str) -> tuple[int, list[str], str]:
    code = main(["replay", *argv])
    out = capsys.readouterr()
    return code, out.out.strip().splitlines(), out.err


# ---- what a trace records ---------------------------------------------------------------


def test_trace_meta_records_provenance(saved, forward_free_session):
    path, diff = saved
    meta = json.loads(path.read_text())["meta"]
    versions = environment_versions()
    assert meta["subject"] == SPEC
    assert meta["vllm"] == versions["vllm"] and meta["torch"] == versions["torch"]
    assert meta["python"] == versions["python"]
    assert meta["mode"] == "sync" and meta["use_worker"] is False
    assert meta["profile"] == "ci"
    assert meta["test"] == "tests/test_replay_honesty.py::saved"
    assert meta["first_difference"] == diff.to_dict()
    assert meta["found"]["ops"] == len(forward_free_session.trace.ops)
    assert meta["found"]["first_difference"]["path"] == diff.path
    shrink = meta["shrink"]
    assert shrink["complete"] and shrink["ops"] == len(json.loads(path.read_text())["ops"])
    assert shrink["original_ops"] == meta["found"]["ops"]
    # The harness config travels as the trace's config, scheduling mode included; the shrinker
    # may have found the failure with a smaller KV-cache pool (and context), and says so.
    config = load_trace(path).config
    pool = {name: getattr(TIGHT, name) for name in POOL_FIELDS}
    assert config.with_(**pool) == TIGHT
    for name, was in pool.items():
        now = getattr(config, name)
        assert shrink.get(name) == (None if now == was else {"original": was, "shrunk": now})


# ---- replay says what happened ----------------------------------------------------------


def test_reproduced_prints_exactly_the_recorded_difference(saved, capsys):
    path, diff = saved
    code, lines, _ = _replay(capsys, str(path))
    assert code == EXIT_REPRODUCED == 1
    assert lines == [diff.headline()]  # no note: same subject, same vLLM


def test_not_reproduced_is_not_a_success(saved, capsys):
    path, _ = saved
    code, lines, _ = _replay(capsys, str(path), "--subject", "upstream")
    assert code == EXIT_NOT_REPRODUCED == 3
    vllm = environment_versions()["vllm"]
    assert lines[0] == (
        f"note: trace recorded on subject {SPEC!r}, vLLM {vllm}; "
        f"replaying on subject 'upstream', vLLM {vllm}"
    )
    assert lines[1] == f"does not reproduce: no difference on subject 'upstream', vLLM {vllm}"
    assert len(lines) == 2


def test_several_traces_replay_in_one_process_each_under_its_name(saved, tmp_path, capsys):
    path, diff = saved
    clean = tmp_path / "clean.json"
    data = json.loads(path.read_text())
    data["ops"] = data["ops"][:1]  # its first operation alone shows nothing
    clean.write_text(json.dumps(data))
    code, lines, _ = _replay(capsys, str(path), str(clean))
    assert code == EXIT_REPRODUCED  # one of them reproduced
    assert lines == [
        f"== {path}",
        diff.headline(),
        f"== {clean}",
        f"does not reproduce: no difference on subject {SPEC!r}, "
        f"vLLM {environment_versions()['vllm']}",
    ]
    code, lines, _ = _replay(capsys, str(clean), str(clean))
    assert code == EXIT_NOT_REPRODUCED  # none did


def test_a_different_first_difference_prints_both(saved, capsys):
    path, diff = saved
    recorded = {**diff.to_dict(), "step": diff.step + 5, "path": "queues.waiting"}
    _edit_meta(path, first_difference=recorded)
    code, lines, _ = _replay(capsys, str(path))
    assert code == EXIT_REPRODUCED
    assert lines[0] == "reproduces with a DIFFERENT first difference:"
    assert "queues.waiting" in lines[1] and lines[1].startswith("  recorded: ")
    assert lines[2] == f"  now:      {diff.headline()}"


def test_another_vllm_version_is_noted_before_the_result(saved, capsys):
    path, diff = saved
    _edit_meta(path, vllm="0.32.9")
    code, lines, _ = _replay(capsys, str(path))
    assert code == EXIT_REPRODUCED
    vllm = environment_versions()["vllm"]
    assert lines == [
        f"note: trace recorded on subject {SPEC!r}, vLLM 0.32.9; "
        f"replaying on subject {SPEC!r}, vLLM {vllm}",
        diff.headline(),
    ]


@pytest.mark.parametrize(
    "damage",
    ["truncated", "not-json", "not-a-trace", "unknown-op", "bad-config", "bad-difference"],
)
def test_a_broken_trace_file_is_one_line_and_exit_2(saved, capsys, damage):
    path, _ = saved
    text = path.read_text()
    data = json.loads(text)
    if damage == "truncated":
        path.write_text(text[: len(text) // 2])
    elif damage == "not-json":
        path.write_bytes(b"\x89PNG\r\n\x1a\n")
    elif damage == "not-a-trace":
        path.write_text(json.dumps({"hello": "world"}))
    elif damage == "unknown-op":
        data["ops"].append({"op": "explode"})
        path.write_text(json.dumps(data))
    elif damage == "bad-config":
        data["config"]["no_such_knob"] = 1
        path.write_text(json.dumps(data))
    else:
        data["meta"]["first_difference"] = {"step": 1}
        path.write_text(json.dumps(data))
    code, lines, err = _replay(capsys, str(path))
    assert code == EXIT_ENV == 2
    assert lines == []
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and str(path) in err


def test_replay_through_a_console_process_reports_a_broken_trace_in_one_line(saved):
    path, _ = saved
    path.write_text(path.read_text()[:200])
    env = {**os.environ, "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "conformance.cli", "replay", str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "not a valid trace" in proc.stderr


# ---- shrinking a long random program ----------------------------------------------------

LONG = 40  # a found failure at least this many operations into the program


def random_program(rng: random.Random, n: int, *, resets: bool) -> list:
    """The workload language's op mix (as ``conformance._core.machine`` draws it), unshrunk."""
    ops: list = []
    count = 0
    for _ in range(n):
        k = rng.random()
        if k < 0.3:
            ops.append(random_request(rng, f"r{count}"))
            count += 1
        elif k < 0.8:
            ops.extend([Step()] * rng.randint(1, 4))
        elif k < 0.9 and count:
            known = [f"r{i}" for i in range(count)]
            ops.append(Abort(tuple(rng.sample(known, min(count, rng.randint(1, 3))))))
        elif k < 0.95 and resets:
            ops.append(ResetPrefixCache(reset_running_requests=rng.random() < 0.5))
        else:
            ops.append(DeliverChunks())
    return ops


def _long_failing_session(cfg: HarnessConfig, *, resets: bool) -> Lockstep:
    for seed in range(200):
        ops = random_program(random.Random(seed), 80, resets=resets)
        found = run_trace(Trace(cfg, ops, dict(PREFIXES)), M.requeue_at_back)
        if found.failure is not None and len(found.trace.ops) >= LONG:
            return found.session
    raise AssertionError("no long random program caught RequeueAtBack")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "resets", "bound"),
    [
        # reset_prefix_cache(reset_running_requests=True) preempts everything at once.
        ("sync", True, 6),
        # Without it the preemption needs real KV-cache pressure: requests and decode steps.
        ("sync", False, 12),
        ("async", False, 12),
    ],
)
def test_requeue_at_back_from_a_long_random_program_shrinks_short(
    tmp_path, monkeypatch, mode, resets, bound
):
    monkeypatch.delenv("OMNI_CONFORMANCE_SHRINK_SECONDS", raising=False)
    cfg = TIGHT.with_(async_scheduling=mode == "async")
    session = _long_failing_session(cfg, resets=resets)
    assert session.failure is not None and session.failure.path == "queues.waiting"
    found = len(session.trace.ops)
    path, diff = record_failure(session, subject_spec="x", name="requeue", folder=tmp_path)
    meta = json.loads(path.read_text())["meta"]
    shrink = meta["shrink"]
    print(f"{mode} resets={resets}: {found} ops -> {shrink['ops']} in {shrink['seconds']} s")
    assert diff.path == "queues.waiting"
    assert shrink["complete"], shrink  # finished well within the bound, not cut off by it
    assert shrink["seconds"] < shrink_seconds() == 60.0
    assert shrink["ops"] <= bound < found
    # The saved trace fails the same way when run again (what replay will do).
    again = run_trace(load_trace(path), M.requeue_at_back)
    assert again.failure is not None and again.failure.to_dict() == meta["first_difference"]
