"""The limits axes' workloads: ``min_tokens`` as a real runner honours it (no stop id or EOS
sampled before it), requests that reach the context, and the scheduler options the release has."""

from __future__ import annotations

from conformance._core.axes import axis
from conformance._core.config import build_vllm_config
from conformance._core.lockstep import Lockstep
from conformance._core.machine import STOP_IDS, TIGHT
from conformance._core.subjects import UpstreamSubject
from conformance._core.workload import AddRequest, Step


def _finishes(min_tokens: int, ids: range, **cfg: object) -> dict[str, tuple[str, int]]:
    """Each request's finish reason and output count."""
    session = Lockstep(TIGHT.with_(**cfg), UpstreamSubject())
    for i in ids:
        session.apply(
            AddRequest(
                f"r{i}",
                (100 + i, 101),
                max_tokens=16,
                stop_token_ids=STOP_IDS,
                ignore_eos=False,
                min_tokens=min_tokens,
            )
        )
    counts: dict[str, int] = {}
    done: dict[str, tuple[str, int]] = {}
    for _ in range(40):
        session.apply(Step())
        for rid, out in session.last_outputs[1].items():
            counts[rid] = counts.get(rid, 0) + len(out["new_token_ids"])
            if out["finish_reason"] is not None:
                done[rid] = (out["finish_reason"], counts[rid])
    assert session.failure is None
    return done


def test_no_stop_before_min_tokens():
    early = _finishes(0, range(6))
    assert any(reason == "stop" and n < 10 for reason, n in early.values()), early
    held = _finishes(10, range(6))
    assert all(n >= 10 for _, n in held.values()) and len(held) == 6, held


def test_requests_reach_a_short_context():
    done = _finishes(14, range(3), max_model_len=12)
    # A 2-token prompt in a 12-token context: capped at 10 of its 16 tokens.
    assert set(done.values()) == {("length", 10)}, done


def test_scheduler_options_reach_vllm():
    cfg = axis("limits-active-seqs").config(TIGHT)
    sched = build_vllm_config(cfg).scheduler_config
    assert sched.max_num_active_seqs == 2 and sched.long_prefill_token_threshold_adaptive
