"""``check --ray``'s shards: shards per second and examples per second on a one-node and a two-node
Ray cluster on this machine (``ray.cluster_utils.Cluster``, one CPU per node), against the same
shards run one after another in this process's children without Ray (``run_shard``), and the
Ray dispatch overhead per shard: (one-node wall time - local wall time) / shards, both running
one shard at a time.

Workload: subject ``upstream``, profile ``dev``, the lock-step test file's two tests, one shard
per test and seed, ``OMNI_BENCH_SHARD_SEEDS`` seeds (default 2: four shards). Each shard is a
pytest start (vLLM's import included) plus its examples. Cluster start-up and the suite's
collection are outside the timed region. Figures: docs/cluster.md. Run:
``pytest benchmarks/test_bench_cluster.py -o addopts="" --benchmark-enable -p no:cacheprovider -s``
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")

from conformance.cluster.ray_check import _Results, run_shards  # noqa: E402
from conformance.cluster.shard_run import run_shard  # noqa: E402
from conformance.cluster.shards import Progress, plan_shards  # noqa: E402

SEEDS = int(os.environ.get("OMNI_BENCH_SHARD_SEEDS", "2"))
TESTS = [
    "invariants/test_ar_inv_001_lockstep.py::test_lockstep_parity[off-sync]",
    "invariants/test_ar_inv_001_lockstep.py::test_lockstep_parity[off-async]",
]
STORE = 250 * 2**20
_ROWS: dict[str, dict[str, float]] = {}


def _args(tmp: Path) -> argparse.Namespace:
    return argparse.Namespace(
        subject="upstream",
        profile="dev",
        oracle="auto",
        allow_untested_vllm=False,
        shard_timeout=1800.0,
        ray_retries=3,
        failures_dir=str(tmp / "failures"),
        example_db=str(tmp / "db"),
    )


def _row(name: str, seconds: float, shards: int, examples: int) -> dict[str, float]:
    row = {
        "seconds": round(seconds, 1),
        "shards_per_s": round(shards / seconds, 4),
        "examples_per_s": round(examples / seconds, 2),
        "shards": shards,
        "examples": examples,
    }
    _ROWS[name] = row
    return row


def _examples(records: list[dict[str, Any]]) -> int:
    return sum(int(r.get("examples") or 0) for r in records)


def _local(tmp: Path) -> dict[str, float]:
    args = _args(tmp)
    shards = plan_shards(TESTS, "dev", 0, SEEDS, by="test")
    options = {"subject": "upstream", "profile": "dev", "shard_timeout_s": args.shard_timeout}
    t0 = time.monotonic()
    records = [r for s in shards for r in run_shard(s.to_dict(), options)["records"]]
    return _row(
        "local (no Ray), 1 at a time", time.monotonic() - t0, len(shards), _examples(records)
    )


def _on_cluster(tmp: Path, nodes: int) -> dict[str, float]:
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "object_store_memory": STORE},
    )
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=1, object_store_memory=STORE)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        args = _args(tmp)
        shards = plan_shards(TESTS, "dev", 0, SEEDS, by="test")
        results = _Results(Path(args.failures_dir), Path(args.example_db))
        t0 = time.monotonic()
        run_shards(args, shards, results, lambda line: None, Progress(len(shards)))
        seconds = time.monotonic() - t0
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert all(r["outcome"] == "passed" for r in results.records)
    return _row(f"Ray, {nodes} node(s) x 1 CPU", seconds, len(shards), _examples(results.records))


@pytest.mark.benchmark(group="cluster")
def test_shards_locally(benchmark, tmp_path):
    row = benchmark.pedantic(_local, args=(tmp_path,), rounds=1, iterations=1)
    benchmark.extra_info.update(row)


@pytest.mark.benchmark(group="cluster")
@pytest.mark.parametrize("nodes", [1, 2])
def test_shards_on_a_cluster(benchmark, tmp_path, nodes):
    row = benchmark.pedantic(_on_cluster, args=(tmp_path, nodes), rounds=1, iterations=1)
    benchmark.extra_info.update(row)


def test_cluster_table():
    """The table (run after the three above, in one session)."""
    if len(_ROWS) < 3:
        pytest.skip("needs the three measurements of this module in the same session")
    local = _ROWS["local (no Ray), 1 at a time"]
    one = _ROWS["Ray, 1 node(s) x 1 CPU"]
    print(f"\n{'run':<30} {'s':>7} {'shards/s':>9} {'examples/s':>11}")
    for name, r in _ROWS.items():
        print(f"{name:<30} {r['seconds']:>7} {r['shards_per_s']:>9} {r['examples_per_s']:>11}")
    overhead = (one["seconds"] - local["seconds"]) / one["shards"]
    print(f"Ray dispatch overhead per shard (1 node vs local): {overhead:.1f} s")
