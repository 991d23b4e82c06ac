"""The logprobs the token source returns are what vLLM's runner returns, and each output carries
its own request's rows (the ``logprobs`` axes; ``conformance/_core/logprobs.py``)."""

from __future__ import annotations

from conformance._core.lockstep import Lockstep
from conformance._core.machine import TIGHT
from conformance._core.subjects import UpstreamSubject
from conformance._core.workload import AddRequest, Step


def _outputs(requests: list[AddRequest], steps: int, **cfg: object) -> list[dict]:
    session = Lockstep(TIGHT.with_(**cfg), UpstreamSubject())
    for op in requests:
        session.apply(op)
    seen = []
    for _ in range(steps):
        session.apply(Step())
        seen.append(session.last_outputs[0] or {})
    return seen


def test_each_output_carries_its_own_rows_and_zero_asks_for_the_sampled_token():
    steps = _outputs(
        [
            AddRequest("zero", (100, 101), max_tokens=2, logprobs=0),
            AddRequest("five", (200, 201, 202), max_tokens=2, logprobs=5),
            AddRequest("none", (300,), max_tokens=2),
        ],
        2,
    )
    for outputs in steps:
        assert "logprobs" not in outputs["none"]
        for rid in ("zero", "five"):
            ids, values, ranks = outputs[rid]["logprobs"]
            assert [row[0] for row in ids] == list(outputs[rid]["new_token_ids"])
            # vLLM's runner gives every row as many candidates as the step's largest ask.
            assert all(len(row) == 6 for row in ids) and len(values) == len(ranks) == 1


def test_speculative_rows_follow_each_requests_accepted_tokens():
    steps = _outputs(
        [AddRequest("a", (100, 101), max_tokens=8, logprobs=1)], 6, num_speculative_tokens=3
    )
    emitted = [o["a"] for o in steps if "a" in o and o["a"]["new_token_ids"]]
    assert any(len(o["new_token_ids"]) > 1 for o in emitted), "no step accepted a draft"
    for out in emitted:
        ids, _, ranks = out["logprobs"]
        assert [row[0] for row in ids] == list(out["new_token_ids"]) and len(ranks) == len(ids)


def test_zero_alone_still_gets_the_sampled_tokens_logprob():
    # SamplingParams.logprobs=0 asks for the sampled token's own logprob, no other candidate.
    (outputs,) = _outputs([AddRequest("zero", (100, 101), max_tokens=2, logprobs=0)], 1)
    ids, values, ranks = outputs["zero"]["logprobs"]
    assert ids == [[outputs["zero"]["new_token_ids"][0]]] and len(values[0]) == 1
