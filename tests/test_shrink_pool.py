"""The shrinker also shrinks the KV-cache pool, and a shrunk failure may move to another request.

A preemption with a step in flight (pipeline parallelism's batch queue) needs the pool full:
with the suite's 14 blocks and 48-token budget that takes requests and many steps, and the
operation passes alone stop at a longer trace than the same failure needs with fewer blocks.
The trace below is the shape the gate first saved for vllm-omni's in-flight token drop
(``StaleOutputDropped`` plants the same defect in the omni runtime).
"""

from __future__ import annotations

import pytest

from conformance._core.compare import field_of
from conformance._core.lockstep import (
    Shrinker,
    _pool_sizes,
    _smaller_pool,
    run_trace,
    same_failure,
)
from conformance._core.machine import TIGHT
from conformance._core.workload import AddRequest, Step, Trace
from omni_runtime.conformance_subject import OmniSubject
from tests.mutants import runtime_mutants as M


def test_pool_sizes_are_bounded_and_below_the_pool():
    assert _pool_sizes(14, 2) == list(range(2, 14))
    assert _pool_sizes(8, 8) == [] and _pool_sizes(9, 8) == [8]
    big = _pool_sizes(64, 2)
    assert len(big) <= 22 and max(big) < 64 and min(big) == 2


def test_a_smaller_pool_is_one_vllm_starts_with():
    # vLLM starts only when one request of max_model_len tokens fits in the pool.
    assert _smaller_pool(TIGHT, 10) == TIGHT.with_(num_blocks=10)  # 160 tokens hold 128
    small = _smaller_pool(TIGHT, 5)  # four blocks beside the null block
    assert small.num_blocks == 5 and small.max_model_len == 4 * TIGHT.block_size


def test_a_field_difference_names_its_field_for_any_request():
    assert field_of("requests.r14.output_token_ids") == "requests.*.output_token_ids"
    assert field_of("outputs.r3#1.new_token_ids") == "outputs.*#1.new_token_ids"
    assert field_of("sched_out.scheduled_new_reqs.r2") == "sched_out.scheduled_new_reqs.*"
    assert field_of("queues.waiting") == "queues.waiting"
    assert field_of("stats.num_running_reqs") == "stats.num_running_reqs"


def _in_flight_drop_trace() -> Trace:
    cfg = TIGHT.with_(pipeline_parallel_size=2, log_stats=True)
    ops = [
        AddRequest("r0", (100,), prefix="doc", max_tokens=2),
        AddRequest("r2", tuple(range(211, 243)), prefix="doc", max_tokens=5),
        AddRequest("r4", tuple(range(211, 240)), max_tokens=5),
        AddRequest("r13", (174,), prefix="sys", max_tokens=5),
        AddRequest("r14", tuple(range(100, 117)), max_tokens=4),
        *[Step() for _ in range(11)],
    ]
    return Trace(cfg, ops, {"sys": tuple(range(40, 72)), "doc": tuple(range(300, 348))})


@pytest.fixture
def dropping():
    with M.by_name("stale_output_dropped").apply() as subject:
        yield subject


def test_a_smaller_pool_brings_an_in_flight_preemption_sooner(dropping):
    trace = _in_flight_drop_trace()
    found = run_trace(trace, dropping).failure
    assert found is not None, "the planted drop must show on the suite's pool"
    assert run_trace(trace, OmniSubject()).failure is None

    def ops_only(self: Shrinker) -> None:  # the shrinker as it was before the pool pass
        return None

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Shrinker, "_shrink_pool", ops_only)
        fixed_pool = Shrinker(trace, same_failure(dropping, found.path)).run()
    result = Shrinker(trace, same_failure(dropping, found.path)).run()
    assert result.complete and fixed_pool.complete
    shrunk = result.trace
    assert len(shrunk.ops) <= 12 and len(shrunk.ops) < len(fixed_pool.trace.ops)
    assert shrunk.config.num_blocks < trace.config.num_blocks
    assert shrunk.config.max_model_len < shrunk.config.num_blocks * shrunk.config.block_size
    assert result.to_dict()["num_blocks"] == {
        "original": trace.config.num_blocks,
        "shrunk": shrunk.config.num_blocks,
    }
    # The same defect, in the same field (on whichever request meets it), and real: the
    # unmodified runtime runs the shrunk trace as upstream does.
    again = run_trace(shrunk, dropping).failure
    assert again is not None and again.field == found.field
    assert run_trace(shrunk, OmniSubject()).failure is None
