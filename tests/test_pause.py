"""The engine pausing its scheduler (the ``pause`` axis; ``Pause``): what each state schedules,
that snapshots show it, and that the drain resumes a scheduler left paused."""

from __future__ import annotations

from conformance._core.lockstep import Lockstep
from conformance._core.machine import TIGHT
from conformance._core.subjects import UpstreamSubject
from conformance._core.workload import AddRequest, Pause, Step, Trace


def _scheduled(session: Lockstep) -> set[str]:
    snap = session.last_sub
    assert snap is not None
    out = snap.get("sched_out") or {}
    return set(out.get("num_scheduled_tokens", {}))


def test_each_pause_state_holds_back_what_vllm_says():
    session = Lockstep(TIGHT, UpstreamSubject())
    session.apply(AddRequest("running", (100, 101, 102), max_tokens=8))
    session.apply(Step())
    session.apply(Pause("new"))
    assert (session.last_sub or {})["queues"]["paused"] == "PAUSED_NEW"
    session.apply(AddRequest("new", (200, 201), max_tokens=2))
    session.apply(Step())
    assert _scheduled(session) == {"running"}
    session.apply(Pause("all"))
    session.apply(Step())
    assert _scheduled(session) == set()
    session.apply(Pause("off"))
    assert "paused" not in (session.last_sub or {})["queues"]
    session.apply(Step())
    assert _scheduled(session) == {"running", "new"}
    assert session.failure is None


def test_the_drain_resumes_a_paused_scheduler():
    session = Lockstep(TIGHT, UpstreamSubject())
    session.apply(AddRequest("a", (100, 101), max_tokens=3))
    session.apply(Pause("all"))
    session.drain()
    assert session.failure is None and not session.has_work()
    assert session.trace.ops[2] == Pause("off")


def test_pause_round_trips_through_a_trace():
    trace = Trace(config=TIGHT, ops=[Pause("new"), Pause("off")])
    again = Trace.from_dict(trace.to_dict())
    assert again.ops == trace.ops
    assert [op.describe() for op in again.ops] == [
        "pause the scheduler (new)",
        "resume the scheduler",
    ]
