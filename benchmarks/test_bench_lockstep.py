"""Cost of one lock-step step against one upstream step alone, on the same workload.

A lock-step step runs the step on both sides, checks them against each other (building and
comparing snapshots only when the in-place check cannot show them equal) and against the
registry. On identical state (8 decoding requests), timed in turn step by step:
``extra_info["overhead_ratio"]`` is lock step over one upstream step (target <= 4x), and
``extra_info["harness_overhead_over_floor"]`` is lock step / (upstream + subject) - 1, the two
schedulers timed alone in the same interleaving (target <= 0.15).

The measured figures: docs/design.md, "The gate". Run: ``pytest benchmarks/test_bench_lockstep.py
--benchmark-enable`` (benchmarks are skipped by default through ``--benchmark-skip``).
"""

from __future__ import annotations

import gc
import statistics
import time

import pytest

from conformance._core.config import HarnessConfig
from conformance._core.driver import make_driver
from conformance._core.lockstep import Lockstep
from conformance._core.subjects import UpstreamSubject
from conformance._core.tokens import DeterministicTokenSource
from conformance._core.workload import AddRequest, Step
from omni_runtime.conformance_subject import OmniSubject

CFG = HarnessConfig(num_blocks=128, max_num_seqs=16, max_num_batched_tokens=512)
ROUNDS = 120  # timed steps of each kind
STEPS = 20  # consecutive steady decode steps timed per warm session (max_tokens leaves room)
WARM_STEPS = 3  # prefill everything, so the measured steps are steady decode steps


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


def _warm_alone(subject):
    """One scheduler stepped on its own, the way the lock-step session steps each side."""
    sched = subject.build_scheduler(CFG)
    driver = make_driver(sched, DeterministicTokenSource())
    for i, op in enumerate(_ops()):
        sched.add_request(subject.make_request(op, list(op.prompt), CFG, sched, float(i)))
    for _ in range(WARM_STEPS):
        driver.step()
    return driver


def _interleaved_medians() -> tuple[float, float, float]:
    """Median step time of upstream alone, the subject alone and one lock-step step.

    The three are timed in turn, step by step, on warm steady decode state (``STEPS`` steps per
    round), so machine drift hits them alike; timing all of one kind first and then all of the
    other let a busy spell land on one side only (figures moved by 50 points between runs).
    """
    up: list[float] = []
    alone: list[float] = []
    lock: list[float] = []
    for _ in range(ROUNDS // STEPS):
        drivers = [_warm_alone(UpstreamSubject()), _warm_alone(OmniSubject())]
        session = _warm_session()
        gc.collect()  # the setup's garbage must not be collected inside a timed step
        for _ in range(STEPS):
            for driver, samples in ((drivers[0], up), (drivers[1], alone)):
                t0 = time.perf_counter()
                driver.step()
                samples.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            session.apply(Step())
            lock.append(time.perf_counter() - t0)
        assert session.failure is None
    return statistics.median(up), statistics.median(alone), statistics.median(lock)


@pytest.mark.benchmark(group="lockstep")
def test_bench_lockstep_step(benchmark):
    result: list[tuple[float, float, float]] = []
    benchmark.pedantic(lambda: result.append(_interleaved_medians()), rounds=1, iterations=1)
    upstream_alone, subject_alone, lockstep = result[0]
    ratio = lockstep / upstream_alone
    # What the harness adds beyond stepping both schedulers (observe, compare, bookkeeping):
    # the floor is the two sides' own steps, each measured alone in the same run.
    floor = upstream_alone + subject_alone
    over_floor = lockstep / floor - 1
    benchmark.extra_info.update(
        {
            "upstream_step_median_s": upstream_alone,
            "subject_step_median_s": subject_alone,
            "lockstep_step_median_s": lockstep,
            "overhead_ratio": round(ratio, 2),
            "target_ratio": 4.0,
            "harness_overhead_over_floor": round(over_floor, 3),
            "harness_overhead_over_two_upstream_steps": round(
                lockstep / (2 * upstream_alone) - 1, 3
            ),
            "target_overhead_over_floor": 0.15,
            "requests": 8,
        }
    )
    print(
        f"\nlock-step {lockstep * 1e6:.0f} us; upstream {upstream_alone * 1e6:.0f} us, subject "
        f"{subject_alone * 1e6:.0f} us alone: {ratio:.2f}x upstream; harness overhead over the "
        f"two sides' own steps {over_floor:.1%} (target <= 15%)"
    )
    assert ratio <= 4.0, f"lock-step step costs {ratio:.2f}x an upstream step (target <= 4x)"
