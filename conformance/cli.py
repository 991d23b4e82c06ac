"""``omni-conformance``: the CI gate and its tools.

``check``     loads the subject (one that patches vLLM when loaded gets an oracle in its own
              process, see ``conformance._core.pristine``), then runs ``pytest -m invariants`` on the installed
              ``invariants`` suite with the plugin, against the installed vLLM and that subject;
              shows pytest's progress, prints a summary (tests ran, passed, failed, not
              applicable; a table per invariant; the first difference of each violation), writes
              the compat report (JSON, Markdown, JUnit) into ``--report-dir``. Exit 0 when every
              test that ran passed (the rest being not applicable to the subject), 1 on any
              violation and when no test ran at all (nothing was checked), 2 for an environment
              problem (below) or a suite that could not start, 4 when the subject declares it does
              not support this environment (``SubjectUnsupported``, e.g. its vLLM release),
              130 when interrupted by SIGINT, 143 by SIGTERM (129 by SIGHUP: 128 + the signal's
              number):
              the suite (pytest, its xdist workers and oracle processes, all in one process
              group) is stopped and reaped, the report of the tests that finished is written
              marked incomplete (``"complete": false``, status ``incomplete`` unless something
              already failed, INCOMPLETE at the top of the Markdown, an error in the JUnit),
              one line says so, and pytest's temporary folder is removed.
``matrix``    the gate per vLLM release x subject, each cell in its own environment, merged into
              one report (``conformance.release.matrix``); ``merge`` merges cell folders.
``replay``    re-runs a saved failure trace and says what happened. Exit codes:
              1  reproduced: prints the first difference; when it is not the recorded one, prints
                 both ("reproduces with a DIFFERENT first difference");
              3  does not reproduce: no difference on this subject and vLLM (a trace is saved
                 only for a failure, so this is never a success);
              2  the trace file is unreadable, or an environment problem (below).
              A one-line note comes first when the subject or the vLLM version differ from the
              ones the trace recorded.
``record``    runs a corpus of workloads (generated under a fixed seed, plus every saved trace in
              ``--traces``) on the installed vLLM's own schedulers, sync and async, and writes
              each step's normalised observation (``conformance.release.record``). Exit 0 written, 2 bad
              input (an unreadable trace, an unwritable ``--out``) or an environment problem.
``release-diff``  compares two recordings of one corpus from two releases: per workload,
              identical or the first difference, grouped into behaviour changes, each with its
              shortest workload as a trace (``conformance.release.release_diff``). Exit 0 identical, 1
              differences found, 2 bad input (a malformed recording, recordings of different
              corpora: one line naming the file and the field).
``report``    re-renders Markdown and JUnit from a report's JSON.
``subjects``  lists the subjects this installation can check.

Environment problems (vLLM missing, an unsupported vLLM version, an unknown subject, a subject
that cannot be loaded or that patches vLLM) end with one line on stderr and exit code 2, never a
traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, NoReturn

from conformance._core.preflight import (
    EXIT_NOT_REPRODUCED,
    EXIT_REPRODUCED,
    check_environment,
    fail_environment,
    folder_problem,
    load_subject_quietly,
    subject_problem,
)
from conformance._core.vllm_compat.versions import ALLOW_UNTESTED_ENV

PROFILES = ("ci", "dev", "thorough", "smoke")


ORACLE_CHOICES = ("auto", "process")


def _place_oracle(choice: str) -> None:
    """Apply ``--oracle`` and say, in one line, when upstream runs in its own process."""
    from conformance._core.pristine import isolate_oracle, oracle_placement

    if choice == "process":
        isolate_oracle("requested by --oracle process")
    placement = oracle_placement()
    if placement.isolated:
        print(f"oracle: upstream vLLM runs {placement.describe()}", flush=True)


def _plugin_installed() -> bool:
    return any(ep.value == "conformance.plugin" for ep in entry_points(group="pytest11"))


def _has_xdist() -> bool:
    try:
        import xdist  # noqa: F401
    except ImportError:
        return False
    return True


def pytest_command(args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-m", "invariants", "-p", "no:cacheprovider"]
    if not _plugin_installed():
        cmd += ["-p", "conformance.plugin"]
    # Each check option backs the plugin option of the same last word.
    cmd += ["--conformance-subject", args.subject, "--conformance-profile", args.profile]
    cmd += ["--conformance-report-dir", str(args.report_dir)]
    cmd += ["--conformance-failures-dir", str(args.failures_dir)]
    cmd += ["--conformance-oracle", args.oracle]
    cmd += ["-o", "addopts=", "-rfE", "-v" if not args.quiet else "-q"]
    if args.workers and args.workers > 1 and _has_xdist():
        cmd += ["-n", str(args.workers)]
    cmd += list(args.tests) if args.tests else ["--pyargs", "invariants"]
    cmd += list(args.pytest_args or ())
    return cmd


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
    allow_untested = bool(getattr(args, "allow_untested_vllm", False))
    problem = check_environment(args.subject, allow_untested)
    if problem:
        return fail_environment(problem)
    if allow_untested:
        # The pytest child checks the version again; the opt-in reaches it this way.
        os.environ[ALLOW_UNTESTED_ENV] = "1"
    _, problem = load_subject_quietly(args.subject)  # here, so a broken subject is one line, not a run
    if problem:
        return fail_environment(problem)
    _place_oracle(args.oracle)
    for option, folder in (
        ("--report-dir", args.report_dir),
        ("--failures-dir", args.failures_dir),
    ):
        problem = folder_problem(folder)
        if problem:
            return fail_environment(f"{option} {folder}: {problem}")
    report_dir = Path(args.report_dir)
    report_json = report_dir / "compat-report.json"
    if report_json.exists():
        report_json.unlink()  # never mistake a stale report for this run's
    env = dict(os.environ)
    env.setdefault("PYTHONHASHSEED", "0")  # multi-id aborts free blocks in set order
    env.setdefault("HF_HUB_OFFLINE", "1")
    cmd = pytest_command(args)
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
        rc, signum = run_suite(cmd, env)
    finally:
        if basetemp is not None:
            shutil.rmtree(basetemp, ignore_errors=True)
    if signum is not None:
        return _interrupted(args, report_json, signum)
    if not report_json.exists():
        # check's exit codes are its own (pytest's 4 is a usage error, not "unsupported").
        return fail_environment(f"the suite did not run: pytest exited {rc} without writing a report")
    report = json.loads(report_json.read_text())
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


# After an interrupt, how long pytest may take to finish its session (and write the report of
# the tests that finished) before its process group is killed.
INTERRUPT_GRACE_S = 20.0


def run_suite(cmd: list[str], env: dict[str, str]) -> tuple[int, int | None]:
    """Run the suite; returns its exit code and the signal (SIGINT, SIGTERM) that interrupted
    it, if one did.

    pytest runs in a session of its own, so its xdist workers and oracle processes share one
    process group that is not the terminal's: a Ctrl-C reaches this process only, which passes
    one SIGINT to the whole group (pytest then ends its session and writes the report of what
    finished), waits ``INTERRUPT_GRACE_S`` for it, then kills the group; whatever of the group
    outlives pytest is killed too, so no child survives the check.
    """
    got: list[int] = []
    proc: subprocess.Popen[bytes] | None = None

    def handler(signum: int, frame: Any) -> None:
        if not got:
            got.append(signum)
            if proc is not None:
                _signal_group(proc.pid, signal.SIGINT)

    # SIGHUP too: in a session of its own the suite no longer hears a closing terminal.
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, handler) for sig in handled} if main_thread else {}
    try:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        if got:  # the signal came while pytest was being started
            _signal_group(proc.pid, signal.SIGINT)
        deadline: float | None = None
        while True:
            try:
                rc = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if not got:
                    continue
                if deadline is None:
                    deadline = time.monotonic() + INTERRUPT_GRACE_S
                elif time.monotonic() > deadline:
                    _signal_group(proc.pid, signal.SIGKILL)
        if got:
            _reap_group(proc.pid)
        return rc, (got[0] if got else None)
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _reap_group(pgid: int, wait_s: float = 10.0) -> None:
    """Kill what is left of the suite's process group and wait until none of it exists."""
    _signal_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)


def _interrupted(args: argparse.Namespace, report_json: Path, signum: int) -> int:
    """Write the report of what finished, marked incomplete, and say so in one line."""
    name = signal.Signals(signum).name
    # Later signals wait: the partial report is short work and must not be cut in half.
    held = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in held} if main_thread else {}
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


def cmd_replay(args: argparse.Namespace) -> int:
    problem = check_environment(args.subject)
    if problem:
        return fail_environment(problem)
    if not Path(args.trace).is_file():
        return fail_environment(f"no such trace: {args.trace}")
    from conformance._core.replay import TraceError, load_trace, replay_trace

    try:
        trace = load_trace(args.trace)
    except TraceError as exc:
        return fail_environment(str(exc))
    spec = args.subject or trace.meta.get("subject")
    if not isinstance(spec, str) or not spec:
        return fail_environment(f"{args.trace} records no subject; pass --subject")
    problem = subject_problem(spec)
    if problem:
        return fail_environment(problem)
    subject, problem = load_subject_quietly(spec)
    if problem:
        return fail_environment(problem)
    _place_oracle(args.oracle)
    if trace.meta.get("kind") == "audit":
        return _replay_audit(trace, subject, spec)
    outcome = replay_trace(trace, subject, spec)
    note = outcome.context_note()
    if note:
        print(note)
    if outcome.difference is None:
        print(f"does not reproduce: no difference on subject {spec!r}, vLLM {outcome.vllm}")
        return EXIT_NOT_REPRODUCED
    recorded = outcome.recorded_difference
    if recorded is not None and not outcome.same_as_recorded:
        print("reproduces with a DIFFERENT first difference:")
        print(f"  recorded: {recorded.headline()}")
        print(f"  now:      {outcome.difference.headline()}")
        return EXIT_REPRODUCED
    print(outcome.difference.headline())
    return EXIT_REPRODUCED


def _replay_audit(trace: Any, subject: Any, spec: str) -> int:
    """An audit trace (a run-time audit of the suite failed, not a lock-step difference): its
    ``meta.replay`` names the suite function that re-runs it with the same audits."""
    import importlib

    from conformance._core.replay import ReplayOutcome
    from conformance._core.vllm_compat import environment_versions

    vllm = environment_versions().get("vllm", "missing")

    module, _, attr = str(trace.meta.get("replay", "")).partition(":")
    try:
        rerun = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError):
        return fail_environment(f"audit trace names no replay function it can import: {module}:{attr}")
    note = ReplayOutcome(trace, spec, vllm, None, dict(trace.meta)).context_note()
    if note:
        print(note)
    problems = rerun(trace, subject)
    if not problems:
        print(f"does not reproduce: audits hold on subject {spec!r}, vLLM {vllm}")
        return EXIT_NOT_REPRODUCED
    recorded = str(trace.meta.get("problem", ""))
    if recorded and problems[0].split(":", 1)[0] != recorded.split(":", 1)[0]:
        print("reproduces with a DIFFERENT problem:")
        print(f"  recorded: {recorded}")
        print(f"  now:      {problems[0]}")
        return EXIT_REPRODUCED
    print(problems[0])
    return EXIT_REPRODUCED


def cmd_report(args: argparse.Namespace) -> int:
    from conformance._core.report import render_from_json, render_markdown, validate

    path = Path(args.report)
    if not path.exists():
        return fail_environment(f"no such report: {path}")
    if not path.is_file():
        return fail_environment(f"{path} is a folder; give the report's compat-report.json")
    try:
        report = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return fail_environment(f"{path} is not a compat report (not readable JSON: {exc})")
    try:
        validate(report)
    except Exception as exc:  # jsonschema.ValidationError; keep the message to one line
        return fail_environment(
            f"{path} does not match the compat-report schema: {str(exc).splitlines()[0]}"
        )
    paths = render_from_json(path, args.out)
    print(render_markdown(report), end="")
    print(f"wrote {paths['markdown']} and {paths['junit']}")
    return 0


def cmd_subjects(args: argparse.Namespace) -> int:
    from conformance._core.subjects import available_subjects

    for name, origin in sorted(available_subjects().items()):
        print(f"{name:<16} {origin}")
    return 0


class _Parser(argparse.ArgumentParser):
    """A usage error is one line (and exit 2), like every other bad input to the gate."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="omni-conformance", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

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
        "examples) or smoke (a fifth of ci's, for the gate's plumbing); "
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
        "--tests",
        nargs="*",
        default=[],
        help="test paths instead of the installed suite (empty: the installed suite)",
    )
    c.add_argument("pytest_args", nargs="*", default=[], help="extra pytest arguments (after --)")
    c.set_defaults(func=cmd_check)

    r = sub.add_parser("replay", help="re-run a saved failure trace")
    r.add_argument("trace")
    r.add_argument("--subject", default=None, help="override the subject recorded in the trace")
    r.add_argument(
        "--oracle",
        choices=ORACLE_CHOICES,
        default="auto",
        help="where upstream vLLM runs (as for check)",
    )
    r.set_defaults(func=cmd_replay)

    rp = sub.add_parser("report", help="re-render Markdown and JUnit from a report's JSON")
    rp.add_argument("report")
    rp.add_argument("--out", default=None)
    rp.set_defaults(func=cmd_report)

    from conformance.release.matrix_report import (
        add_merge_parser,  # merge: matrix cells -> one report
    )

    add_merge_parser(sub)

    from conformance.release.matrix import add_parser as add_matrix_parser

    add_matrix_parser(sub)

    s = sub.add_parser("subjects", help="list available subjects")
    s.set_defaults(func=cmd_subjects)

    from conformance.release.record import add_parser as add_record_parser
    from conformance.release.release_diff import add_parser as add_release_diff_parser

    add_record_parser(sub)  # the installed release's own schedulers on a corpus
    add_release_diff_parser(sub)  # two recordings of one corpus from two releases

    from conformance.release.upstream_tests import add_subparser as add_upstream_tests

    add_upstream_tests(sub)  # vLLM's own scheduler tests on the subject's classes
    return p


def _pin_hash_seed() -> None:
    """Re-run this command with ``PYTHONHASHSEED=0`` unless a seed is fixed: vLLM frees the
    blocks of a multi-id abort in set order, so step counts (and an oracle in its own process)
    depend on it. Only for a real command line, before anything heavy is imported."""
    if os.environ.get("PYTHONHASHSEED", "random") not in ("", "random"):
        return
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    os.execve(sys.executable, [sys.executable, "-m", "conformance.cli", *sys.argv[1:]], env)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        _pin_hash_seed()
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
