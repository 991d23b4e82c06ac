"""The sharded check's plan and merge, without a cluster (``conformance.cluster.shards``): shards
are test files (or tests) x seeds, a derandomized profile gets one seed, one test's records from
several shards fold into one record (summed counts, the worst outcome with its cause), the merged
report is the local report's form, and the example database round-trips as files. For
``matrix --ray``: a cell's guard stops what the cell started once the task's worker is gone, and a
cell whose task gave no result is an error cell naming the cause and the nodes it started on."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from conformance._core.report import validate
from conformance.cluster.ray_check import _Results
from conformance.cluster.shards import (
    Progress,
    Shard,
    fold_records,
    merged_report,
    pack_folder,
    plan_shards,
    unpack_folder,
)
from conformance.plugin import example_db_key

IDS = ["invariants/a.py::t[x]", "invariants/a.py::t[y]", "invariants/b.py::u"]
ENV = {"vllm": "0.33.0", "torch": "2", "python": "3.11", "hypothesis": "6"}


def test_shards_are_files_by_seeds_seed_major():
    shards = plan_shards(IDS, "deep", base_seed=7, seeds_per_test=2)
    assert [(s.nodeids, s.seed) for s in shards] == [
        (tuple(IDS[:2]), 7000),
        (tuple(IDS[2:]), 7000),
        (tuple(IDS[:2]), 7001),
        (tuple(IDS[2:]), 7001),
    ]
    assert [s.id for s in shards] == ["s0000", "s0001", "s0002", "s0003"]
    assert Shard.from_dict(shards[3].to_dict()) == shards[3]
    # A derandomized profile searches the same examples under any seed: one shard per group.
    ci = plan_shards(IDS, "ci", base_seed=7, seeds_per_test=5, by="test")
    assert [(s.nodeids, s.seed) for s in ci] == [((n,), None) for n in IDS]
    assert len(plan_shards(IDS, "deep", base_seed=0)) == 2 * 8  # deep's default seeds
    with pytest.raises(ValueError):
        plan_shards(IDS, "ci", 0, by="module")


def _rec(outcome: str, examples: int, **kw: object) -> dict[str, object]:
    return {
        "nodeid": IDS[0],
        "outcome": outcome,
        "clauses": ["C-01"],
        "examples": examples,
        "steps_compared": examples * 10,
        "tolerated": {"R-1": 1},
        "exercised": {"preempted": examples},
        "duration": 1.0,
        **kw,
    }


def test_one_tests_shards_fold_into_one_record_with_the_worst_outcome():
    diff = {"step": 3, "op": "step()", "path": "queues.waiting", "upstream": [1], "subject": [2]}
    folded = fold_records(
        [
            _rec("passed", 20),
            _rec("failed", 5, first_difference=diff, trace="/f/x.json", message="m"),
            _rec("passed", 20),
        ]
    )
    assert folded["outcome"] == "failed" and folded["first_difference"] == diff
    assert folded["trace"] == "/f/x.json"
    assert (folded["examples"], folded["steps_compared"]) == (45, 450)
    assert folded["tolerated"] == {"R-1": 3} and folded["exercised"] == {"preempted": 45}
    report = merged_report(
        subject="s",
        profile="deep",
        seed=0,
        environment=ENV,
        records=[
            _rec("passed", 20),
            {**_rec("not_applicable", 0), "nodeid": IDS[2], "reason": "r"},
        ],
        order=IDS,
    )
    validate(report)  # the local report's schema
    assert [t["nodeid"] for t in report["tests"]] == [IDS[0], IDS[2]]
    assert report["status"] == "pass" and report["summary"]["examples"] == 20


def test_a_lost_shard_is_an_error_for_each_of_its_tests(tmp_path: Path):
    results = _Results(tmp_path / "failures", tmp_path / "db")
    shard = Shard(4, tuple(IDS[:2]), None)
    failed = results.take(shard, {"error": "lost after 3 retries: node died"}, {})
    assert failed
    assert [(r["nodeid"], r["outcome"]) for r in results.records] == [
        (IDS[0], "error"),
        (IDS[1], "error"),
    ]
    assert "s0004: lost after 3 retries" in str(results.records[0]["message"])
    assert results.rows[0]["status"] == "error"


def test_a_shards_traces_land_in_the_failures_folder_and_its_records_name_them(tmp_path: Path):
    results = _Results(tmp_path / "failures", tmp_path / "db")
    for i in (0, 1):  # two seeds of one test save a trace of the same name
        rec = _rec("failed", 1, trace=f"/node/tmp{i}/failures/T.json")
        results.take(Shard(i, (IDS[0],), i), {"records": [rec], "traces": {"T.json": f"{i}"}}, {})
    assert sorted(p.name for p in (tmp_path / "failures").iterdir()) == ["T--s0001.json", "T.json"]
    assert [r["trace"] for r in results.records] == [
        str(tmp_path / "failures" / "T.json"),
        str(tmp_path / "failures" / "T--s0001.json"),
    ]


def test_the_example_database_is_synced_through_the_driver(tmp_path: Path):
    results = _Results(tmp_path / "failures", tmp_path / "db")
    key = example_db_key(IDS[0])
    (tmp_path / "db" / key / "k1").mkdir(parents=True)
    (tmp_path / "db" / key / "k1" / "old").write_bytes(b"fixed")
    shard = Shard(0, (IDS[0],), 5)
    sent = results.sent_database(shard)
    assert sent == {f"{key}/k1/old": b"fixed"}
    # The shard's hypothesis dropped the fixed example and saved a new failure.
    results.take(shard, {"records": [_rec("failed", 1)], "database": {f"{key}/k2/new": b"x"}}, sent)
    assert pack_folder(tmp_path / "db") == {f"{key}/k2/new": b"x"}
    assert example_db_key(IDS[0]) != example_db_key(IDS[1])
    with pytest.raises(ValueError):
        unpack_folder({"../escape": b""}, tmp_path / "db")


def test_progress_counts_per_node_and_names_retried_shards():
    p = Progress(3)
    p.started("s0", "n1")
    p.started("s1", "n2")
    p.finished("s0", "n1", failed=False)
    p.started("s1", "n1")  # Ray ran it again after n2 died
    assert p.retried() == {"s1": ["n2", "n1"]}
    p.finished("s1", "n1", failed=True)
    p.started("s1", "n1")  # the board's news of a start may arrive after the result
    assert p.line() == "shards 2/3: 1 done, 0 running, 1 failed  |  n1: 1 done, 0 running, 1 failed"


def test_a_subject_from_the_users_folder_is_shipped_and_an_installed_one_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from conformance.cluster.ray_env import runtime_env, subject_py_modules

    (tmp_path / "my_subject.py").write_text("class S: ...\n")
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_pkg" / "sub.py").write_text("class S: ...\n")
    monkeypatch.chdir(tmp_path)  # module:attr resolves from the working folder, as check does
    assert subject_py_modules("my_subject:S") == [str(tmp_path / "my_subject.py")]
    assert subject_py_modules("my_pkg.sub:S") == [str(tmp_path / "my_pkg")]
    assert subject_py_modules("upstream") == []  # a registered name
    assert subject_py_modules("json:loads") == []  # installed with the interpreter
    env = runtime_env(["my_subject:S", "upstream"])
    assert env["py_modules"] == [str(tmp_path / "my_subject.py")]
    assert env["env_vars"]["PYTHONHASHSEED"] == "0"


def _guard_pids(scratch: Path) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        try:
            cmdline = Path("/proc", name, "cmdline").read_bytes()
        except OSError:
            continue
        if b"conformance.cluster.cell_guard" in cmdline and str(scratch).encode() in cmdline:
            found.append(int(name))
    return found


def _until(predicate: Any, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="the guard reads /proc")
def test_a_cells_guard_kills_what_the_cell_started_once_its_worker_is_gone(tmp_path: Path):
    """Ray kills a dead worker's children only: the cell's pytest, in a session of its own, would
    run on. The guard kills every process carrying the cell's token once the worker is gone, and
    leaves the worker's cell alone while it lives and another cell's processes always."""
    from conformance.cluster import cell_guard

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    worker = subprocess.Popen(["sleep", "120"])
    mine = subprocess.Popen(
        ["sleep", "121"], env={**os.environ, cell_guard.TOKEN_ENV: "c-1"}, start_new_session=True
    )
    other = subprocess.Popen(["sleep", "122"], env={**os.environ, cell_guard.TOKEN_ENV: "c-12"})
    try:
        cell_guard.start(worker.pid, scratch, "c-1")
        assert cell_guard.carrying("c-1", exact=True) == [mine.pid]
        assert sorted(cell_guard.carrying("c-")) == sorted([mine.pid, other.pid])
        time.sleep(2 * cell_guard.POLL_S)
        assert mine.poll() is None and scratch.exists()  # the worker lives: nothing touched
        worker.kill()
        assert mine.wait(timeout=10) == -9
        assert _until(lambda: not scratch.exists())
        assert other.poll() is None
        assert _until(lambda: not _guard_pids(scratch))  # the guard has ended
    finally:
        for p in (worker, mine, other):
            p.kill()
            p.wait()


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="the guard reads /proc")
def test_a_cells_guard_ends_when_its_task_removes_the_scratch_folder(tmp_path: Path):
    from conformance.cluster import cell_guard

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    worker = subprocess.Popen(["sleep", "120"])
    try:
        cell_guard.start(worker.pid, scratch, "c-2")
        assert _guard_pids(scratch)  # the starter returned; the guard watches on its own
        scratch.rmdir()
        assert _until(lambda: not _guard_pids(scratch))
    finally:
        worker.kill()
        worker.wait()


def test_a_cell_lost_past_rays_retries_is_an_error_cell_naming_the_cause_and_its_nodes(
    tmp_path: Path,
):
    exceptions = pytest.importorskip("ray.exceptions", reason="the [ray] extra is not installed")
    from conformance.cluster.ray_matrix import lost_cell, task_cause
    from conformance.release.matrix import Cell, MatrixOptions
    from conformance.release.matrix_report import build_matrix_report, load_cells, summary_text

    lost = task_cause(
        exceptions.NodeDiedError("Task failed because the node it was running on is dead."), 3
    )
    assert lost == (
        "cell task lost after 3 retries by Ray: NodeDiedError: "
        "Task failed because the node it was running on is dead."
    )
    raised = exceptions.RayTaskError("cell_body", "Traceback ...\n", OSError("disk full"))
    assert task_cause(raised.as_instanceof_cause(), 3) == "cell task raised OSError: disk full"
    opts = MatrixOptions(out=tmp_path, envs_dir=tmp_path / "envs")
    cell = Cell("upstream", "0.30.0")
    assert lost_cell(cell, opts, lost, ["10.0.0.6/9b02de", "10.0.0.5/3fa2c1"], "the cluster") == (
        "error"
    )
    report = build_matrix_report(load_cells([tmp_path / "cells"]))
    (entry,) = report["cells"]
    assert entry["status"] == "error" and entry["error"] == lost
    assert entry["environment"]["ray_retried"] == "by Ray: 10.0.0.6/9b02de -> 10.0.0.5/3fa2c1"
    assert f"ERROR upstream @ vLLM 0.30.0: {lost}" in summary_text(report)
