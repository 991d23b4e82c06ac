"""Receiving stages (C-47): a stage that parks a request until the upstream stage's chunks arrive.

Upstream vLLM has no parked state, so the subject runs alone (``ReceivingStage.feature``) through
generated programs of additions, steps, aborts and chunk arrivals (``ChunkArrives``). After every
operation its state is held to what upstream's state machine allows: a live request kept once,
in one queue or parked; a running one in the running queue with blocks for what it computed; a
preempted one with no blocks or computed tokens; a parked one still live; an aborted one gone
from the scheduler and from the receiving machinery. Once every request got its final chunk and
the stage is idle, every block is free. A failing program is saved as a trace
(``<stage feature>-<mode>.json``). A subject with several kinds of receiving stage
(``ReceivingStage.features``: streamed chunks, a whole payload) has each checked in turn. Not applicable without ``receiving_stage``; the clause in full:
docs/contracts.md.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance._core import vllm_compat as vc
from conformance._core.capabilities import Feature, NotApplicable, ReceivingStage
from conformance._core.needs import require
from conformance._core.replay import failures_dir
from conformance._core.sides import make_side
from conformance._core.vllm_compat import environment_versions
from conformance._core.workload import Abort, AddRequest, ChunkArrives, Op, Step, Trace
from invariants.machines import harness_config, suite_settings

pytestmark = [pytest.mark.invariants]

IDS = tuple(f"r{i}" for i in range(4))
MAX_DRAIN_STEPS = 300


def state_problems(side: Any, receiving: ReceivingStage, gone: set[str]) -> list[str]:
    """What of the subject's state upstream's transitions cannot produce (see the module
    docstring); ``gone``: the requests aborted so far."""
    sched = side.scheduler
    queues = vc.scheduler_queues(sched)
    queued = Counter(
        rid for name, ids in queues.items() if name != "finished_pending" for rid in ids
    )
    parked = receiving.parked(sched)
    block_size = int(side.scheduler.cache_config.block_size)
    problems: list[str] = []
    for rid, request in sched.requests.items():
        if vc.is_finished(request):
            continue
        status = vc.status_name(request)
        held = queued[rid] + parked.get(rid, 0)
        if held != 1:
            problems.append(
                f"C-47: {rid} ({status}) is kept {queued[rid]} times in the scheduler's queues "
                f"and {parked.get(rid, 0)} times parked; upstream keeps a live request once"
            )
        if rid in parked:
            continue
        running = rid in queues["running"]
        blocks = sum(len(group) for group in vc.request_block_ids(sched, rid))
        if status == "RUNNING":
            if not running:
                problems.append(f"C-47: {rid} is RUNNING but not in the running queue")
            elif blocks * block_size < request.num_computed_tokens:
                problems.append(
                    f"C-47: {rid} runs with {request.num_computed_tokens} computed tokens but "
                    f"{blocks} blocks of {block_size}: a resumed request gets its blocks back"
                )
        elif status in ("WAITING", "PREEMPTED") and running:
            problems.append(f"C-47: {rid} is {status} but in the running queue")
        if status == "PREEMPTED" and (blocks or request.num_computed_tokens):
            problems.append(
                f"C-47: {rid} is PREEMPTED with {blocks} blocks and "
                f"{request.num_computed_tokens} computed tokens; upstream frees both"
            )
    for rid in sorted(set(parked) - set(sched.requests)):
        problems.append(f"C-47: {rid} is parked but no longer a request of the scheduler")
    for rid in sorted(gone):
        left = receiving.held_for(sched, rid)
        if rid in sched.requests or left:
            where = ", ".join(left) or "the scheduler's requests"
            problems.append(f"C-47: {rid} was aborted but is still held ({where})")
    return problems


def stage_features(receiving: ReceivingStage) -> tuple[Feature, ...]:
    """Each kind of receiving stage the subject has (``ReceivingStage.features``)."""
    return tuple(getattr(receiving, "features", None) or (receiving.feature,))


def run_program(
    subject: Any,
    mode: str,
    program: list[Op],
    *,
    finish: bool = True,
    cfg: Any = None,
    feature: Feature | None = None,
) -> tuple[list[str], Trace]:
    """Run ``program`` on the subject's receiving stage (``feature``, else its first) alone,
    checking after every operation; then (``finish``) the final chunks and a drain, and the
    block count. The first operation's problems, and the trace run."""
    receiving = require(subject, "receiving_stage", "receiving stage")
    cfg = cfg or harness_config(feature or receiving.feature, mode=mode, prefix=True)
    side = make_side(subject, cfg, None)
    trace = Trace(cfg, [], {}, {"check": "receiving-stage", "subject": subject.name})
    free_at_start = vc.num_free_blocks(vc.block_pool(side.scheduler))
    gone: set[str] = set()
    added: list[str] = []

    def apply(op: Op) -> list[str]:
        trace.ops.append(op)
        live = set(side.scheduler.requests)
        trace.meta["parked"] = trace.meta.get("parked", 0) + len(receiving.parked(side.scheduler))
        prompt = list(op.prompt) if isinstance(op, AddRequest) else None
        obs = side.observe(op, prompt, cfg, float(len(trace.ops)))
        crash = obs.get("exception")
        if crash:
            return [f"C-47: the stage raised at {op.describe()}: {crash}"]
        if isinstance(op, AddRequest):
            added.append(op.request_id)
        if isinstance(op, Abort):
            gone.update(rid for rid in op.request_ids if rid in live)
        return state_problems(side, receiving, gone)

    for op in program:
        if problems := apply(op):
            return problems, trace
    if finish:
        # Every request still there gets its final chunk; the stage then runs dry.
        for rid in added:
            if rid not in gone and (problems := apply(ChunkArrives(rid, final=True))):
                return problems, trace
        for _ in range(MAX_DRAIN_STEPS):
            if not side.busy():
                break
            if problems := apply(Step()):
                return problems, trace
    if side.busy():
        return [
            f"C-47: the stage still holds {side.live_ids()} after every final chunk and "
            f"{MAX_DRAIN_STEPS} steps"
        ], trace
    free = vc.num_free_blocks(vc.block_pool(side.scheduler))
    if free != free_at_start:
        return [f"C-47: {free_at_start - free} blocks still held after every request ended"], trace
    return [], trace


def _add(i: int, length: int, max_tokens: int) -> AddRequest:
    return AddRequest(
        IDS[i], tuple(100 + (7 * i + j) % 300 for j in range(length)), max_tokens=max_tokens
    )


programs = st.lists(
    st.one_of(
        st.builds(_add, st.integers(0, len(IDS) - 1), st.integers(1, 40), st.integers(1, 8)),
        st.just(Step()),
        st.just(Step()),
        st.builds(ChunkArrives, st.sampled_from(IDS), st.booleans()),
        st.builds(lambda r: Abort((r,)), st.sampled_from(IDS)),
    ),
    min_size=1,
    max_size=24,
).map(lambda ops: [op for i, op in enumerate(ops) if not _repeated_add(ops, i)])


def _repeated_add(ops: list[Op], i: int) -> bool:
    """Each id names one request of the program: a later addition of the same id is dropped
    (upstream refuses one while the first is live, and an aborted id stays in ``gone``)."""
    op = ops[i]
    return isinstance(op, AddRequest) and any(
        isinstance(o, AddRequest) and o.request_id == op.request_id for o in ops[:i]
    )


# What ``omni-conformance replay`` imports to re-run a receiving-stage trace.
REPLAY_RECEIVING = "invariants.test_receiving_stages:replay_receiving"


def replay_receiving(trace: Trace, subject: Any) -> list[str]:
    """The problems a receiving-stage trace shows on ``subject`` now (its operations as
    recorded, final chunks and drain included)."""
    mode = "async" if trace.config.async_scheduling else "sync"
    return run_program(subject, mode, list(trace.ops), finish=False, cfg=trace.config)[0]


def save_failure(
    trace: Trace, problem: str, name: str, subject_spec: str | None, folder: Any = None
) -> Path:
    trace.meta = {
        "kind": "audit",
        "replay": REPLAY_RECEIVING,
        "subject": subject_spec or trace.meta.get("subject"),
        "test": name,
        **environment_versions(),
        "problem": problem,
    }
    path = failures_dir(folder) / f"{name}.json"
    trace.save(path)
    return path


@pytest.mark.clauses("C-47")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_receiving_stage_stays_in_upstream_states(conformance, conformance_subject, mode):
    receiving = require(conformance_subject, "receiving_stage", "receiving stage")
    parked = {
        feature.name: check_receiving_stage(conformance, conformance_subject, mode, feature)
        for feature in stage_features(receiving)
    }
    if not any(parked.values()):
        raise NotApplicable(
            f"subject {conformance_subject.name!r}: no request was ever parked waiting for a "
            "chunk, so C-47's parked-state checks never ran"
        )
    # A declared kind of stage that never parked was not checked: say so, never pass it.
    idle = sorted(name for name, count in parked.items() if not count)
    assert not idle, (
        f"C-47: the receiving stages {idle} never parked a request, so their checks never ran "
        f"(the others parked {sum(parked.values())} times)"
    )


def check_receiving_stage(recorder: Any, subject: Any, mode: str, feature: Feature) -> int:
    """The property on one kind of receiving stage; how many times a request was parked."""
    found: list[tuple[int, str, Trace]] = []
    parked = 0

    @suite_settings(15)
    @given(programs)
    def prop(program: list[Op]) -> None:
        nonlocal parked
        problems, trace = run_program(subject, mode, program, feature=feature)
        parked += trace.meta.get("parked", 0)
        if problems:
            found.append((len(trace.ops), problems[0], trace))
        assert not problems, problems[0]

    try:
        prop()
    except AssertionError:
        length, problem, trace = min(found, key=lambda f: f[0])
        name = f"{feature.name}-{mode}"
        path = save_failure(
            trace,
            problem,
            name,
            getattr(recorder, "subject_spec", None),
            getattr(recorder, "failures_dir", None),
        )
        if hasattr(recorder, "trace"):
            recorder.trace = str(path)
        raise AssertionError(
            f"{feature.name}: {problem} ({length} operations)\ntrace: {path}"
        ) from None
    return parked
