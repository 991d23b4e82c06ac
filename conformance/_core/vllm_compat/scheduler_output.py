"""What the harness reads from a ``SchedulerOutput``: who was scheduled, from which position.

New requests carry their state on ``NewRequestData``; requests already known to the worker carry
it in ``CachedRequestData``'s parallel lists. Both shapes are the same in vLLM 0.26-0.33 (the
V1 model runner layout: a resumed request stays in the cached data with ``resumed_req_ids`` and
``all_token_ids``); this module is where a release that changes them would be keyed.
"""

from __future__ import annotations

from typing import Any


def computed_before(so: Any) -> dict[str, int]:
    """Per scheduled request, the positions already computed before this step."""
    computed = {n.req_id: int(n.num_computed_tokens) for n in so.scheduled_new_reqs}
    cached = so.scheduled_cached_reqs
    for i, rid in enumerate(cached.req_ids):
        computed[rid] = int(cached.num_computed_tokens[i])
    return computed


def prompt_length(new: Any) -> int:
    """The tokens a runner holds for a newly scheduled request: a resumed request's whole list
    under Model Runner V2 (``prefill_token_ids``), else its prompt, token ids or embeddings
    (``NewRequestData.prompt_len``, missing before 0.29)."""
    if new.prefill_token_ids:
        return len(new.prefill_token_ids)
    if hasattr(type(new), "prompt_len"):
        return int(new.prompt_len)
    if new.prompt_token_ids is not None:
        return len(new.prompt_token_ids)
    return 0 if new.prompt_embeds is None else int(new.prompt_embeds.shape[0])


def schedule_fields(so: Any) -> dict[str, Any]:
    """The ``SchedulerOutput`` as plain values, copied the moment it is read."""
    new_ids = []
    blocks: dict[str, Any] = {}
    for new in so.scheduled_new_reqs:
        new_ids.append(new.req_id)
        blocks[new.req_id] = tuple(tuple(g) for g in new.block_ids)
    cached = so.scheduled_cached_reqs
    out_tokens: dict[str, int] = {}
    for i, rid in enumerate(cached.req_ids):
        out_tokens[rid] = cached.num_output_tokens[i]
        nb = cached.new_block_ids[i]
        blocks[rid] = None if nb is None else tuple(tuple(g) for g in nb)
    fields = {
        "scheduled_new": new_ids,
        "scheduled_cached": list(cached.req_ids),
        "resumed": sorted(cached.resumed_req_ids),
        "preempted": sorted(so.preempted_req_ids or ()),
        "finished": sorted(so.finished_req_ids),
        "total_tokens": so.total_num_scheduled_tokens,
        "num_scheduled_tokens": dict(so.num_scheduled_tokens),
        "num_computed_tokens": computed_before(so),
        "num_output_tokens": out_tokens,
        "block_ids": blocks,
    }
    # Sent back only under pipeline parallelism (the first stage's worker did not sample them),
    # so the list is empty otherwise (not strict). Present when any is, so snapshots without it
    # read as before.
    pairs = zip(cached.req_ids, cached.new_token_ids, strict=False)
    sent = {rid: tuple(ids) for rid, ids in pairs if ids}
    if sent:
        fields["new_token_ids"] = sent
    # 0.33, Model Runner V2 with a drafting head: no request of the step can use drafts.
    if getattr(so, "skip_drafts", False):
        fields["skip_drafts"] = True
    return fields


def finished_ids(so: Any) -> list[str]:
    """Ids the scheduler tells the worker to forget this step."""
    return list(so.finished_req_ids)


def resumed_ids(so: Any) -> set[str]:
    """Requests the scheduler resumes this step (after a preemption), whose block tables the
    worker must replace."""
    return set(so.scheduled_cached_reqs.resumed_req_ids)


def resumed_all_token_ids(so: Any, request_id: str) -> list[int] | None:
    """A request's full token list as the scheduler sends it: for a resumed request, and for
    one not scheduled in the step before (None when the output carries none for it)."""
    got = so.scheduled_cached_reqs.all_token_ids.get(request_id)
    return None if got is None else list(got)


def scheduled_drafts(so: Any) -> dict[str, list[int]]:
    """Per request, the draft tokens the step verifies, scheduled after its other positions
    (``scheduled_spec_decode_tokens``; empty without speculative decoding)."""
    return {rid: list(ids) for rid, ids in so.scheduled_spec_decode_tokens.items() if ids}


def draft_token_ids(req_ids: list[str], drafts: list[list[int]]) -> Any:
    """A drafter's proposals after a step, as ``Scheduler.update_draft_token_ids`` takes them."""
    from vllm.v1.outputs import DraftTokenIds

    return DraftTokenIds(list(req_ids), drafts)


def spec_tokens_to_schedule(so: Any) -> int:
    """How many drafts the runner proposes after the step (``num_spec_tokens_to_schedule``): the
    batch-size schedule's count under dynamic speculative decoding."""
    return int(so.num_spec_tokens_to_schedule)
