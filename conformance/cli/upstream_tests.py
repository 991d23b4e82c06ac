"""``omni-conformance upstream-tests``: the installed vLLM release's own scheduler tests
(``tests/v1/core`` of its sdist) with a subject's scheduler classes in place of vLLM's, and with
upstream's own as the baseline (the machinery: ``conformance.release.upstream_tests``).

``--json`` writes ``vllm``, ``subject``, the subject run's ``passed``/``failed``/``skipped``/
``errors``/``total``, ``failing`` (its failed and errored node ids), ``baseline_failing`` (those
of them that fail with upstream's classes too), ``duration_s`` (the subject run's wall time) and
``tests_source`` (the sdist's URL or file name), and nothing else: other tools read it.

Once cached, a run needs no network. Exit 0 when every test that passes with upstream's classes
passes with the subject's (with ``--no-baseline``: when every test passes); 1 otherwise (a subject
run that times out after the baseline finished included); 2 with one line on stderr for
environment problems (vLLM missing or unsupported, unknown subject, the tests neither cached nor
fetchable, a baseline that cannot run); 128 + the signal's number when interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tarfile
from pathlib import Path
from typing import Any

from conformance._core.preflight import check_environment, fail_environment, load_subject_quietly
from conformance.cli._options import add_release_tests_options, add_timeout_option
from conformance.release.upstream_tests import (
    SCHEDULER_SELECTION,
    SLOW_MODULES,
    CachedTests,
    Run,
    RunProblem,
    TestsUnavailable,
    Verdict,
    compare,
    counts,
    ensure_tests,
    is_upstream,
    result_json,
    run_pytest,
    select_tests,
)


def register(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "upstream-tests",
        help="run the installed vLLM release's own scheduler tests on a subject's classes",
        description="Run the installed vLLM release's own scheduler tests (tests/v1/core of its "
        "sdist) with the subject's scheduler classes in place of vLLM's, and with upstream's "
        "own as the baseline.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--subject",
        default=os.environ.get("OMNI_CONFORMANCE_SUBJECT", "omni"),
        help="subject whose scheduler classes replace vLLM's (a name or module:attr)",
    )
    add_release_tests_options(p)
    p.add_argument(
        "--sdist",
        type=Path,
        default=None,
        help="take the tests from this vLLM sdist (.tar.gz) or unpacked source tree instead of "
        "fetching it (refreshes the cache)",
    )
    p.add_argument(
        "--tests",
        nargs="+",
        default=SCHEDULER_SELECTION,
        metavar="FILE",
        help=f"'{SCHEDULER_SELECTION}': the test modules that build a scheduler (they import "
        "vLLM's Scheduler/AsyncScheduler or a create_scheduler helper); 'all': all of "
        "tests/v1/core; or test files relative to tests/v1/core",
    )
    p.add_argument(
        "--include-slow",
        action="store_true",
        help=f"with the default selection, also run {', '.join(sorted(SLOW_MODULES))}",
    )
    p.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the run with upstream's own classes (every failure then counts)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the result here as JSON")
    add_timeout_option(p)
    p.add_argument(
        "-n", "--workers", type=int, default=1, help="pytest-xdist workers per run (2 cores)"
    )
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="hide the child pytest's progress (only the summary is printed)",
    )
    p.add_argument(
        "-k",
        dest="keyword",
        default=None,
        help="only tests matching this pytest -k expression (both runs)",
    )
    p.set_defaults(func=cmd_upstream_tests)
    return p


def _print_summary(
    version: str, subject: str, run: Run, baseline: Run | None, verdict: Verdict, tests: CachedTests
) -> None:
    def line(r: Run) -> str:
        c = counts(r.outcomes)
        return (
            f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped, "
            f"{c['errors']} errors, {c['total']} total in {r.duration_s:.1f} s"
        )

    print(f"vLLM {version} scheduler tests ({tests.tests_source})")
    if run.record.get("rebound"):
        print(
            f"  swapped in: {run.record.get('sync')} / {run.record.get('async')} "
            f"({len(run.record['rebound'])} names rebound)"
        )
    print(f"  subject {subject}: {line(run)}")
    if baseline is not None:
        print(f"  upstream's own classes: {line(baseline)}")
    base = set(verdict.baseline_failing)
    if verdict.failing:
        print(f"failing with {subject} ({len(verdict.failing)}):")
        for nodeid in verdict.failing:
            note = "  [also fails with upstream's classes]" if nodeid in base else ""
            print(f"  {nodeid}{note}")
    # Passed with upstream's classes, merely skipped or absent with the subject's.
    for nodeid in sorted(set(verdict.regressions) - set(verdict.failing)):
        print(f"  {nodeid}  [{run.outcomes.get(nodeid, 'not run')}; passes with upstream's]")
    if verdict.regressions:
        print(
            f"FAIL: {len(verdict.regressions)} test(s) that pass with upstream's classes do not "
            f"pass with {subject}'s"
        )
    else:
        print(f"OK: every test that passes with upstream's classes passes with {subject}'s")


def cmd_upstream_tests(args: argparse.Namespace) -> int:
    from conformance._core.vllm_compat import EnvironmentProblem, check_vllm

    problem = check_environment(args.subject)
    if problem is not None:
        return fail_environment(problem)
    try:
        version = check_vllm()
    except EnvironmentProblem as exc:  # pragma: no cover - check_environment said it is fine
        return fail_environment(str(exc))
    try:
        tests = ensure_tests(
            Path(args.cache_dir).expanduser(),
            version,
            offline=args.offline,
            sdist=Path(args.sdist).expanduser() if args.sdist else None,
        )
        files = select_tests(tests.core, args.tests, include_slow=args.include_slow)
    except (TestsUnavailable, OSError, tarfile.TarError) as exc:
        return fail_environment(" ".join(str(exc).split()))
    if not files:
        return fail_environment(f"no scheduler test files in {tests.core}")
    # Loaded here once for its one-line problems (the child loads it again to swap it in).
    subject, problem = load_subject_quietly(args.subject)
    if problem is not None:
        return fail_environment(problem)
    name = str(subject.name)
    extra = ["-k", args.keyword] if args.keyword else []
    common = {"timeout_s": args.timeout_s, "workers": args.workers, "quiet": args.quiet}
    # A subject whose classes are upstream's own (``upstream``) is its own baseline: one run.
    own = is_upstream(subject)

    baseline: Run | None = None
    try:
        if not args.no_baseline or own:
            baseline = run_pytest("baseline", tests, files, None, extra=extra, **common)
            if not any(o == "passed" for o in baseline.outcomes.values()):
                return fail_environment(
                    f"no test passes with upstream's own classes here ({counts(baseline.outcomes)})"
                    "; the environment cannot run vLLM's tests"
                )
        if own and baseline is not None:
            run = baseline
            if args.no_baseline:
                baseline = None
        else:
            run = run_pytest("subject", tests, files, args.subject, extra=extra, **common)
    except RunProblem as exc:
        if exc.timed_out and baseline is not None:
            # Upstream finished; the subject did not: that is the subject's finding.
            print(f"omni-conformance: {exc}", file=sys.stderr)
            return 1
        return fail_environment(str(exc))
    if not own and not run.record.get("rebound"):
        return fail_environment(
            f"the swap reached no test module (subject {args.subject!r}): nothing was checked"
        )
    verdict = compare(run.outcomes, baseline.outcomes if baseline else None)
    _print_summary(version, name, run, baseline, verdict, tests)
    if args.json:
        doc = result_json(version, name, run.outcomes, verdict, run.duration_s, tests.tests_source)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if not verdict.regressions else 1
