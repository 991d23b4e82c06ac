"""``omni-conformance replay TRACE...``: re-runs saved failure traces and says what happened.

Exit 1 when it reproduces: the first difference is printed, and when it is not the recorded one
both are ("reproduces with a DIFFERENT first difference"); 3 when it does not reproduce (no
difference on this subject and vLLM: a trace is saved only for a failure, so this is never a
success); 2 when the trace file is unreadable or for an environment problem. A one-line note
comes first when the subject or the vLLM version differ from the ones the trace recorded. An
audit trace (a run-time audit failed, not a lock-step difference) is re-run by the suite function
its ``meta.replay`` names. Several traces are replayed in one process (each subject loaded once),
each under a ``== TRACE`` line; the exit status is then 1 when any reproduced, 3 when none did.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from conformance._core.preflight import (
    EXIT_NOT_REPRODUCED,
    EXIT_REPRODUCED,
    check_environment,
    fail_environment,
    load_subject_quietly,
    subject_problem,
)
from conformance.cli._options import ORACLE_CHOICES, place_oracle


def cmd_replay(args: argparse.Namespace) -> int:
    traces = list(args.trace)
    problem = check_environment(args.subject)
    if problem:
        return fail_environment(problem)
    for path in traces:
        if not Path(path).is_file():
            return fail_environment(f"no such trace: {path}")
    if len(traces) == 1:
        return _replay_one(traces[0], args.subject, {}, args.oracle)
    # Several traces, one process: each subject is loaded once. A trace's lines follow its
    # name; the exit status is 1 when any reproduced, 3 when none did.
    subjects: dict[str, Any] = {}
    codes = []
    for path in traces:
        print(f"== {path}")
        codes.append(_replay_one(path, args.subject, subjects, args.oracle))
    if any(code not in (EXIT_REPRODUCED, EXIT_NOT_REPRODUCED) for code in codes):
        return max(code for code in codes if code not in (EXIT_REPRODUCED, EXIT_NOT_REPRODUCED))
    return EXIT_REPRODUCED if EXIT_REPRODUCED in codes else EXIT_NOT_REPRODUCED


def _replay_one(path: str, override: str | None, subjects: dict[str, Any], oracle: str) -> int:
    """Replay one trace (loading its subject unless ``subjects`` holds it); its exit code.
    Where the oracle runs is decided (and said) once the first subject is loaded: loading
    one that patches vLLM is what moves the oracle to its own process."""
    from conformance._core.replay import TraceError, load_trace, replay_trace

    try:
        trace = load_trace(path)
    except TraceError as exc:
        return fail_environment(str(exc))
    spec = override or trace.meta.get("subject")
    if not isinstance(spec, str) or not spec:
        return fail_environment(f"{path} records no subject; pass --subject")
    subject = subjects.get(spec)
    if subject is None:
        problem = subject_problem(spec)
        if problem:
            return fail_environment(problem)
        subject, problem = load_subject_quietly(spec)
        if problem:
            return fail_environment(problem)
        if not subjects:
            place_oracle(oracle)
        subjects[spec] = subject
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
        return fail_environment(
            f"audit trace names no replay function it can import: {module}:{attr}"
        )
    note = ReplayOutcome(trace, spec, vllm, None, dict(trace.meta)).context_note()
    if note:
        print(note)
    from conformance._core.capabilities import NotApplicable

    try:
        problems = rerun(trace, subject)
    except NotApplicable as exc:
        # The trace checks something the subject does not have (upstream has no chunk path):
        # it cannot happen there, which is what a replay against upstream asks.
        print(f"does not reproduce: {exc} (vLLM {vllm})")
        return EXIT_NOT_REPRODUCED
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


def register(sub: Any) -> None:
    r = sub.add_parser("replay", help="re-run saved failure traces")
    r.add_argument(
        "trace",
        nargs="+",
        help="one or more traces; several are replayed in one process, each under its name",
    )
    r.add_argument("--subject", default=None, help="override the subject recorded in the trace")
    r.add_argument(
        "--oracle",
        choices=ORACLE_CHOICES,
        default="auto",
        help="where upstream vLLM runs (as for check)",
    )
    r.set_defaults(func=cmd_replay)
