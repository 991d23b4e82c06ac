"""``omni-conformance check``: the invariant suite against the installed vLLM and a subject.

Loads the subject (one that patches vLLM gets an oracle in its own process,
``conformance._core.pristine``), runs ``pytest -m invariants`` on the installed suite with the
plugin, prints a summary (counts, a table per invariant, each violation's first difference) and
writes the compat report (JSON, Markdown, JUnit) into ``--report-dir``. Exit 0 when every test
that ran passed; 1 on a violation, a promised check that could not run, or no test run at all;
2 for an environment problem or a suite that could not start; 4 when the subject declares it does
not support this environment; 128 + the signal's number when interrupted (130 SIGINT, 143
SIGTERM, 129 SIGHUP). pytest, its xdist workers and oracle processes share one process group
(``conformance._core.processes``): on an interrupt the group gets one SIGINT, the report of the
tests that finished is written marked incomplete (``"complete": false``), one line says so, and
pytest's temporary folder is removed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from conformance._core import hash_seed, processes
from conformance._core.preflight import (
    check_environment,
    fail_environment,
    folder_problem,
    load_subject_quietly,
)
from conformance._core.vllm_compat.versions import ALLOW_UNTESTED_ENV
from conformance.cli._options import ORACLE_CHOICES, PROFILES, place_oracle
from conformance.cli._suite_command import _plugin_installed, pytest_command

__all__ = ["cmd_check", "finish_report", "pytest_command", "_plugin_installed", "register"]


def _summary(report: dict[str, Any]) -> str:
    from conformance._core.report import counts_line

    lines = [
        f"omni-conformance check: {report['status'].upper()}  subject={report['subject']}  "
        f"profile={report['profile']}  seed={report['seed']}  "
        f"vLLM {report['environment'].get('vllm')}  torch {report['environment'].get('torch')}  "
        f"Python {report['environment'].get('python')}  "
        f"hypothesis {report['environment'].get('hypothesis', 'unknown')}"
        + ("  (untested vLLM)" if report["environment"].get("vllm_support") == "untested" else ""),
        f"oracle: {report['environment'].get('oracle', 'in-process')}",
        counts_line(report["summary"]),
        f"{'invariant':<12} {'status':<14} {'examples':>9} {'steps':>9}  tolerated differences",
    ]
    for inv in report["invariants"]:
        tol = ", ".join(f"{k} x{v}" for k, v in sorted(inv["tolerated"].items())) or "-"
        lines.append(
            f"{inv['id']:<12} {inv['status']:<14} {inv['examples']:>9} "
            f"{inv['steps_compared']:>9}  {tol}"
        )
    if "reach" in report:
        t = report["reach"]["totals"]
        lines.append(
            f"reach of vLLM's scheduler code: lines {t['lines']}/{t['statements']}, "
            f"branches {t['branches']}/{t['branch_total']}"
        )
    ran = [c for c in report["clauses"] if c["status"] != "not_run"]
    if ran:
        lines.append("clauses: " + "  ".join(f"{c['id']}={c['status']}" for c in ran))
    for f in report["failures"]:
        lines.append(f"VIOLATION {f['test']}: {f['message']}")
        diff = f.get("first_difference")
        if diff:
            lines.append(
                f"  first difference: step {diff['step']} ({diff['op']}) {diff['path']}: "
                f"upstream={json.dumps(diff['upstream'])[:120]} "
                f"subject={json.dumps(diff['subject'])[:120]}"
            )
        if f.get("trace"):
            lines.append(f"  replay: omni-conformance replay {f['trace']}")
    for n in report.get("not_applicable", ()):
        lines.append(f"not applicable {n['test']}: {n['reason']}")
    for n in report.get("not_run", ()):
        lines.append(f"COULD NOT RUN {n['test']}: {n['reason']}")
    return "\n".join(lines)


def cmd_check(args: argparse.Namespace) -> int:
    allow_untested = args.allow_untested_vllm
    problem = check_environment(args.subject, allow_untested)
    if problem:
        return fail_environment(problem)
    if allow_untested:
        # The pytest child checks the version again; the opt-in reaches it this way.
        os.environ[ALLOW_UNTESTED_ENV] = "1"
    _, problem = load_subject_quietly(
        args.subject
    )  # here, so a broken subject is one line, not a run
    if problem:
        return fail_environment(problem)
    place_oracle(args.oracle)
    folders = [("--report-dir", args.report_dir), ("--failures-dir", args.failures_dir)]
    if args.ray:
        folders.append(("--example-db", args.example_db))
    for option, folder in folders:
        problem = folder_problem(folder)
        if problem:
            return fail_environment(f"{option} {folder}: {problem}")
    if args.ray:
        if args.reach:
            return fail_environment("--reach measures one process tree: not with --ray")
        from conformance.cluster.ray_check import cmd_check_ray

        return cmd_check_ray(args, finish_report)
    report_dir = Path(args.report_dir)
    report_json = report_dir / "compat-report.json"
    if report_json.exists():
        report_json.unlink()  # never mistake a stale report for this run's
    env = hash_seed.pinned()  # multi-id aborts free blocks in set order
    env.setdefault("HF_HUB_OFFLINE", "1")
    measured = None
    if args.reach:
        from conformance.release import reach

        measured = reach.write_config(report_dir / "reach-data", reach.target_files())
    cmd = pytest_command(args, launcher=reach.launcher(measured) if measured else ())
    print(
        f"omni-conformance check: subject={args.subject} profile={args.profile} "
        f"report-dir={report_dir}",
        flush=True,
    )
    # pytest's temporary folder (the suite's tmp_path) is the check's own, removed at the end.
    basetemp = None
    if not any(str(a).startswith("--basetemp") for a in args.pytest_args or ()):
        basetemp = tempfile.mkdtemp(prefix="omni-conformance-pytest-")
        cmd += ["--basetemp", basetemp]
    try:
        # On SIGINT, SIGTERM or SIGHUP the group gets one SIGINT: pytest then ends its session
        # and writes the report of what finished.
        done = processes.run(cmd, env=env, relay=True, stop_signal=signal.SIGINT)
    finally:
        if basetemp is not None:
            shutil.rmtree(basetemp, ignore_errors=True)
    rc = done.returncode
    if done.interrupted_by is not None:
        return _interrupted(args, report_json, done.interrupted_by)
    if not report_json.exists():
        # check's exit codes are its own (pytest's 4 is a usage error, not "unsupported").
        return fail_environment(
            f"the suite did not run: pytest exited {rc} without writing a report"
        )
    report = json.loads(report_json.read_text())
    if measured is not None:
        report = _with_reach(report, measured, report_dir)
    return finish_report(report, report_json, rc)


def finish_report(report: dict[str, Any], report_json: Path, rc: int) -> int:
    """Print the summary of a written report and return check's exit code for it (``rc``:
    pytest's, or 0 for a sharded run)."""
    print(_summary(report))
    print(f"report: {report_json} (+ compat-report.md, compat-report.junit.xml)")
    if report["status"] == "fail":
        return rc or 1
    if report.get("not_run"):
        first = report["not_run"][0]
        more = len(report["not_run"]) - 1
        print(
            f"omni-conformance check: a promised check could not run here: {first['test']}: "
            f"{first['reason']}" + (f" (+{more} more)" if more else ""),
            file=sys.stderr,
        )
        return rc or 1
    if report["summary"]["ran"] == 0:
        print("omni-conformance check: no test ran; nothing was checked", file=sys.stderr)
        return rc or 1
    return rc if rc not in (5,) else 1  # 5: no tests collected is a broken gate, not a pass


def _with_reach(report: dict[str, Any], rc: Path, report_dir: Path) -> dict[str, Any]:
    """The report with the run's reach of vLLM's scheduler code added, written again."""
    from conformance._core.report import validate, write_report
    from conformance.release import reach

    report = {**report, "reach": reach.report_section(reach.measure(rc))}
    validate(report)
    write_report(report, report_dir)
    shutil.rmtree(rc.parent, ignore_errors=True)  # the raw data; the figures are in the report
    return report


def _interrupted(args: argparse.Namespace, report_json: Path, signum: int) -> int:
    """Write the report of what finished, marked incomplete, and say so in one line."""
    name = signal.Signals(signum).name
    # Later signals wait: the partial report is short work and must not be cut in half.
    main_thread = threading.current_thread() is threading.main_thread()
    held = processes.RELAYED if main_thread else ()
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in held}
    try:
        _write_incomplete(args, report_json, f"interrupted by {name}")
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    print(
        f"omni-conformance check: interrupted by {name}; partial report marked incomplete: "
        f"{report_json} (exit {128 + signum})",
        file=sys.stderr,
    )
    return 128 + signum


def _write_incomplete(args: argparse.Namespace, report_json: Path, reason: str) -> None:
    """The report pytest wrote for the tests that finished (or an empty one), marked
    incomplete, as JSON, Markdown and JUnit."""
    from conformance._core.report import ReportBuilder, mark_incomplete, write_report

    report: dict[str, Any] | None = None
    if report_json.exists():
        try:
            report = json.loads(report_json.read_text())
        except (OSError, ValueError):
            report = None  # pytest was killed while writing it
    if report is None:
        from conformance._core.vllm_compat import environment_versions

        report = ReportBuilder(
            subject=str(args.subject),
            profile=args.profile,
            seed=None,
            environment=environment_versions(),
        ).build()
    write_report(mark_incomplete(report, reason), report_json.parent)


def register(sub: Any) -> None:
    c = sub.add_parser(
        "check",
        help="run the invariant suite and write the compat report",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    c.add_argument(
        "--subject",
        default=os.environ.get("OMNI_CONFORMANCE_SUBJECT", "omni"),
        help="subject runtime: a registered name (see 'subjects') or module:attr; "
        "$OMNI_CONFORMANCE_SUBJECT sets the default",
    )
    c.add_argument(
        "--profile",
        choices=PROFILES,
        default=os.environ.get("OMNI_CONFORMANCE_PROFILE", "ci"),
        help="hypothesis profile: ci (derandomized, bounded), dev, thorough (10x ci "
        "examples), smoke (a fifth of ci's, for the gate's plumbing) or deep (the nightly "
        "search of check --ray: thorough's depth per seed, several seeds per test); "
        "$OMNI_CONFORMANCE_PROFILE sets the default",
    )
    c.add_argument(
        "--report-dir",
        default="compat-report",
        help="folder for the compat report (JSON, Markdown, JUnit XML)",
    )
    c.add_argument(
        "--failures-dir",
        default=os.environ.get("OMNI_CONFORMANCE_FAILURES", "conformance-failures"),
        help="folder for shrunk failure traces (omni-conformance replay re-runs them); "
        "$OMNI_CONFORMANCE_FAILURES sets the default",
    )
    c.add_argument(
        "--allow-untested-vllm",
        action="store_true",
        help="run on a vLLM release outside the supported range; the report says 'untested vLLM'",
    )
    c.add_argument(
        "--oracle",
        choices=ORACLE_CHOICES,
        default="auto",
        help="where upstream vLLM runs: auto (in this process, or in its own process when "
        "loading the subject patched vLLM), or process (always its own process)",
    )
    c.add_argument("-n", "--workers", type=int, default=2, help="pytest-xdist workers (2 cores)")
    c.add_argument("-q", "--quiet", action="store_true", help="pytest's quiet progress")
    c.add_argument(
        "--reach",
        action="store_true",
        help="run the suite under coverage.py and add what it executed of vLLM's scheduler code "
        "(line and branch coverage per file) to the compat report; per function: 'reach'",
    )
    r = c.add_argument_group("on a Ray cluster (docs/cluster.md)")
    r.add_argument(
        "--ray",
        metavar="ADDRESS",
        default=None,
        help="run the suite as shards (test x seed), each a Ray task on the cluster at ADDRESS "
        "('auto': the cluster running on this machine, else a local Ray instance), merged into "
        "one compat report",
    )
    r.add_argument(
        "--seeds-per-test",
        type=int,
        default=None,
        help="seeds each test runs under (one shard each); a derandomized profile (ci, smoke) "
        "has one; default 8 under deep, else 1",
    )
    r.add_argument("--seed", type=int, default=0, help="base seed of the shards' seeds")
    r.add_argument(
        "--shard-by",
        choices=("file", "test"),
        default="file",
        help="a shard holds a test file's tests (one pytest start each) or a single test",
    )
    r.add_argument(
        "--example-db",
        default=os.environ.get("OMNI_CONFORMANCE_EXAMPLE_DB_DIR", "conformance-examples"),
        help="the driver's hypothesis example database (one folder per test), sent to each "
        "shard and updated from what it returns; $OMNI_CONFORMANCE_EXAMPLE_DB_DIR sets it",
    )
    r.add_argument(
        "--shard-timeout",
        type=float,
        default=3600.0,
        help="seconds a shard's pytest may run; past it the shard is an error",
    )
    r.add_argument(
        "--ray-retries",
        type=int,
        default=3,
        help="times Ray runs a shard again whose worker or node died",
    )
    c.add_argument(
        "--tests",
        nargs="*",
        default=[],
        help="test paths instead of the installed suite (empty: the installed suite)",
    )
    c.add_argument("pytest_args", nargs="*", default=[], help="extra pytest arguments (after --)")
    c.set_defaults(func=cmd_check)
