"""Requests that ask for repetition detection get outputs that fall into loops, and vLLM's stop
check ends them when its detector finds the loop (the ``limits`` axis; ``tokens._loop``)."""

from __future__ import annotations

import zlib

from conformance._core.lockstep import Lockstep
from conformance._core.machine import TIGHT
from conformance._core.subjects import UpstreamSubject
from conformance._core.workload import AddRequest, Step


def _run(requests: list[AddRequest], steps: int) -> dict[str, dict]:
    """Each request's tokens and how it finished, after ``steps`` steps."""
    session = Lockstep(TIGHT.with_(max_model_len=64), UpstreamSubject())
    for op in requests:
        session.apply(op)
    seen: dict[str, dict] = {r.request_id: {"tokens": []} for r in requests}
    for _ in range(steps):
        session.apply(Step())
        for rid, out in (session.last_outputs[0] or {}).items():
            seen[rid]["tokens"] += list(out["new_token_ids"])
            if out.get("finish_reason") is not None:
                seen[rid]["finish"] = out["finish_reason"], out.get("stop_reason")
    return seen


def _period(request_id: str) -> int:
    return 1 + zlib.crc32(f"loop:{request_id}".encode()) % 4


def test_a_loop_the_detector_looks_for_ends_the_request_and_others_run_on():
    # Request ids whose loops are short enough for (4, 1, 2) and which no stop id ends first.
    found = AddRequest("loops", (100, 101), max_tokens=30, ignore_eos=True, repetition=(4, 1, 2))
    off = AddRequest("off", (100, 101), max_tokens=30, ignore_eos=True, repetition=(0, 0, 0))
    plain = AddRequest("plain", (100, 101), max_tokens=30, ignore_eos=True)
    seen = _run([found, off, plain], 40)
    tokens = seen["loops"]["tokens"]
    assert seen["loops"]["finish"][1] == "repetition_detected", seen["loops"]
    p = _period("loops")
    tail = tokens[-2 * p :]
    assert tail[:p] == tail[p:], "the request ended where its output repeated itself"
    assert len(tokens) < 30
    # Switched off by zero sizes, the looping output runs to its length; without detection
    # the output does not loop at all.
    assert len(seen["off"]["tokens"]) == 30 and "finish" in seen["off"]
    assert seen["off"]["finish"][1] is None
    assert len(set(seen["plain"]["tokens"])) > 20


def test_min_tokens_holds_the_detector_off():
    held = AddRequest(
        "loops", (100, 101), max_tokens=30, ignore_eos=True, min_tokens=20, repetition=(4, 1, 2)
    )
    seen = _run([held], 40)
    assert seen["loops"]["finish"][1] == "repetition_detected"
    assert len(seen["loops"]["tokens"]) == 20
