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


def test_prompt_rows_come_once_on_the_output_that_ends_the_prompt():
    # A 40-token prompt in 16-token chunks: two partial prefills, then the step that ends it.
    prompt = tuple(range(100, 140))
    steps = _outputs(
        [
            AddRequest("asks", prompt, max_tokens=3, prompt_logprobs=2),
            AddRequest("plain", (300, 301), max_tokens=3),
        ],
        5,
        long_prefill_token_threshold=16,
    )
    carried = [
        (i, o["asks"]["prompt_logprobs"])
        for i, o in enumerate(steps)
        if "asks" in o and "prompt_logprobs" in o["asks"]
    ]
    assert len(carried) == 1, carried
    i, (ids, values, ranks) = carried[0]
    assert steps[i]["asks"]["new_token_ids"], "prompt rows ride on the first sampled token"
    # One row per prompt position after the first, the prompt's own token first.
    assert [row[0] for row in ids] == list(prompt[1:])
    assert all(len(row) == 3 for row in ids) and len(values) == len(ranks) == len(prompt) - 1
    assert all("prompt_logprobs" not in o.get("plain", {}) for o in steps)
