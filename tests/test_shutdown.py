"""A session ends as the engine does: drained, then the scheduler shut down, and what its
shutdown closed is compared (``Shutdown``; ``vllm_compat.stats.shut_down_parts``)."""

from __future__ import annotations

from conformance._core import kv_connectors
from conformance._core.lockstep import Lockstep
from conformance._core.machine import TIGHT
from conformance._core.subjects import UpstreamSubject
from conformance._core.workload import AddRequest, Shutdown, Step, op_from_dict, op_to_dict


def test_the_drain_ends_by_shutting_the_scheduler_down_and_its_parts_are_closed():
    cfg = TIGHT.with_(kv_connector=kv_connectors.HARNESS, kv_role="kv_both", kv_events=True)
    session = Lockstep(cfg, UpstreamSubject())
    session.apply(AddRequest("a", (100, 101, 102), max_tokens=2))
    session.apply(Step())
    session.drain()
    assert session.failure is None
    assert session.trace.ops[-1] == Shutdown()
    closed = session.sub.last_observation.get("result")
    assert closed == {"kv_event_publisher": True, "kv_connector": True}
    assert not session.conservation_problems()


def test_shutdown_round_trips_through_a_trace():
    assert op_from_dict(op_to_dict(Shutdown())) == Shutdown()
