"""Positive controls: the harness catches each planted mutant at the right step and field.

Every mutant in ``tests/mutants/harness_mutants.py`` breaks one behaviour. The canonical scripted
workload is run in lock step against each; the first difference must be the field the mutant
breaks, at the first operation where the mutant's behaviour is observable — located by an
independent oracle run (upstream against itself over the same trace), not by trusting the
harness. Also: a saved failure replays to the identical first difference, through the API and
through ``omni-conformance replay``; a registry entry whose condition does not hold is reported
as such, not silently tolerated.
"""

from __future__ import annotations

import json

import pytest

from conformance._core.lockstep import Lockstep
from conformance._core.machine import PREFIXES, TIGHT
from conformance._core.replay import record_failure, replay
from conformance._core.scenarios import run_canonical
from conformance._core.subjects import UpstreamSubject
from conformance._core.workload import Abort, Step, Trace
from conformance.cli import main
from omni_runtime.conformance_subject import OmniSubject
from tests.mutants import harness_mutants as M

pytestmark = pytest.mark.clauses("C-01", "C-02", "C-04", "C-05")
MODES = ["sync", "async"]


def _cfg(mode, downstream=False):
    extra = OmniSubject().feature_configs()["token-updates"]["additional_config"]
    return TIGHT.with_(
        async_scheduling=mode == "async", additional_config=extra if downstream else {}
    )


def _oracle_snapshots(trace: Trace, upto: int):
    """Upstream against itself over the trace's first ``upto + 1`` ops: (op, upstream snapshot)."""
    session = Lockstep(trace.config, UpstreamSubject(), prefixes=trace.prefixes)
    seen = []
    for op in trace.ops[: upto + 1]:
        session.apply(op)
        seen.append((op, session._last_up))
    assert session.failure is None
    return seen


def _failing(mutant, mode, downstream=False):
    session = run_canonical(_cfg(mode, downstream), mutant)
    assert session.failure is not None, f"{mutant.name} was not caught ({mode})"
    return session, session.failure


@pytest.mark.parametrize("mode", MODES)
def test_preempted_requeued_at_back(mode):
    session, diff = _failing(M.requeue_at_back, mode)
    assert diff.path == "queues.waiting"
    seen = _oracle_snapshots(session.trace, diff.step)
    # Caught where a preemption put a request in front of others: not before, not later.
    before = seen[diff.step - 1][1]["requests"]
    after = seen[diff.step][1]["requests"]
    assert any(
        f["num_preemptions"] > before.get(rid, {}).get("num_preemptions", 0)
        for rid, f in after.items()
    )
    assert diff.upstream != diff.subject and sorted(diff.upstream) == sorted(diff.subject)


@pytest.mark.parametrize("mode", MODES)
def test_blocks_freed_in_forward_order(mode):
    session, diff = _failing(M.forward_free, mode)
    assert diff.path == "block_pool.free_order"
    seen = _oracle_snapshots(session.trace, diff.step)
    live_before = set(seen[diff.step - 1][1]["requests"])
    live_after = set(seen[diff.step][1]["requests"])
    freed = live_before - live_after
    preempted = any(
        f["num_preemptions"]
        > seen[diff.step - 1][1]["requests"].get(r, {}).get("num_preemptions", 0)
        for r, f in seen[diff.step][1]["requests"].items()
    )
    assert freed or preempted, "caught on an op that freed no request's blocks"
    # Same blocks, different eviction order.
    assert sorted(diff.upstream) == sorted(diff.subject)


@pytest.mark.parametrize("mode", MODES)
def test_prefix_hit_shortened_by_one_block(mode):
    session, diff = _failing(M.short_prefix_hit, mode)
    assert diff.path.startswith(f"requests.{diff.request_id}.")
    assert isinstance(session.trace.ops[diff.step], Step)
    seen = _oracle_snapshots(session.trace, diff.step)
    sched = seen[diff.step][1]["sched_out"]
    # The step that first schedules the request, which the oracle serves from the cache.
    assert diff.request_id in sched["scheduled_new"]
    assert sched["num_computed_tokens"][diff.request_id] >= TIGHT.block_size


@pytest.mark.parametrize("mode", MODES)
def test_omni_state_left_behind_after_abort(mode):
    session, diff = _failing(M.leaky_transfer, mode, downstream=True)
    assert diff.path == "audit.leaked_omni_ids"
    op = session.trace.ops[diff.step]
    assert isinstance(op, Abort) and diff.subject == [op.request_ids[0]]
    assert diff.upstream == []


@pytest.mark.parametrize("mode", MODES)
def test_unregistered_extra_output(mode):
    session, diff = _failing(M.extra_output, mode)
    rid = diff.path.split(".")[1]
    assert diff.path == f"outputs.{rid}" and diff.upstream is None
    assert diff.subject["new_token_ids"] == ()
    seen = _oracle_snapshots(session.trace, diff.step)
    # The first step at which a scheduled request produced no output upstream.
    assert rid in seen[diff.step][1]["sched_out"]["num_scheduled_tokens"]


@pytest.mark.parametrize("mode", MODES)
def test_tolerated_difference_whose_condition_does_not_hold(mode):
    # Omni fields on outputs of requests with no downstream: OMNI-OUT-001 names the fields, but
    # its condition (a downstream consumer) does not hold, so this is a failure, and says so.
    _, diff = _failing(M.omni_fields_everywhere, mode)
    assert diff.path.startswith("outputs.")
    assert diff.path.rsplit(".", 1)[-1] in ("__type__", "omni_chunk_refs")
    assert "OMNI-OUT-001" in diff.not_applicable
    assert "condition does not hold" in diff.headline()


def test_upstream_against_itself_never_differs():
    for mode in MODES:
        session = run_canonical(_cfg(mode), UpstreamSubject())
        assert session.failure is None
        assert session.steps_compared > 0


@pytest.mark.parametrize("mode", MODES)
def test_replay_reproduces_the_failure_exactly(tmp_path, mode, capsys):
    session, diff = _failing(M.forward_free, mode)
    path, shrunk_diff = record_failure(
        session,
        subject_spec="tests.mutants.harness_mutants:forward_free",
        name=f"forward-free-{mode}",
        folder=tmp_path,
    )
    saved = json.loads(path.read_text())
    assert len(saved["ops"]) <= len(session.trace.ops)
    assert saved["meta"]["first_difference"]["path"] == diff.path
    again, meta = replay(path)
    assert again is not None and again.headline() == shrunk_diff.headline()
    assert main(["replay", str(path)]) == 1
    assert capsys.readouterr().out.strip() == shrunk_diff.headline()
    # The same trace against the real omni subject shows no difference: for a trace saved as a
    # failure that is "does not reproduce" (exit 3), not a success.
    assert main(["replay", str(path), "--subject", "omni"]) == 3


def test_failures_folder_defaults_and_override(tmp_path, monkeypatch):
    from conformance._core.replay import DEFAULT_FAILURES_DIR, failures_dir

    monkeypatch.delenv("OMNI_CONFORMANCE_FAILURES", raising=False)
    assert str(failures_dir()) == DEFAULT_FAILURES_DIR == "conformance-failures"
    monkeypatch.setenv("OMNI_CONFORMANCE_FAILURES", str(tmp_path))
    assert failures_dir() == tmp_path
    assert PREFIXES  # the scripted workload's prefixes travel inside each saved trace
