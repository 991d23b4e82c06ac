"""LoRA requests (the ``lora`` axis): the adapter keys the prefix cache and counts against
``max_loras`` as vLLM's engine has it."""

from __future__ import annotations

from conformance._core.lockstep import Lockstep
from conformance._core.machine import TIGHT
from conformance._core.subjects import UpstreamSubject
from conformance._core.workload import AddRequest, Step

LORA = TIGHT.with_(max_loras=2)
PROMPT = tuple(range(100, 140))


def _cached(session: Lockstep, rid: str) -> int:
    for _ in range(4):
        session.apply(Step())
        out = session.last_outputs[1].get(rid)
        if out and out["prefill_stats"]:
            return int(out["prefill_stats"]["num_cached_tokens"])
    raise AssertionError(f"{rid} produced no first output")


def test_prefix_hits_stay_within_one_adapter():
    session = Lockstep(LORA, UpstreamSubject())
    session.apply(AddRequest("first", PROMPT, max_tokens=1, lora=1))
    _cached(session, "first")
    session.apply(AddRequest("other", PROMPT, max_tokens=1, lora=2))
    assert _cached(session, "other") == 0
    session.apply(AddRequest("same", PROMPT, max_tokens=1, lora=1))
    assert _cached(session, "same") == 32
    assert session.failure is None


def test_a_step_serves_at_most_max_loras_adapters():
    session = Lockstep(LORA, UpstreamSubject())
    for n in (1, 2, 3):
        session.apply(AddRequest(f"r{n}", (100 + n, 101), max_tokens=4, lora=n))
    seen = []
    for _ in range(8):
        session.apply(Step())
        snap = session.last_sub or {}
        seen.append(set((snap.get("sched_out") or {}).get("num_scheduled_tokens", {})))
    assert all(len(ids) <= 2 for ids in seen) and set().union(*seen) == {"r1", "r2", "r3"}
