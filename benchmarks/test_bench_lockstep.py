"""Cost of one lock-step step against one upstream step alone, on the same workload.

A lock-step step runs the step on both sides (upstream and the subject), snapshots both
(request state, queues, block pool, SchedulerOutput, outputs) and compares them against the
registry. The harness is only usable as a CI gate if that stays within a small factor of the
step itself: the target is <= 4x. Both are measured in the same run, on identical state (each
round starts from a fresh set of 8 decoding requests), and the ratio goes into
``benchmark.extra_info["overhead_ratio"]``.

The harness's own share is reported against the floor of running both schedulers, taken as two
upstream steps: ``extra_info["harness_overhead_over_floor"]`` is lock-step / (2 x upstream) - 1
(target <= 0.15), from the same two medians.

Run: ``pytest benchmarks/test_bench_lockstep.py --benchmark-enable`` (benchmarks are skipped by
default through ``--benchmark-skip`` in the project's addopts).
"""

from __future__ import annotations

import gc
import statistics
import time

import pytest

from conformance.config import HarnessConfig
from conformance.driver import make_driver
from conformance.lockstep import Lockstep
from conformance.subjects import UpstreamSubject
from conformance.tokens import DeterministicTokenSource
from conformance.workload import AddRequest, Step
from omni_runtime.conformance_subject import OmniSubject

CFG = HarnessConfig(num_blocks=128, max_num_seqs=16, max_num_batched_tokens=512)
ROUNDS = 60
WARM_STEPS = 3  # prefill everything, so the measured step is a steady decode step


def _ops():
    shared = tuple(range(40, 72))
    return [
        AddRequest(f"b{i}", shared + tuple(range(100 + i, 120 + i)), max_tokens=200)
        for i in range(8)
    ]


def _warm_session() -> Lockstep:
    session = Lockstep(CFG, OmniSubject())
    for op in _ops():
        session.apply(op)
    for _ in range(WARM_STEPS):
        session.apply(Step())
    assert session.failure is None
    return session


def _warm_upstream():
    subject = UpstreamSubject()
    sched = subject.build_scheduler(CFG)
    driver = make_driver(sched, DeterministicTokenSource())
    for i, op in enumerate(_ops()):
        sched.add_request(subject.make_request(op, list(op.prompt), CFG, sched, float(i)))
    for _ in range(WARM_STEPS):
        driver.step()
    return driver


def _time_upstream_step() -> float:
    samples = []
    for _ in range(ROUNDS):
        driver = _warm_upstream()
        gc.collect()  # the setup's garbage must not be collected inside the timed step
        t0 = time.perf_counter()
        driver.step()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


@pytest.mark.benchmark(group="lockstep")
def test_bench_lockstep_step(benchmark):
    upstream_alone = _time_upstream_step()

    def setup():
        session = _warm_session()
        gc.collect()
        return (session,), {}

    def one_lockstep_step(session: Lockstep) -> None:
        session.apply(Step())

    benchmark.pedantic(one_lockstep_step, setup=setup, rounds=ROUNDS, iterations=1)
    lockstep = benchmark.stats.stats.median
    ratio = lockstep / upstream_alone
    # What the harness adds beyond stepping both schedulers (observe, compare, bookkeeping).
    over_floor = lockstep / (2 * upstream_alone) - 1
    benchmark.extra_info.update(
        {
            "upstream_step_median_s": upstream_alone,
            "lockstep_step_median_s": lockstep,
            "overhead_ratio": round(ratio, 2),
            "target_ratio": 4.0,
            "harness_overhead_over_floor": round(over_floor, 3),
            "target_overhead_over_floor": 0.15,
            "requests": 8,
        }
    )
    print(
        f"\nlock-step {lockstep * 1e6:.0f} us vs upstream {upstream_alone * 1e6:.0f} us: "
        f"{ratio:.2f}x; harness overhead over two upstream steps {over_floor:.1%} (target <= 15%)"
    )
    assert ratio <= 4.0, f"lock-step step costs {ratio:.2f}x an upstream step (target <= 4x)"
