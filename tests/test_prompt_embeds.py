"""Prompts sent as embeddings (``AddRequest.embeds``; the ``prompt-embeds`` axis): the token
source reads their length from the rows, and vLLM's prefix cache keys their blocks by the rows,
so equal embeddings hit each other's blocks and a token prompt of the same ids does not."""

from __future__ import annotations

from conformance._core.lockstep import Lockstep
from conformance._core.machine import TIGHT
from conformance._core.subjects import UpstreamSubject
from conformance._core.workload import AddRequest, Step

PROMPT = tuple(range(100, 140))  # two and a half 16-token blocks


def _hits(first: AddRequest, second: AddRequest) -> tuple[int, list[int]]:
    """The computed tokens ``second`` starts with once ``first`` has run, and what
    ``first`` sampled."""
    session = Lockstep(TIGHT, UpstreamSubject())
    session.apply(first)
    sampled: list[int] = []
    for _ in range(4):
        session.apply(Step())
        out = (session.last_outputs[0] or {}).get(first.request_id)
        sampled += list(out["new_token_ids"]) if out else []
    session.apply(second)
    session.apply(Step())
    scheduled = session._up_obs.get("sched_out")
    return scheduled["num_computed_tokens"][second.request_id], sampled


def test_equal_embeddings_share_blocks_and_token_ids_do_not():
    embedded = AddRequest("a", PROMPT, max_tokens=3, ignore_eos=True, embeds=True)
    again = AddRequest("b", PROMPT, max_tokens=3, ignore_eos=True, embeds=True)
    as_ids = AddRequest("b", PROMPT, max_tokens=3, ignore_eos=True)
    hits, sampled = _hits(embedded, again)
    assert hits == 32, "two full blocks of equal rows are a prefix-cache hit"
    assert len(sampled) == 3, "the token source sampled once the 40 rows were computed"
    assert _hits(embedded, as_ids)[0] == 0, "token ids never hit embedded blocks"
