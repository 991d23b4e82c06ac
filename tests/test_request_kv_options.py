"""The per-request KV-cache options the axes draw (``AddRequest.kv_cache_report_mode`` and
``skip_reading_prefix_cache``): traces at their defaults unchanged, the options reaching the
request vLLM builds on both subjects, and what each changes on upstream's scheduler (a request
that skips reading computes its whole prompt; a "full" one re-publishes the blocks it reuses).
"""

from __future__ import annotations

from typing import Any

from conformance._core.axes import axis
from conformance._core.machine import PREFIXES, TIGHT
from conformance._core.sides import make_side
from conformance._core.subjects import BaseSubject, make_sampling_params
from conformance._core.workload import AddRequest, Step, op_from_dict, op_to_dict

PROMPT = PREFIXES["doc"] + (7, 8, 9)


def test_defaults_are_not_written_and_options_round_trip() -> None:
    plain = AddRequest("r0", PROMPT)
    assert "kv_cache_report_mode" not in op_to_dict(plain)
    assert "skip_reading_prefix_cache" not in op_to_dict(plain)
    op = AddRequest("r0", PROMPT, kv_cache_report_mode="full", skip_reading_prefix_cache=True)
    assert op_from_dict(op_to_dict(op)) == op
    assert "kv_cache_report_mode=full skip_reading_prefix_cache" in op.describe()


def test_options_reach_the_request_on_both_subjects() -> None:
    from omni_runtime.conformance_subject import OmniSubject

    op = AddRequest("r0", PROMPT, kv_cache_report_mode="full", skip_reading_prefix_cache=True)
    sp = make_sampling_params(op, TIGHT)
    assert sp.extra_args == {"kv_cache_report_mode": "full"}
    assert sp.skip_reading_prefix_cache is True
    default = make_sampling_params(AddRequest("r1", PROMPT), TIGHT)
    assert default.extra_args is None and default.skip_reading_prefix_cache is False
    omni = OmniSubject()
    feature = omni.feature_configs()["token-updates"]
    cfg = axis("stats-events").config(
        TIGHT.with_(additional_config=dict(feature["additional_config"]))
    )
    for subject in (BaseSubject(), omni):
        sched = subject.build_scheduler(cfg)
        request = subject.make_request(op, list(PROMPT), cfg, sched, 0.0)
        assert request.kv_cache_report_mode == "full", subject
        assert request.skip_reading_prefix_cache is True, subject


def _run(second: AddRequest) -> tuple[int, int]:
    """Run a request, then ``second`` with the same prompt: the prompt tokens ``second``'s
    first step computed and the KV events that step published."""
    cfg = axis("stats-events").config(TIGHT)
    side = make_side(BaseSubject(), cfg, None)
    clock = 0.0

    def apply(op: Any, prompt: list[int] | None = None) -> dict[str, Any]:
        nonlocal clock
        clock += 1
        snap = side.apply(op, prompt, cfg, clock)
        assert "exception" not in snap, snap["exception"]
        return snap

    apply(AddRequest("r0", PROMPT, max_tokens=1), list(PROMPT))
    for _ in range(4):
        apply(Step())
    assert not side.busy()
    apply(second, list(PROMPT))
    # The step's snapshot holds the events the step published (``Side.observe``).
    events = apply(Step())["kv_events"] or []
    computed = side.scheduler.requests[second.request_id].num_computed_tokens
    return computed, sum(len(batch["events"]) for batch in events)


def test_skip_reading_computes_the_whole_prompt_and_full_mode_republishes() -> None:
    hit, hit_events = _run(AddRequest("r1", PROMPT, max_tokens=4))
    skip, _ = _run(AddRequest("r1", PROMPT, max_tokens=4, skip_reading_prefix_cache=True))
    full, full_events = _run(AddRequest("r1", PROMPT, max_tokens=4, kv_cache_report_mode="full"))
    # TIGHT's budget (48 tokens) takes the 51-token prompt in two chunks without a hit.
    assert hit > skip
    assert full == hit and full_events > hit_events
