"""OMNI-ERR-001 against upstream: a send-path fault fails only its own request (C-61), and that
difference from upstream is tolerated only through the registry entry, which is still needed (C-03).

Upstream has no send path, so it keeps generating for the request our runtime failed; every
field that then differs (the request's status, queues, block pool, later scheduler outputs) must
be attributed to OMNI-ERR-001, and the neighbour request must finish exactly as upstream's does.
"""

from __future__ import annotations

from conformance._core.config import HarnessConfig
from conformance._core.differences import Registry
from conformance._core.lockstep import Lockstep
from conformance._core.workload import AddRequest, Step
from omni_runtime.conformance_subject import OmniSubject, talker_stage

STAGE = talker_stage(chunk_processor="tests.sched_steps.FailMarkedRequests")


def _run(registry=None, async_scheduling=False):
    cfg = HarnessConfig(additional_config={"omni_stage": STAGE}, async_scheduling=async_scheduling)
    session = Lockstep(cfg, OmniSubject(), registry=registry)
    session.apply(AddRequest("ok-1", tuple(range(10, 30)), max_tokens=6))
    session.apply(AddRequest("fail-1", tuple(range(40, 60)), max_tokens=6))
    for _ in range(12):
        session.apply(Step())
        if session.failure is not None:
            break
    return session


def test_omni_err_001_tolerates_a_failed_send():
    for async_scheduling in (False, True):
        session = _run(async_scheduling=async_scheduling)
        assert session.failure is None, session.failure.headline()
        assert session.tolerated["OMNI-ERR-001"] >= 1
        assert session.facts["fail-1"].get("transfer_failed")
        # The neighbour completed: upstream and subject agree it is gone, no omni state leaks.
        assert "ok-1" not in session.sub.scheduler.requests
        assert session.sub.scheduler.omni_request_ids() == set()


def test_omni_err_001_is_still_needed():
    registry = Registry(OmniSubject().differences()).without({"OMNI-ERR-001"})
    session = _run(registry=registry)
    assert session.failure is not None
    assert "fail-1" in session.failure.path or session.failure.path.startswith(
        ("queues.", "block_pool.", "sched_out.")
    )
