"""The oracle in its own process: same observations as in process, and it stays upstream.

When loading a subject patched vLLM in this process, lock-step runs upstream in a child process
that never imported the subject (``conformance._core.oracle_process``). What could break:

* the isolated oracle observes something else than the in-process one would (a lost field, a
  different block hash chain, a differently ordered queue): the snapshots of a random workload
  with preemption, prefix hits and aborts must be equal, operation by operation, in sync and
  async scheduling;
* the isolation does not actually isolate: the positive control is ``BREAKS_VLLM_ABORTS``, a
  subject module that makes vLLM's own ``Scheduler`` ignore aborts. In process, the oracle
  carries the same bug and the comparison agrees; isolated, the first abort is a difference;
* a dead child process is reported as a subject difference, or leaves the process without an
  oracle: it must be a harness error naming the child's exit, and the next session restarts it;
* ``omni-conformance check`` and ``replay`` do not use it: the gate run on the planted subject
  fails with the abort difference, its report says where the oracle ran, and the saved trace
  reproduces on replay and is clean against upstream;
* the declared-attribute audits (C-10..C-12) go blind when the oracle is elsewhere: a wrong
  declaration must fail them with the oracle in its own process as in this one.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from conformance._core import pristine
from conformance._core.lockstep import Lockstep
from conformance._core.machine import PREFIXES, TIGHT
from conformance._core.oracle_process import OracleProcessError, ProcessSide, shared_oracle
from conformance._core.sides import Side
from conformance._core.subjects import load_subject
from conformance._core.workload import Abort, AddRequest, Step

pytestmark = pytest.mark.clauses("C-01")

# The positive control: vLLM's own scheduler (the oracle's class, in this process) drops aborts.
BREAKS_VLLM_ABORTS = """
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from conformance._core.subjects import UpstreamSubject

_original = Scheduler.finish_requests


def finish_requests(self, request_ids, finished_status):
    if finished_status == RequestStatus.FINISHED_ABORTED:
        return []  # the mutant: every abort is ignored
    return _original(self, request_ids, finished_status)


Scheduler.finish_requests = finish_requests
subject = UpstreamSubject()
"""


@pytest.fixture
def isolated():
    pristine.isolate_oracle("requested by the test")
    try:
        yield
    finally:
        pristine.reset_placement()


def _workload(session: Lockstep, seed: int = 1) -> list[dict]:
    """Twelve requests over the shared prefixes, two aborted mid-run, stepped to the end;
    the oracle's snapshot after every operation."""
    rng = random.Random(seed)
    seen = []

    def apply(op):
        session.apply(op)
        seen.append(session._last_up)

    for i in range(12):
        prompt = tuple(rng.randint(10, 400) for _ in range(rng.randint(1, 20)))
        apply(AddRequest(f"r{i}", prompt, prefix=rng.choice(sorted(PREFIXES)), max_tokens=20))
    for k in range(120):
        if k == 7:
            apply(Abort(("r3", "r4")))
        if session.failure is None:
            apply(Step())
        if session.failure is not None or not session.has_work():
            break
    return seen


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_isolated_oracle_observes_what_the_in_process_one_does(mode):
    subject = load_subject("omni")
    cfg = TIGHT.with_(async_scheduling=mode == "async", enable_prefix_caching=True)
    local = Lockstep(cfg, subject, prefixes=PREFIXES)
    assert isinstance(local.up, Side)
    expected = _workload(local)
    pristine.isolate_oracle("requested by the test")
    try:
        remote = Lockstep(cfg, subject, prefixes=PREFIXES)
        assert isinstance(remote.up, ProcessSide)
        got = _workload(remote)
    finally:
        pristine.reset_placement()
    assert local.failure is None and remote.failure is None
    # The workload really exercised what could be observed differently.
    assert local.stats["preemptions"] > 0 and local.stats["prefix_hits"] > 0
    assert remote.stats == local.stats
    assert len(got) == len(expected)
    for index, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert a == b, f"operation {index}: snapshots differ"
    assert remote.conservation_problems() == []


def test_an_isolated_oracle_catches_a_subject_that_breaks_vllm_itself(planted):
    spec = planted(BREAKS_VLLM_ABORTS)
    subject = load_subject(spec)
    placement = pristine.oracle_placement()
    assert placement.isolated
    assert spec in placement.reason and "Scheduler.finish_requests replaced" in placement.reason
    cfg = TIGHT.with_(enable_prefix_caching=True)

    session = Lockstep(cfg, subject, prefixes=PREFIXES)
    _workload(session)
    failure = session.failure
    assert failure is not None
    assert failure.op.startswith("abort"), failure.headline()

    # Why isolation is needed: with the oracle in this process it carries the same bug, and
    # the comparison agrees with the broken subject.
    pristine.reset_placement()
    blind = Lockstep(cfg, subject, prefixes=PREFIXES)
    _workload(blind)
    assert blind.failure is None


def test_a_dead_oracle_process_is_a_harness_error_and_the_next_session_restarts_it(isolated):
    cfg = TIGHT.with_(enable_prefix_caching=True)
    session = Lockstep(cfg, load_subject("omni"), prefixes=PREFIXES)
    child = shared_oracle().proc
    child.kill()
    child.wait()
    with pytest.raises(OracleProcessError, match="the oracle process ended"):
        session.apply(AddRequest("r0", (11, 12, 13), max_tokens=2))
    again = Lockstep(cfg, load_subject("omni"), prefixes=PREFIXES)
    assert shared_oracle().proc.pid != child.pid
    again.apply(AddRequest("r0", (11, 12, 13), max_tokens=2))
    again.drain()
    assert again.failure is None and again.conservation_problems() == []


@pytest.mark.slow
def test_check_and_replay_run_the_oracle_isolated_for_a_patching_subject(
    planted, tmp_path, run_check
):
    from tests.conftest import ROOT, check_env, gate_command

    spec = planted(BREAKS_VLLM_ABORTS)
    run = run_check(
        tmp_path,
        spec,
        tests=(str(ROOT / "invariants" / "test_ar_inv_001_parity.py"),),
        profile="smoke",
        pytest_args=("-k", "test_lockstep_parity and off and not async and noprefix"),
        extra_env={"OMNI_CONFORMANCE_SHRINK_SECONDS": "5"},
    )
    assert run.returncode == 1, run.tail()
    assert "oracle: upstream vLLM runs in a separate process" in run.stdout, run.tail()
    report = run.report
    assert report is not None and report["status"] == "fail", run.tail()
    assert report["environment"]["oracle"].startswith("separate process: loading subject")
    failed = [r for r in run.records() if r["outcome"] == "failed"]
    assert len(failed) == 1 and failed[0]["trace"], run.tail()
    assert failed[0]["first_difference"]["op"].startswith("abort")
    trace = failed[0]["trace"]

    def replay(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*gate_command(), "replay", trace, *extra],
            cwd=tmp_path,
            env=check_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=600,
        )

    again = replay()
    assert again.returncode == 1, again.stdout + again.stderr
    assert "separate process" in again.stdout
    clean = replay("--subject", "upstream")
    assert clean.returncode == 3, clean.stdout + clean.stderr


def test_an_oracle_process_needs_a_fixed_hash_seed():
    probe = "from conformance._core.oracle_process import hash_seed_problem as p; print(p())"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    random_seed = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    assert "needs a fixed PYTHONHASHSEED" in random_seed.stdout, random_seed.stderr[-2000:]
    fixed = subprocess.run(
        [sys.executable, "-c", probe],
        env={**env, "PYTHONHASHSEED": "0"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert fixed.stdout.strip() == "None", fixed.stderr[-2000:]


# ---- the declared-attribute audits under isolation (C-10..C-12) ----------------------------


def _wrongly_declared(subject):
    """``subject`` declaring that it adds nothing to vLLM's Request and scheduler: wrong for
    the omni runtime, whose requests and scheduler carry attributes of their own."""
    from conformance._core.capabilities import DeclaredAttributes

    class Undeclared(type(subject)):  # type: ignore[misc]
        def declared_attributes(self):
            return DeclaredAttributes()

    return Undeclared()


def _audit_problems(subject, *, isolate: bool) -> list[str]:
    from conformance._core.needs import features_of
    from invariants.machines import AuditedLockstep

    feature = features_of(subject, worker=False)[-1]
    cfg = TIGHT.with_(enable_prefix_caching=True, additional_config=feature.additional_config)
    if isolate:
        pristine.isolate_oracle("requested by the test")
    try:
        session = AuditedLockstep(cfg, subject, feature=feature, prefixes=PREFIXES)
        assert isinstance(session.up, ProcessSide if isolate else Side)
        try:
            for op in (AddRequest("r1", (11, 12, 13), max_tokens=4), Step(), Step()):
                session.apply(op)
            return list(session.problems)
        finally:
            session.shutdown()
    finally:
        pristine.reset_placement()


def test_a_wrong_attribute_declaration_fails_with_the_oracle_in_its_own_process():
    """The audits read only the oracle's attribute names, which its process sends with each
    reply: a wrong declaration fails C-12 there as in process, and a right one passes."""
    omni = load_subject("omni")
    wrong = _wrongly_declared(omni)
    local = _audit_problems(wrong, isolate=False)
    isolated = _audit_problems(wrong, isolate=True)
    assert any(p.startswith("C-12: r1: attributes added") for p in isolated), isolated
    assert any(p.startswith("C-12: scheduler attributes") for p in isolated), isolated
    assert isolated == local
    assert _audit_problems(omni, isolate=True) == []


# ---- the chunk machine under isolation (C-40..C-45) ------------------------------------------


def _reset_run(subject, *, isolate: bool) -> str:
    """``check_rows_survive_a_reset`` on one fixed async workload; its verdict."""
    from invariants.strategies import ProcessorSpec
    from invariants.test_chunk_contracts import check_rows_survive_a_reset

    spec = ProcessorSpec(declaration=False, policy="payload", takes_ids=True, mutate_ids=False)
    if isolate:
        pristine.isolate_oracle("requested by the test")
    try:
        return f"ran {check_rows_survive_a_reset(subject, [5, 9], 2, spec)} operations"
    except AssertionError as exc:
        return f"failed: {exc}"
    finally:
        pristine.reset_placement()


def test_the_chunk_machine_runs_with_the_oracle_in_its_own_process():
    """Payloads live on the subject's side only: across the pipe the oracle draws the same
    tokens from its own source, so the chunk machine runs the same workload to the same verdict
    as in process (the gate's chunk properties then run for subjects that patch vLLM)."""
    omni = load_subject("omni")
    isolated = _reset_run(omni, isolate=True)
    assert isolated == _reset_run(omni, isolate=False) == "ran 5 operations", isolated
