"""``check --ray`` and ``matrix --ray`` on a real two-node Ray cluster on this machine
(``ray.cluster_utils.Cluster``: a head node and a second node, one CPU each), driven through the
command as a user runs it, in a subprocess that joins the cluster by address.

The Ray lane only: ``pytest -m ray_cluster`` (the root conftest deselects these tests unless the
``-m`` expression names the marker, so the default lane never starts a cluster). What it holds: a derandomized run through Ray gives the local run's
verdicts, examples, steps and shrunk traces, and finds the named mutant
``requeue_preempted_at_back`` from a subject module that exists only in the user's folder
(it reaches the nodes through the job's runtime environment); a seeded shard searches the same
examples through Ray as in this process; killing the second node mid-run loses no shard (Ray
retries it) and the report names the retried shard; a shard past its timeout is an error with
its cause; matrix cells through Ray give the local matrix's verdicts; killing the second node
mid-matrix loses no cell (Ray retries it and it gives the local verdict; past its retries it is
an error cell with its cause) and leaves nothing of it running; an interrupted matrix driver keeps
its finished cells and merges them.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")

ROOT = Path(__file__).resolve().parents[1]
LOCKSTEP = str(ROOT / "invariants" / "test_ar_inv_001_lockstep.py")
STORE = 250 * 2**20
pytestmark = [pytest.mark.ray_cluster, pytest.mark.slow]


@pytest.fixture
def cluster() -> Any:
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized()
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "object_store_memory": STORE},
    )
    try:
        c.second = c.add_node(num_cpus=1, object_store_memory=STORE)
        c.wait_for_nodes()
        yield c
    finally:
        c.shutdown()


def _mutant_module(folder: Path) -> str:
    """The catalogue's ``requeue_preempted_at_back`` on vLLM's own schedulers, as a subject
    module in a folder of the user's, importable nowhere else."""
    from tests.mutants.runtime_mutants import RequeuePreemptedAtBack

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "requeue_mutant_subject.py").write_text(
        "from typing import Any\n\n"
        "from vllm.v1.core.sched.async_scheduler import AsyncScheduler\n"
        "from vllm.v1.core.sched.scheduler import Scheduler\n\n"
        "from conformance.api import BaseSubject\n\n\n"
        + inspect.getsource(RequeuePreemptedAtBack)
        + "\n\nclass Subject(BaseSubject):\n"
        '    name = "requeue-mutant"\n'
        '    sync_scheduler = type("Sync", (RequeuePreemptedAtBack, Scheduler), {})\n'
        '    async_scheduler = type("Async", (RequeuePreemptedAtBack, AsyncScheduler), {})\n'
    )
    return "requeue_mutant_subject:Subject"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", PYTHONHASHSEED="0", VLLM_USE_V2_MODEL_RUNNER="0")
    env.pop("PYTHONPATH", None)
    return env


def _check(cwd: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "conformance.cli", "check", "-n", "0", "-q"]
    cmd += ["--report-dir", str(out / "report"), "--failures-dir", str(out / "failures")]
    cmd += ["--example-db", str(out / "db"), *args]
    return subprocess.run(
        cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=1200, check=False
    )


def _watch(
    cmd: list[str],
    cwd: Path,
    on_line: Callable[[str, subprocess.Popen[str]], None],
    seconds: float = 1800,
) -> tuple[int, str]:
    """Run ``cmd`` (a driver), calling ``on_line`` with each line of its output as it comes (to
    kill a node or interrupt the driver at the right moment); its exit code and output."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen: list[str] = []
    deadline = time.monotonic() + seconds
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            seen.append(line)
            on_line(line, proc)
            assert time.monotonic() < deadline, "".join(seen[-30:])
        return proc.wait(timeout=120), "".join(seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _matrix_cmd(out: Path, *extra: str, vllm: tuple[str, ...] = ("0.28.0", "0.30.0")) -> list[str]:
    """``matrix`` over installed release environments (by default vLLM 0.28.0 and 0.30.0, each
    with vllm-omni), subject ``upstream``, smoke profile, no upstream-tests."""
    cmd = [sys.executable, "-m", "conformance.cli", "matrix", "--subject", "upstream"]
    cmd += ["--vllm", *vllm, "--with", "upstream=vllm-omni=={vllm}"]
    cmd += ["--no-upstream-tests", "--profile", "smoke", "-n", "1", "--out", str(out)]
    return [*cmd, *extra]


def _cells(out: Path) -> dict[str, dict[str, Any]]:
    """The finished cells' ``cell.json`` by folder name."""
    return {p.parent.name: json.loads(p.read_text()) for p in (out / "cells").glob("*/cell.json")}


def _verdicts(out: Path) -> dict[str, Any]:
    """Each finished cell's status and release, and each test's outcome in it."""
    cells = {}
    for p in sorted((out / "cells").glob("*/cell.json")):
        cell = json.loads(p.read_text())
        rep = json.loads((p.parent / "compat-report.json").read_text())
        outcomes = {t["nodeid"]: t["outcome"] for t in rep["tests"]}
        cells[p.parent.name] = (cell["status"], cell["environment"]["vllm"], outcomes)
    return cells


def _cell_runs(prefix: str = "") -> list[str]:
    """What is still running of cells whose guard token starts with ``prefix`` (command lines)."""
    from conformance.cluster.cell_guard import carrying

    runs = []
    for pid in carrying(prefix):
        try:
            runs.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            pass
    return runs


def _until(predicate: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def _tests(out: Path) -> dict[str, tuple[Any, ...]]:
    report = json.loads((out / "report" / "compat-report.json").read_text())
    return {
        t["nodeid"]: (t["outcome"], t["examples"], t["steps_compared"], t.get("first_difference"))
        for t in report["tests"]
    }


def _traces(out: Path) -> dict[str, Any]:
    found = {}
    for p in sorted((out / "failures").glob("*.json")):
        data = json.loads(p.read_text())
        found[p.name] = (data["ops"], data["meta"]["first_difference"], data["meta"]["found"])
    return found


def test_check_through_ray_equals_the_local_run_and_finds_the_mutant(cluster, tmp_path):
    user = tmp_path / "user"
    subject = _mutant_module(user)
    common = ("--subject", subject, "--profile", "smoke", "--tests", LOCKSTEP)
    local = _check(user, tmp_path / "local", *common)
    assert local.returncode == 1, local.stdout[-3000:] + local.stderr[-3000:]
    through = _check(
        user, tmp_path / "ray", *common, "--ray", cluster.address, "--shard-by", "test"
    )
    assert through.returncode == 1, through.stdout[-3000:] + through.stderr[-3000:]
    assert "VIOLATION" in through.stdout and "queues.waiting" in through.stdout
    assert _tests(tmp_path / "ray") == _tests(tmp_path / "local")
    assert all(v[0] == "failed" for v in _tests(tmp_path / "ray").values())
    assert _traces(tmp_path / "ray") == _traces(tmp_path / "local") != {}
    shards = json.loads((tmp_path / "ray" / "report" / "shards.json").read_text())
    assert len({s["node"] for s in shards["shards"]}) == 2  # both nodes ran a shard


def test_a_seeded_shard_searches_the_same_examples_through_ray(cluster, tmp_path):
    from conformance.cluster.shard_run import run_shard
    from conformance.cluster.shards import fold_records

    out = tmp_path / "ray"
    args = ("--subject", "upstream", "--profile", "dev", "--seeds-per-test", "2", "--seed", "3")
    through = _check(tmp_path, out, *args, "--tests", LOCKSTEP, "--ray", cluster.address)
    assert through.returncode == 0, through.stdout[-3000:] + through.stderr[-3000:]
    shards = json.loads((out / "report" / "shards.json").read_text())["shards"]
    assert [s["seed"] for s in shards] == [3000, 3001]
    options = {"subject": "upstream", "profile": "dev", "shard_timeout_s": 900}
    records = [r for s in shards for r in run_shard(s, options)["records"]]
    by_test: dict[str, list[Any]] = {}
    for r in records:
        by_test.setdefault(r["nodeid"], []).append(r)
    here = {
        n: (f["outcome"], f["examples"], f["steps_compared"], f.get("first_difference"))
        for n, f in ((n, fold_records(rs)) for n, rs in by_test.items())
    }
    assert here == _tests(out)


def test_a_failure_one_run_found_is_replayed_first_by_the_next(cluster, tmp_path):
    """The example database goes through the driver: the second run, under another seed, starts
    from the failing example the first run's shard saved, and needs a couple of examples."""
    user = tmp_path / "user"
    subject = _mutant_module(user)
    test = LOCKSTEP + "::test_lockstep_parity[off-sync]"
    args = ("--subject", subject, "--profile", "dev", "--tests", test, "--ray", cluster.address)
    out = tmp_path / "run"
    first = _check(user, out, *args, "--seed", "1")
    assert first.returncode == 1, first.stdout[-3000:] + first.stderr[-3000:]
    (found,) = _tests(out).values()
    assert any((out / "db").rglob("*")), "the first run saved no example"
    second = _check(user, out, *args, "--seed", "2")
    assert second.returncode == 1, second.stdout[-3000:] + second.stderr[-3000:]
    (replayed,) = _tests(out).values()
    assert replayed[0] == "failed" and replayed[1] <= 3 < found[1]


def test_killing_the_second_node_mid_run_loses_no_shard(cluster, tmp_path):
    out = tmp_path / "ray"
    cmd = [sys.executable, "-m", "conformance.cli", "check", "--subject", "upstream"]
    cmd += ["--profile", "smoke", "--tests", LOCKSTEP, "--shard-by", "test", "-q"]
    cmd += ["--report-dir", str(out / "report"), "--failures-dir", str(out / "failures")]
    cmd += ["--example-db", str(out / "db"), "--ray", cluster.address]
    second = cluster.second.node_id[:6]
    killed = False

    def on_line(line: str, proc: subprocess.Popen[str]) -> None:
        nonlocal killed
        if not killed and f"/{second}: 0 done, 1 running" in line:
            time.sleep(3)  # well inside the shard's pytest
            cluster.remove_node(cluster.second, allow_graceful=False)
            killed = True

    rc, text = _watch(cmd, tmp_path, on_line, seconds=900)
    assert killed, text[-3000:]
    assert rc == 0, text[-3000:]
    report = json.loads((out / "report" / "compat-report.json").read_text())
    assert report["status"] == "pass" and report["summary"]["passed"] == 2
    assert report["environment"]["ray_retried"] != "none"
    shards = json.loads((out / "report" / "shards.json").read_text())
    assert len(shards["retried"]) == 1
    (retried,) = [s for s in shards["shards"] if s["retried"]]
    assert retried["attempts"][0].endswith(second) and retried["status"] == "done"
    assert "retried by Ray" in text


def test_a_shard_past_its_timeout_is_an_error_with_its_cause(tmp_path):
    from conformance.cluster.shard_run import run_shard

    shard = {"index": 0, "nodeids": [LOCKSTEP.split(str(ROOT) + "/")[1]], "seed": None}
    result = run_shard(shard, {"subject": "upstream", "profile": "smoke", "shard_timeout_s": 2})
    assert result["error"] == "timed out after 2 s" and result["records"] == []


def test_matrix_cells_through_ray_give_the_local_verdicts(cluster, tmp_path):
    def matrix(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            _matrix_cmd(out, *extra),
            env=_env(),
            capture_output=True,
            text=True,
            timeout=2400,
            check=False,
        )

    through = matrix(tmp_path / "ray", "--ray", cluster.address)
    local = matrix(tmp_path / "local")
    assert through.returncode == local.returncode, through.stdout[-3000:] + through.stderr[-3000:]
    assert "started on" in through.stdout

    assert _verdicts(tmp_path / "ray") == _verdicts(tmp_path / "local")
    assert len(_verdicts(tmp_path / "ray")) == 2
    assert (tmp_path / "ray" / "matrix-report.json").exists()


@pytest.mark.parametrize("retries", [3, 0], ids=["retried-by-ray", "past-its-retries"])
def test_killing_the_second_node_mid_matrix_loses_no_cell(cluster, tmp_path, retries):
    """The second node is killed while its cell's pytest runs. With retries, Ray runs the cell
    again on the head, which gives the local matrix's verdict, the cell and the merged report
    naming both nodes; past its retries the cell is an error cell with its cause and the matrix
    ends. Either way nothing the killed cell started runs on (its guard stopped it)."""
    out = tmp_path / "ray"
    second = cluster.second.node_id[:6]
    killed: list[str] = []

    def on_line(line: str, proc: subprocess.Popen[str]) -> None:
        found = re.match(rf"\s+(\S+): started on \S+/{second}$", line)
        if found and not killed:
            cell = found[1]
            # Kill inside the cell's check: once its pytest runs (the environment is reused).
            assert _until(lambda: any("pytest" in r for r in _cell_runs(cell + "-")), 300)
            time.sleep(5)
            cluster.remove_node(cluster.second, allow_graceful=False)
            killed.append(cell)

    cmd = _matrix_cmd(out, "--ray", cluster.address, "--ray-retries", str(retries))
    rc, text = _watch(cmd, tmp_path, on_line)
    assert killed, text[-3000:]
    (lost,) = killed
    cells = _cells(out)
    merged = {e["id"]: e for e in json.loads((out / "matrix-report.json").read_text())["cells"]}
    assert sorted(cells) == sorted(merged) and len(cells) == 2
    (kept,) = set(cells) - {lost}
    assert cells[kept]["status"] in ("pass", "fail"), text[-3000:]  # a verdict, not an error
    assert cells[kept]["environment"]["ray_retried"] == "none"
    retried = cells[lost]["environment"]["ray_retried"]
    assert merged[lost]["environment"]["ray_retried"] == retried  # the merged report says it
    if retries:
        assert rc == (0 if {c["status"] for c in cells.values()} == {"pass"} else 1), text[-3000:]
        # The retried cell's verdict is the one a local matrix gives its release.
        local = tmp_path / "local"
        one = _matrix_cmd(local, vllm=(cells[lost]["vllm"],))
        subprocess.run(one, env=_env(), capture_output=True, timeout=1200, check=False)
        assert _verdicts(out)[lost] == _verdicts(local)[lost]
        first, then = retried.removeprefix("by Ray: ").split(" -> ")
        assert first.endswith(second) and not then.endswith(second)
        assert f"retried by Ray after a lost worker or node: {lost} ({first} -> {then})" in text
    else:
        assert rc == 1, text[-3000:]
        assert cells[lost]["status"] == "error" and retried == "none"
        assert cells[lost]["error"].startswith("cell task lost after 0 retries by Ray: ")
        label = f"{cells[lost]['subject']} @ vLLM {cells[lost]['vllm']}"
        assert f"ERROR {label}: cell task lost after 0 retries by Ray" in text
    assert _until(lambda: not _cell_runs(), 30), _cell_runs()


def test_interrupting_the_matrix_driver_keeps_the_finished_cells(cluster, tmp_path):
    """SIGINT to the driver once a cell has finished and a third has started (three cells of
    the installed vLLM 0.33.0 on two one-CPU nodes): the driver cancels what is still out and
    merges what finished (exit 130); each finished cell keeps its compat report, a started one
    is a folder without cell.json (unfinished), ``merge`` reads them again, nothing runs on."""
    out = tmp_path / "ray"
    cmd = [sys.executable, "-m", "conformance.cli", "matrix", "--vllm", "0.33.0"]
    cmd += ["--subject", "upstream", "omni-scheduler", "omni", "--no-upstream-tests"]
    cmd += ["--profile", "smoke", "-n", "1", "--out", str(out), "--ray", cluster.address]
    started: list[str] = []
    finished: list[str] = []
    sent: list[bool] = []

    def on_line(line: str, proc: subprocess.Popen[str]) -> None:
        if found := re.match(r"\s+(\S+): started on ", line):
            started.append(found[1])
        if re.match(r"\[\d/3\] .*: \w+ on ", line):
            finished.append(line)
        if finished and len(started) == 3 and not sent:
            proc.send_signal(signal.SIGINT)
            sent.append(True)

    rc, text = _watch(cmd, tmp_path, on_line)
    assert len(started) == 3 and finished, text[-3000:]
    assert rc == 130, text[-3000:]
    assert "matrix --ray: interrupted; cancelling" in text
    cells = _cells(out)
    assert 1 <= len(cells) <= 2 and started[2] not in cells, text[-3000:]
    for name, cell in cells.items():
        report = json.loads((out / "cells" / name / "compat-report.json").read_text())
        assert cell["status"] == report["status"] and report["tests"]
    assert (out / "cells" / started[2]).is_dir()  # started, never finished
    merged = json.loads((out / "matrix-report.json").read_text())
    assert {e["id"] for e in merged["cells"]} == set(cells)
    assert started[2] in {u["id"] for u in merged["unfinished"]}
    again = subprocess.run(
        [sys.executable, "-m", "conformance.cli", "merge", str(out), "--out", str(tmp_path / "m")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert again.returncode == 1, again.stdout + again.stderr  # incomplete: a cell is pending
    remerged = json.loads((tmp_path / "m" / "matrix-report.json").read_text())
    assert [e["id"] for e in remerged["cells"]] == [e["id"] for e in merged["cells"]]
    assert _until(lambda: not _cell_runs(), 30), _cell_runs()
