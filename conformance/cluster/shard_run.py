"""One shard of a sharded check, where it runs (a Ray task's body, or this process): the suite's
pytest on one test under one seed, bounded by a timeout, in a folder of its own; the example
database it was given is its starting point, and what it returns is the shard's compat-report
records, its saved (already shrunk) failure traces and the database after the run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from conformance.cluster.shards import Shard, pack_folder, unpack_folder

LOG_TAIL_LINES = 15


def suite_root() -> Path:
    """The folder holding the installed ``invariants`` package (shard node ids are relative
    to it, so a node id names the same test on every node)."""
    import invariants

    return Path(invariants.__file__).resolve().parent.parent


def shard_command(shard: Shard, options: Mapping[str, Any], work: Path) -> list[str]:
    from conformance.cli._suite_command import pytest_command

    ns = argparse.Namespace(
        subject=options["subject"],
        profile=options["profile"],
        report_dir=work / "report",
        failures_dir=work / "failures",
        oracle=options.get("oracle", "auto"),
        quiet=True,
        workers=0,
        tests=list(shard.nodeids),
        pytest_args=["--rootdir", str(suite_root()), "--basetemp", str(work / "pytest")],
    )
    return pytest_command(ns)


def shard_env(shard: Shard, options: Mapping[str, Any], db: Path | None) -> dict[str, str]:
    from conformance._core import hash_seed
    from conformance._core.vllm_compat.versions import ALLOW_UNTESTED_ENV
    from conformance.plugin import EXAMPLE_DB_ENV, SHARD_SEED_ENV

    env = hash_seed.pinned()
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    for var in (SHARD_SEED_ENV, EXAMPLE_DB_ENV):
        env.pop(var, None)
    if shard.seed is not None:
        env[SHARD_SEED_ENV] = str(shard.seed)
        if db is not None:
            env[EXAMPLE_DB_ENV] = str(db)
    if options.get("allow_untested"):
        env[ALLOW_UNTESTED_ENV] = "1"
    return env


def _tail(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return "\n".join(lines[-LOG_TAIL_LINES:])


def run_shard(
    shard_data: Mapping[str, Any],
    options: Mapping[str, Any],
    database: Mapping[str, bytes] | None = None,
) -> dict[str, Any]:
    """Run one shard; a dict with ``records`` (the shard's compat-report tests), ``traces``
    (file name -> text), ``database`` (the test's example files after the run), ``error``
    (why no report came back, else None), ``returncode``, ``seconds`` and ``log_tail``."""
    from conformance._core import processes

    shard = Shard.from_dict(shard_data)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f"omni-conformance-{shard.id}-"))
    try:
        db = work / "db" if shard.seed is not None else None
        if db is not None:
            db.mkdir()
            unpack_folder(database or {}, db)
        cmd = shard_command(shard, options, work)
        log = work / "pytest.log"
        with open(log, "w") as out:
            done = processes.run(
                cmd,
                env=shard_env(shard, options, db),
                cwd=suite_root(),
                timeout_s=float(options.get("shard_timeout_s", 3600.0)),
                output=out,
            )
        result: dict[str, Any] = {
            "shard": shard.to_dict(),
            "records": [],
            "traces": {},
            "database": pack_folder(db) if db is not None else {},
            "error": None,
            "returncode": done.returncode,
            "seconds": 0.0,
            "log_tail": _tail(log),
            "python": sys.version.split()[0],
            "environment": {},
        }
        report = work / "report" / "compat-report.json"
        if done.timed_out:
            result["error"] = f"timed out after {options.get('shard_timeout_s')} s"
        elif not report.exists():
            last = result["log_tail"].splitlines()[-1:] or ["no output"]
            result["error"] = f"pytest exited {done.returncode} without a report: {last[0]}"
        else:
            import json

            data = json.loads(report.read_text())
            result["records"] = data["tests"]
            result["environment"] = data["environment"]
        failures = work / "failures"
        if failures.is_dir():
            result["traces"] = {p.name: p.read_text() for p in sorted(failures.glob("*.json"))}
        result["seconds"] = round(time.monotonic() - started, 2)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def node_name() -> str:
    """This node as progress lines name it: its address and the start of its Ray node id."""
    try:
        import ray

        ctx = ray.get_runtime_context()
        return f"{ray.util.get_node_ip_address()}/{ctx.get_node_id()[:6]}"
    except Exception:  # noqa: BLE001 - outside Ray: the host
        return os.uname().nodename
