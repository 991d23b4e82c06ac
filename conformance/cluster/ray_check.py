"""``omni-conformance check --ray ADDRESS``: the suite as shards (test x seed), each a Ray task on
any node (``conformance.cluster.shard_run``), merged into the one compat report a local run writes.

The driver collects the suite, plans the shards (``conformance.cluster.shards``), sends each the
example database of its test from the driver's folder (``--example-db``) and stores what each
returns there (the database is synced through the driver: no shared storage needed), writes the
shrunk traces into ``--failures-dir`` and prints progress per node. A lost worker or node is
Ray's retry (``max_retries``); a hung shard is stopped by its own timeout; a shard with no result
becomes an error record naming its cause. ``shards.json`` beside the report lists every shard,
the nodes it started on and whether it was retried. Layout and sizing: docs/cluster.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conformance.cluster.shard_run import node_name, run_shard, suite_root
from conformance.cluster.shards import (
    DERANDOMIZED,
    Progress,
    Shard,
    lost_record,
    merged_report,
    pack_folder,
    plan_shards,
    seeds_for,
    unpack_folder,
)
from conformance.plugin import example_db_key as db_key

# Past its own timeout, how long a shard may stay silent before the driver gives up on it.
DRIVER_GRACE_S = 180.0


def collect(args: argparse.Namespace) -> list[str]:
    """The suite's node ids as shards name them (relative to ``suite_root``)."""
    import tempfile

    from conformance._core import hash_seed, processes
    from conformance.cli._suite_command import pytest_command

    root = suite_root()
    tests = []
    for t in args.tests or ():
        path, _, rest = t.partition("::")
        p = Path(path).resolve()
        if p != root and root not in p.parents:
            raise ValueError(f"--tests {t}: under --ray a test path must be in {root}")
        tests.append(str(p.relative_to(root)) + (f"::{rest}" if rest else ""))
    with tempfile.TemporaryDirectory(prefix="omni-conformance-collect-") as tmp:
        ns = argparse.Namespace(
            subject=args.subject,
            profile=args.profile,
            report_dir=Path(tmp) / "report",
            failures_dir=Path(tmp) / "failures",
            oracle=args.oracle,
            quiet=True,
            workers=0,
            tests=tests or ["invariants"],
            pytest_args=["--rootdir", str(root), "--collect-only", *(args.pytest_args or ())],
        )
        env = hash_seed.pinned()
        env.setdefault("HF_HUB_OFFLINE", "1")
        # A module:attr subject from the user's folder: importable here as on the nodes.
        from conformance.cluster.ray_env import subject_py_modules

        extra = [str(Path(m).parent) for m in subject_py_modules(args.subject)]
        if extra:
            env["PYTHONPATH"] = os.pathsep.join([*extra, env.get("PYTHONPATH", "")]).rstrip(":")
        done = processes.run(
            pytest_command(ns), env=env, cwd=root, capture=True, merge_stderr=True, timeout_s=900
        )
    ids = [ln.strip() for ln in done.stdout.splitlines() if "::" in ln and " " not in ln.strip()]
    if not ids:
        tail = "\n".join(done.stdout.splitlines()[-10:])
        raise RuntimeError(f"collecting the suite found no test (exit {done.returncode}):\n{tail}")
    return ids


def _remote(retries: int) -> Any:
    import ray

    @ray.remote(num_cpus=1, max_retries=retries, retry_exceptions=False)
    def shard_task(
        shard_data: dict[str, Any], options: dict[str, Any], database: Any, board: Any
    ) -> dict[str, Any]:
        node = node_name()
        board.started.remote(Shard.from_dict(shard_data).id, node)
        result = run_shard(shard_data, options, database)
        result["node"] = node
        return result

    return shard_task


class _Results:
    """What the driver keeps of the shards: records, traces written, database files, shard rows."""

    def __init__(self, failures_dir: Path, db_dir: Path) -> None:
        self.failures_dir = failures_dir
        self.db_dir = db_dir
        self.records: list[dict[str, Any]] = []
        self.rows: list[dict[str, Any]] = []
        self.environment: dict[str, str] = {}
        self.written: set[str] = set()

    def sent_database(self, shard: Shard) -> dict[str, bytes]:
        if shard.seed is None:
            return {}
        files: dict[str, bytes] = {}
        for nodeid in shard.nodeids:
            key = db_key(nodeid)
            files.update({f"{key}/{k}": v for k, v in pack_folder(self.db_dir / key).items()})
        return files

    def take(self, shard: Shard, result: dict[str, Any], sent: dict[str, bytes]) -> bool:
        """Keep one shard's result; whether the shard failed (a violation, an error, no result)."""
        if result.get("database") is not None and shard.seed is not None:
            self.db_dir.mkdir(parents=True, exist_ok=True)
            unpack_folder(result["database"], self.db_dir)
            for gone in set(sent) - set(result["database"]):
                (self.db_dir / gone).unlink(missing_ok=True)  # hypothesis dropped a fixed example
        names: dict[str, str] = {}
        for name, text in (result.get("traces") or {}).items():
            target = name if name not in self.written else f"{Path(name).stem}--{shard.id}.json"
            self.failures_dir.mkdir(parents=True, exist_ok=True)
            (self.failures_dir / target).write_text(text)
            self.written.add(target)
            names[name] = str(self.failures_dir / target)
        records = [dict(r) for r in result.get("records") or ()]
        for r in records:
            if r.get("trace"):
                r["trace"] = names.get(Path(str(r["trace"])).name, r["trace"])
            if r.get("set_aside") and r["set_aside"].get("trace"):
                sa = dict(r["set_aside"])
                sa["trace"] = names.get(Path(str(sa["trace"])).name, sa["trace"])
                r["set_aside"] = sa
        if result.get("error"):
            cause = f"shard {shard.id}: {result['error']}"
            records = [lost_record(n, cause) for n in shard.nodeids]
        self.records.extend(records)
        if result.get("environment") and not self.environment:
            self.environment = dict(result["environment"])
        failed = any(r["outcome"] in ("failed", "error", "not_run") for r in records)
        self.rows.append(
            {
                **shard.to_dict(),
                "id": shard.id,
                "node": result.get("node"),
                "status": "error" if result.get("error") else ("failed" if failed else "done"),
                "error": result.get("error"),
                "seconds": result.get("seconds"),
                "log_tail": result.get("log_tail") if failed else None,
            }
        )
        return failed


def run_shards(
    args: argparse.Namespace,
    shards: list[Shard],
    results: _Results,
    say: Callable[[str], None],
    progress: Progress,
) -> None:
    """Submit every shard and keep each result as it arrives, counting in ``progress``."""
    import ray
    from ray.exceptions import RayError

    from conformance.cluster.ray_env import start_board, take_events

    shard_task = _remote(args.ray_retries)
    board = start_board()
    options = {
        "subject": args.subject,
        "profile": args.profile,
        "oracle": args.oracle,
        "allow_untested": args.allow_untested_vllm,
        "shard_timeout_s": args.shard_timeout,
    }
    pending: dict[Any, tuple[Shard, dict[str, bytes]]] = {}
    for shard in shards:
        sent = results.sent_database(shard)
        ref = shard_task.remote(shard.to_dict(), options, sent, board)
        pending[ref] = (shard, sent)
    since: dict[str, float] = {}
    last_line = ""
    limit = args.shard_timeout + DRIVER_GRACE_S
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=2.0)
        for shard_id, node in take_events(board):
            progress.started(shard_id, node)
            since[shard_id] = time.monotonic()
        for ref in ready:
            shard, sent = pending.pop(ref)
            try:
                result = ray.get(ref)
            except RayError as exc:
                cause = " ".join(str(exc).split())[:240]
                result = {"error": f"lost after {args.ray_retries} retries: {cause}"}
            failed = results.take(shard, result, sent)
            progress.finished(shard.id, result.get("node"), failed)
            if failed:
                say(f"shard {shard.id} {shard.label}: {results.rows[-1]['status']}")
        now = time.monotonic()
        for ref, (shard, sent) in list(pending.items()):
            if shard.id in since and now - since[shard.id] > limit:
                ray.cancel(ref, force=True)
                pending.pop(ref)
                result = {"error": f"no result {limit:.0f} s after it started; cancelled"}
                results.take(shard, result, sent)
                progress.finished(shard.id, None, True)
        line = progress.line()
        if line != last_line:
            say(line)
            last_line = line


def cmd_check_ray(
    args: argparse.Namespace, finish: Callable[[dict[str, Any], Path, int], int]
) -> int:
    """Run the sharded check; ``finish`` prints the report's summary and gives the exit code
    (``check``'s own, so a sharded run exits as a local one does)."""
    import ray

    from conformance._core.report import mark_incomplete, validate, write_report
    from conformance.cluster.ray_env import connect, nodes_alive

    def say(line: str) -> None:
        print(line, flush=True)

    report_dir = Path(args.report_dir)
    report_json = report_dir / "compat-report.json"
    report_json.unlink(missing_ok=True)
    started = time.monotonic()
    interrupted: str | None = None
    try:
        nodeids = collect(args)
    except (ValueError, RuntimeError) as exc:
        print(f"omni-conformance: error: {exc}", file=sys.stderr)
        return 2
    shards = plan_shards(nodeids, args.profile, args.seed, args.seeds_per_test, args.shard_by)
    joined = connect(args.ray, [args.subject])
    try:
        say(
            f"omni-conformance check --ray: {len(shards)} shard(s) ({len(nodeids)} tests, "
            f"{seeds_for(args.profile, args.seeds_per_test)} seed(s) each) on {joined}, "
            f"{nodes_alive()} node(s); example database {args.example_db}"
        )
        results = _Results(Path(args.failures_dir), Path(args.example_db))
        progress = Progress(len(shards))
        try:
            run_shards(args, shards, results, say, progress)
        except KeyboardInterrupt:
            interrupted = "interrupted by SIGINT"
            say(f"omni-conformance check --ray: {interrupted}; merging the shards that finished")
        nodes = len({n for v in progress.attempts.values() for n in v})
    finally:
        ray.shutdown()
    retried = progress.retried()
    environment = dict(results.environment)
    if not environment:
        from conformance._core.vllm_compat import environment_versions

        environment = environment_versions()
    environment["ray"] = f"{len(shards)} shards on {nodes} node(s) of {joined}"
    environment["ray_retried"] = (
        "; ".join(f"{k} ({' -> '.join(v)})" for k, v in sorted(retried.items())) or "none"
    )
    seed: Any = 0 if args.profile in DERANDOMIZED else args.seed
    report = merged_report(
        subject=args.subject,
        profile=args.profile,
        seed=seed,
        environment=environment,
        records=results.records,
        order=nodeids,
    )
    if interrupted:
        report = mark_incomplete(report, interrupted)
    validate(report)
    write_report(report, report_dir)
    for row in results.rows:
        row["attempts"] = progress.attempts.get(row["id"], [])
        row["retried"] = len(row["attempts"]) > 1
    shards_doc = {
        "seconds": round(time.monotonic() - started, 1),
        "seeds_per_test": seeds_for(args.profile, args.seeds_per_test),
        "retried": sorted(retried),
        "shards": sorted(results.rows, key=lambda r: r["index"]),
    }
    (report_dir / "shards.json").write_text(json.dumps(shards_doc, indent=1))
    if retried:
        say(f"retried by Ray after a lost worker or node: {', '.join(sorted(retried))}")
    say(f"shards: {report_dir / 'shards.json'}")
    rc = finish(report, report_json, 0)
    return 130 if interrupted else rc
