"""``omni-conformance reach``: what the gate's suite executes of vLLM's scheduler code (line and
branch coverage per file and per function, ``conformance.release.reach``), and with
``--upstream-tests`` the same figures for the installed release's own ``tests/v1/core``, side by
side, with the functions only one of them reaches. The gate's run also measures the subject's
own package, area by area (``conformance.release.reach_subject``): the areas its
``reach_areas()`` hook declares, or one per first-level module of its schedulers' package.

Writes ``reach.json`` (schema ``conformance/schemas/reach.schema.json``) and ``reach.md`` into
``--out``, and the gate run's compat report into ``--out``/compat-report. Exit 0 when the
measured runs completed (the gate's verdict is the compat report's, not this command's); 2 with
one line on stderr for environment problems; 128 + the signal's number when interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tarfile
from pathlib import Path
from typing import Any

from conformance._core import hash_seed, processes, schemas
from conformance._core.preflight import check_environment, fail_environment, folder_problem
from conformance._core.render import render
from conformance.cli._options import PROFILES, add_release_tests_options, add_timeout_option
from conformance.cli.check import pytest_command as check_command
from conformance.release import reach, reach_subject
from conformance.release.upstream_tests import (
    RunProblem,
    TestsUnavailable,
    ensure_tests,
    run_pytest,
    select_tests,
)

GATE, UPSTREAM = "gate", "upstream tests"


def _subject_plan(spec: str) -> reach_subject.Plan:
    """The subject's own areas as installed here (loading the subject, under the pristine
    guard, as the gate's run will)."""
    from conformance._core.subjects import load_subject

    return reach_subject.plan(load_subject(spec))


def _gate_run(
    args: argparse.Namespace, folder: Path, planned: reach_subject.Plan
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The gate's suite against the subject under coverage.py, measuring vLLM's targets and the
    subject's own files in the same run; the targets' figures and the subject's section."""
    targets = reach.target_files()
    files = [*targets, *planned.all_files()]
    rc = reach.write_config(folder / "gate", files)
    gate = argparse.Namespace(
        subject=args.subject,
        profile=args.profile,
        report_dir=Path(args.out) / "compat-report",
        failures_dir=Path(args.out) / "conformance-failures",
        oracle="auto",
        quiet=True,
        workers=args.workers,
        tests=[],
        pytest_args=[],
    )
    cmd = check_command(gate, launcher=reach.launcher(rc))
    env = hash_seed.pinned()
    env.setdefault("HF_HUB_OFFLINE", "1")
    print(f"reach: the gate's suite on {args.subject} (profile {args.profile}), measured")
    done = processes.run(cmd, env=env, relay=True, stop_signal=signal.SIGINT)
    if done.interrupted_by is not None:
        raise processes.Interrupted(done.interrupted_by)
    if done.returncode not in (0, 1):  # 1: the suite found something; still measured
        raise RunProblem(f"the gate's suite ended with exit code {done.returncode}")
    entries = reach.combined(rc, files)
    return reach.measure(rc, entries=entries), reach_subject.section(planned, entries, GATE)


def _upstream_run(args: argparse.Namespace, version: str, folder: Path) -> dict[str, Any]:
    """The release's own scheduler tests, upstream's classes, under coverage.py."""
    tests = ensure_tests(Path(args.cache_dir).expanduser(), version, offline=args.offline)
    selected = select_tests(tests.core, None)
    rc = reach.write_config(folder / "upstream", reach.target_files())
    print(f"reach: vLLM {version}'s own tests/v1/core ({len(selected)} files), measured")
    run_pytest(
        "upstream",
        tests,
        selected,
        None,
        timeout_s=args.timeout_s,
        workers=args.workers,
        quiet=True,
        launcher=reach.launcher(rc),
    )
    return reach.measure(rc)


def cmd_reach(args: argparse.Namespace) -> int:
    from conformance._core.subjects import SubjectUnsupported
    from conformance._core.vllm_compat import EnvironmentProblem, check_vllm, environment_versions

    problem = check_environment(args.subject)
    if problem is not None:
        return fail_environment(problem)
    problem = folder_problem(args.out)
    if problem is not None:
        return fail_environment(f"--out {args.out}: {problem}")
    try:
        version = check_vllm()
    except EnvironmentProblem as exc:  # pragma: no cover - check_environment said it is fine
        return fail_environment(str(exc))
    work = Path(args.out) / "coverage-data"
    sides: dict[str, Any] = {}
    try:
        planned = _subject_plan(args.subject)
    except SubjectUnsupported as exc:
        return fail_environment(str(exc))
    except (ImportError, LookupError, TypeError) as exc:
        return fail_environment(f"subject {args.subject}: {exc}")
    try:
        sides[GATE], subject = _gate_run(args, work, planned)
        if args.upstream_tests:
            sides[UPSTREAM] = _upstream_run(args, version, work)
    except (TestsUnavailable, OSError, tarfile.TarError) as exc:
        return fail_environment(" ".join(str(exc).split()))
    except RunProblem as exc:
        return fail_environment(str(exc))
    environment = {
        **environment_versions(),
        "subject": args.subject,
        "profile": args.profile,
    }
    report = reach.build_report(sides, environment, subject)
    schemas.validate("reach", report)
    out = Path(args.out)
    (out / "reach.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    (out / "reach.md").write_text(render("reach.md.j2", report=report))
    print((out / "reach.md").read_text())
    return 0


def register(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "reach",
        help="measure what the gate executes of vLLM's scheduler code (coverage per function)",
        description="Run the gate's suite against a subject under coverage.py and report line "
        "and branch coverage of vLLM's scheduler, KV-cache manager and request modules, per "
        "file and per function, and of the subject's own package by area (its reach_areas() "
        "hook, or one area per first-level module); with --upstream-tests, vLLM's figures for "
        "the installed release's own tests/v1/core too, side by side.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--subject",
        default=os.environ.get("OMNI_CONFORMANCE_SUBJECT", "upstream"),
        help="subject runtime: a registered name or module:attr",
    )
    p.add_argument(
        "--profile", choices=PROFILES, default="ci", help="hypothesis profile of the gate's run"
    )
    p.add_argument(
        "--upstream-tests",
        action="store_true",
        help="also measure the installed release's own tests/v1/core (upstream's classes)",
    )
    p.add_argument("--out", default="reach-report", help="folder for reach.json and reach.md")
    p.add_argument("-n", "--workers", type=int, default=2, help="pytest-xdist workers")
    add_release_tests_options(p)
    add_timeout_option(p)
    p.set_defaults(func=cmd_reach)
    return p
