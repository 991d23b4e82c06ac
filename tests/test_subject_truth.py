"""The gate tells the truth about subjects it does not know, end to end through the CLI.

Each test runs ``omni-conformance check`` in a subprocess (its own report and failures folders
under ``tmp_path``; profile ``smoke``, since the plumbing is the point here, not the depth of the
search) and reads the JSON report:

* ``upstream`` passes; every test needing a capability upstream does not declare is reported
  not applicable, with a reason naming that capability; every test it can run passes.
* a ten-line third-party subject (vLLM's own schedulers, named by qualname, nothing declared)
  passes, and no pytest process of the run loaded any ``omni_runtime`` module but the platform
  plugin vLLM loads itself (the subject's module records ``sys.modules`` at exit, in every
  process: it is also loaded as a plugin with ``-p``).
* a third-party subject whose scheduler re-queues preempted requests at the back of the waiting
  queue fails, and only the lock-step tests fail, each naming a queue or request field; the tests
  that cannot see the bug are not applicable or pass.

Which test needs which capability is read from the suite's source (calls of
``conformance._core.needs.require(subject, "<hook>", "<what>")`` and ``require_worker``, followed
through helper functions of the ``invariants`` package), so the expectations follow the suite.
"""

from __future__ import annotations

import ast
import json
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from conformance._core.capabilities import CAPABILITY_HOOKS

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "invariants"
WORKER = "worker"  # the pseudo-capability ``require_worker`` checks (``has_worker()``)
# The capability hooks a subject may leave at None (``conformance._core.capabilities``).
HOOKS = (WORKER, *CAPABILITY_HOOKS)
# The lock-step comparisons (plain and under speculative decoding) and the runtime audit: the
# only tests that can see a bug in queue order.
LOCKSTEP_TESTS = {
    "test_lockstep_parity",
    "test_lockstep_parity_speculative",
    "test_runtime_audit",
    "test_scheduler_axis",
}
# Where a queue-order bug first shows: the queues and what follows from them (on a statistics
# axis, the step's counts; with KV events, the blocks the reordered requests store).
FIELD_PREFIXES = ("queues.", "sched_out.", "requests.", "stats", "kv_events")
NOT_APPLICABLE = ("not_applicable", "skipped")
# What a report says when it lost the reason: not a reason.
PLACEHOLDER_REASONS = {"", "skipped", "not applicable", "not_applicable"}
ALLOWED_RUNTIME_MODULES = {"omni_runtime", "omni_runtime.platform"}


# ---- what each test of the suite needs ------------------------------------------------------


def _call_name(node: ast.Call) -> str | None:
    fn = node.func
    if isinstance(fn, ast.Name):
        return fn.id
    if isinstance(fn, ast.Attribute):
        return fn.attr
    return None


def _str_arg(node: ast.Call, index: int) -> str | None:
    if len(node.args) > index:
        arg = node.args[index]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
    return None


def capability_needs(suite: Path = SUITE) -> dict[tuple[str, str], dict[str, str]]:
    """``(test file, test function) -> {hook: what}`` for every test of the suite.

    ``what`` is the phrase ``require`` puts in the not-applicable reason ("real worker" for
    ``require_worker``). Calls are followed into functions defined in, or imported from, modules
    of the ``invariants`` package (a whole function body, nested functions included).
    """
    direct: dict[tuple[str, str], dict[str, str]] = {}
    calls: dict[tuple[str, str], set[tuple[str, str]]] = {}
    tests: list[tuple[str, str]] = []
    for path in sorted(suite.glob("*.py")):
        module = path.stem
        tree = ast.parse(path.read_text(), filename=str(path))
        defined = {
            n.name
            for n in tree.body
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        }
        imported: dict[str, tuple[str, str]] = {}
        for n in tree.body:
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("invariants."):
                for alias in n.names:
                    imported[alias.asname or alias.name] = (n.module.split(".", 1)[1], alias.name)
        for fn in tree.body:
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            key = (module, fn.name)
            needs: dict[str, str] = {}
            callees: set[tuple[str, str]] = set()
            for node in ast.walk(fn):
                if not isinstance(node, ast.Call):
                    continue
                name = _call_name(node)
                if name == "require" and (hook := _str_arg(node, 1)) is not None:
                    needs[hook] = _str_arg(node, 2) or hook.replace("_", " ")
                elif name == "require_worker":
                    needs[WORKER] = "real worker"
                elif isinstance(node.func, ast.Name) and name in defined:
                    callees.add((module, name))
                elif isinstance(node.func, ast.Name) and name in imported:
                    callees.add(imported[name])
            direct[key] = needs
            calls[key] = callees
            if module.startswith("test_") and fn.name.startswith("test_"):
                tests.append(key)

    def closure(key: tuple[str, str], seen: set[tuple[str, str]]) -> dict[str, str]:
        found = dict(direct.get(key, {}))
        for callee in calls.get(key, ()):
            if callee not in seen:
                seen.add(callee)
                found = {**closure(callee, seen), **found}
        return found

    return {
        (f"{module}.py", name): closure((module, name), {(module, name)}) for module, name in tests
    }


def test_needs_are_read_from_the_suite():
    """The derivation sees the suite: each capability but declared attributes gates some test
    through ``require``/``require_worker``, and the lock-step tests need nothing."""
    needs = capability_needs()
    seen = {hook for hooks in needs.values() for hook in hooks}
    assert set(HOOKS) - {"declared_attributes"} <= seen, (seen, needs)
    lockstep = [hooks for (_, name), hooks in needs.items() if name.startswith("test_lockstep_")]
    assert len(lockstep) >= 2 and not any(lockstep), needs


# ---- reading the report (the gate runs through ``tests/conftest.py``'s ``run_check``) ------


def node_key(record: dict[str, Any]) -> tuple[str, str]:
    """``(file name, function name)`` of a record's node id (parametrization dropped)."""
    path, _, rest = record["nodeid"].partition("::")
    return Path(path).name, rest.split("::")[-1].split("[")[0]


def is_not_applicable(record: dict[str, Any]) -> bool:
    return record["outcome"] in NOT_APPLICABLE


def reason_of(record: dict[str, Any], report: dict[str, Any]) -> str:
    """A not-applicable test's reason, wherever this report version keeps it."""
    for key in ("reason", "message", "skip_reason"):
        value = record.get(key)
        if isinstance(value, str) and value.strip():
            return value
    for entry in report.get("not_applicable") or ():
        if isinstance(entry, dict) and entry.get("test") == record["nodeid"]:
            value = entry.get("reason")
            if isinstance(value, str) and value.strip():
                return value
    return ""


def summary(run: Any) -> str:
    if run.report is None:
        return "no report"
    recs = run.report["tests"]
    na = sum(1 for r in recs if is_not_applicable(r))
    passed = sum(1 for r in recs if r["outcome"] == "passed")
    failed = sum(1 for r in recs if r["outcome"] in ("failed", "error"))
    return (
        f"{len(recs)} tests: {len(recs) - na} ran, {passed} passed, {failed} failed, "
        f"{na} not applicable"
    )


def check_applicability(run: Any, provided: set[str]) -> list[dict[str, Any]]:
    """Every test needing a hook outside ``provided`` is not applicable, with a reason naming
    what is missing; every other not-applicable test has a reason too. Returns the records of
    tests that needed nothing missing (they must have run)."""
    report = run.report
    assert report is not None, f"no compat report written:\n{run.tail()}"
    needs = capability_needs()
    records = run.records()
    assert records, f"the report lists no tests:\n{run.tail()}"
    runnable = []
    problems = []
    for rec in records:
        key = node_key(rec)
        missing = {h: what for h, what in needs.get(key, {}).items() if h not in provided}
        reason = reason_of(rec, report)
        if missing:
            if not is_not_applicable(rec):
                problems.append(f"{rec['nodeid']}: {rec['outcome']}, but needs {sorted(missing)}")
            elif not any(what.lower() in reason.lower() for what in missing.values()):
                problems.append(
                    f"{rec['nodeid']}: not applicable, reason {reason!r} names none of "
                    f"{sorted(missing.values())}"
                )
        elif is_not_applicable(rec):
            if reason.strip().lower() in PLACEHOLDER_REASONS:
                problems.append(f"{rec['nodeid']}: not applicable without a reason ({reason!r})")
        elif key in needs:
            runnable.append(rec)
    assert not problems, "\n".join(problems) + f"\n{summary(run)}"
    counted = report.get("summary", {}).get("not_applicable")
    if counted is not None:
        assert counted == sum(1 for r in records if is_not_applicable(r)), report["summary"]
    return runnable


def test_applicability_check_catches_untruthful_reports(tmp_path):
    """Positive control for ``check_applicability`` on made-up reports: a test that needs a
    missing capability but passed, a not-applicable test whose reason names another
    capability, and one with a placeholder reason are each reported."""
    needs = capability_needs()
    chunk = next(k for k, v in needs.items() if set(v) == {"chunk_delivery"})
    adapter = next(k for k, v in needs.items() if set(v) == {"input_adapter"})
    plain = next(k for k, v in needs.items() if not v)

    def run_with(*records: dict[str, Any]) -> SimpleNamespace:
        report = {"tests": list(records), "not_applicable": [], "summary": {}}
        return SimpleNamespace(report=report, records=lambda: list(records), tail=lambda: "")

    def rec(key: tuple[str, str], outcome: str, reason: str | None = None) -> dict[str, Any]:
        return {"nodeid": f"{key[0]}::{key[1]}", "outcome": outcome, "reason": reason}

    good = (
        rec(chunk, "not_applicable", "not applicable: subject 'x' provides no chunk delivery"),
        rec(adapter, "skipped", "subject 'x' provides no input adapter"),
        rec(plain, "passed"),
    )
    assert check_applicability(run_with(*good), set()) == [good[2]]
    bad_runs = {
        "needs ['chunk_delivery']": (rec(chunk, "passed"),),
        "names none of": (rec(adapter, "not_applicable", "provides no source layout"),),
        "without a reason": (rec(plain, "not_applicable", "skipped"),),
    }
    for expected, records in bad_runs.items():
        try:
            check_applicability(run_with(*records), set())
        except AssertionError as exc:
            assert expected in str(exc), exc
        else:
            raise AssertionError(f"not caught: {records}")


# ---- subjects written by a third party ------------------------------------------------------

RECORDER = """
import atexit, json, os, sys

LOADED = []


@atexit.register
def _record_runtime_modules():
    row = {
        "pid": os.getpid(),
        "worker": os.environ.get("PYTEST_XDIST_WORKER"),
        "subject_loaded": bool(LOADED),
        "modules": sorted(m for m in sys.modules if m.startswith("omni_runtime")),
    }
    with open(os.environ["SUBJECT_TRUTH_RECORD"], "a") as out:
        out.write(json.dumps(row) + "\\n")
"""

THIRD_PARTY = '''
from conformance._core.subjects import BaseSubject


class MySubject(BaseSubject):
    """A runtime the gate has never seen: vLLM's own schedulers, declaring nothing else."""

    name = "my-runtime"
    sync_scheduler = "vllm.v1.core.sched.scheduler.Scheduler"
    async_scheduler = "vllm.v1.core.sched.async_scheduler.AsyncScheduler"

    def __init__(self):
        LOADED.append(self)
'''

BROKEN = '''
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from conformance._core.subjects import BaseSubject


class PreemptedToBack:
    """The planted bug: a preempted request goes to the back of the waiting queue (upstream
    puts it back at the front, so it resumes first)."""

    def _preempt_request(self, request, *args, **kwargs):
        result = super()._preempt_request(request, *args, **kwargs)
        self.waiting.remove_request(request)
        self.waiting.add_request(request)
        return result


class BackOfQueueScheduler(PreemptedToBack, Scheduler):
    pass


class BackOfQueueAsyncScheduler(PreemptedToBack, AsyncScheduler):
    pass


class BrokenSubject(BaseSubject):
    name = "back-of-queue"
    sync_scheduler = BackOfQueueScheduler
    async_scheduler = BackOfQueueAsyncScheduler
'''


def write_module(tmp_path: Path, name: str, *parts: str) -> None:
    (tmp_path / f"{name}.py").write_text("\n".join(textwrap.dedent(p) for p in parts))


# ---- the three runs -------------------------------------------------------------------------


@pytest.mark.slow
def test_upstream_passes_and_reports_what_it_cannot_be_checked_for(tmp_path, run_check):
    run = run_check(tmp_path, "upstream", workers=2, profile="smoke")
    assert run.returncode == 0, run.tail()
    assert run.report is not None and run.report["status"] == "pass", run.tail()
    assert run.report["subject"] == "upstream"
    assert not run.report["failures"], run.report["failures"]
    assert not [r for r in run.records() if r["outcome"] in ("failed", "error")]
    # Upstream declares its (empty) attribute additions and nothing else.
    runnable = check_applicability(run, {"declared_attributes"})
    not_passed = [r["nodeid"] for r in runnable if r["outcome"] != "passed"]
    assert not not_passed, f"tests upstream can run did not pass: {not_passed}"
    ran = {node_key(r)[1] for r in runnable}
    assert LOCKSTEP_TESTS <= ran, ran


@pytest.mark.slow
def test_third_party_subject_passes_without_loading_the_runtime(tmp_path, run_check):
    record = tmp_path / "runtime-modules.jsonl"
    write_module(tmp_path, "mymod", RECORDER, THIRD_PARTY)
    # ``-p mymod``: the module (and so its exit recorder) is also loaded in every pytest process,
    # the xdist controller included, before anything else of the run.
    run = run_check(
        tmp_path,
        "mymod:MySubject",
        workers=2,
        profile="smoke",
        extra_env={"SUBJECT_TRUTH_RECORD": str(record)},
        pytest_args=("-p", "mymod"),
    )
    assert run.returncode == 0, run.tail()
    assert run.report is not None and run.report["status"] == "pass", run.tail()
    assert run.report["subject"] == "mymod:MySubject"
    assert not run.report["failures"], run.report["failures"]
    runnable = check_applicability(run, set())
    assert runnable and all(r["outcome"] == "passed" for r in runnable), [
        (r["nodeid"], r["outcome"]) for r in runnable
    ]

    assert record.is_file(), f"no process recorded its modules:\n{run.tail()}"
    rows = [json.loads(line) for line in record.read_text().splitlines() if line.strip()]
    assert any(row["subject_loaded"] for row in rows), rows
    leaked = {
        row["pid"]: sorted(set(row["modules"]) - ALLOWED_RUNTIME_MODULES)
        for row in rows
        if set(row["modules"]) - ALLOWED_RUNTIME_MODULES
    }
    assert not leaked, f"the gate loaded runtime modules for a foreign subject: {leaked}"


@pytest.mark.slow
def test_planted_queue_bug_fails_only_lockstep_tests(tmp_path, run_check):
    write_module(tmp_path, "brokenmod", BROKEN)
    run = run_check(
        tmp_path,
        "brokenmod:BrokenSubject",
        workers=2,
        profile="smoke",
        extra_env={"OMNI_CONFORMANCE_SHRINK_SECONDS": "10"},
    )
    assert run.returncode not in (0, 2), f"exit {run.returncode}\n{run.tail()}"
    assert run.report is not None and run.report["status"] == "fail", run.tail()
    records = run.records()
    failed = [r for r in records if r["outcome"] in ("failed", "error")]
    assert failed, run.tail()

    wrong = [r["nodeid"] for r in failed if node_key(r)[1] not in LOCKSTEP_TESTS]
    assert not wrong, f"tests that cannot see a queue-order bug failed: {wrong}"
    files = {node_key(r)[0] for r in failed}
    assert any(f.startswith("test_ar_inv_001") for f in files), files

    assert len(run.report["failures"]) == len(failed), run.report["failures"]
    for failure in run.report["failures"]:
        diff = failure.get("first_difference") or {}
        path = str(diff.get("path", ""))
        assert path.startswith(FIELD_PREFIXES), f"{failure['test']}: first difference {diff}"
        assert path in failure["message"], failure
        trace = failure.get("trace")
        assert trace and Path(trace).is_file(), failure
        assert Path(trace).resolve().is_relative_to(run.failures_dir.resolve()), trace

    # The rest either cannot apply (nothing declared) or ran and passed.
    runnable = check_applicability(run, set())
    others = [
        (r["nodeid"], r["outcome"])
        for r in runnable
        if node_key(r)[1] not in LOCKSTEP_TESTS and r["outcome"] != "passed"
    ]
    assert not others, others
