"""Scheduler step cost: omni vs upstream, each in its own process, measured in the same run.

One step is ``schedule()`` + ``update_from_output()`` with N running decode requests (8, 64 and
1,024). Upstream's ``Scheduler`` (vLLM ``Request`` objects) and ``OmniARScheduler`` (plain
requests with omni features off; the input adapter's ``OmniRequest`` objects with chunk transfer
on) each run in a child process of their own, built there as before (``sched_step_child``). The
parent interleaves them round by round, one timed step of upstream, then one of omni, so drift
on the machine hits both equally; each child times its step alone with ``perf_counter`` (the
pipe round trip is not in the figure). The reported figure is the ratio of medians (targets:
<= 1.10x with omni features off, <= 1.05x with chunk transfer on, at 64 and 1,024 running
requests; at 8 the omni pass's fixed cost per step, a few microseconds, is most of the
difference). The pytest-benchmark table itself times the omni step as a round trip from the
parent (child step plus the pipe both ways), so it reads higher than ``omni_median_us``.

Why a process per scheduler: with both in one process, vLLM's own ``update_from_output`` runs
over two request types (``Request`` and its subclass ``OmniRequest``) through the same code, and
CPython 3.11's specialising interpreter keeps re-specialising its attribute loads between them.
Both sides slow down and the omni side more; a production process hosts one scheduler kind and
one request type, so none of that is the runtime's cost. Measured at n=64, chunk transfer, six
alternating pairs on the 2 shared cores: both schedulers in one process, the omni side's update
ran 29-49 us above upstream's (median 46, of which ~25 us is the transfer pass below) and the
step ratio was 1.04-1.08 (median 1.07); each in its own process 1.01-1.11 (median 1.05). Two
upstream children against each other give 0.98-1.03 (8 pairs), which is the noise floor of one
figure here; omni-off stays ~1.00 either way, since both sides then carry the same request type.

What remains with chunk transfer on is the transfer pass itself, run for every request of every
step: at n=64 about 25 us of a ~700 us step (``on_steps`` ~17 us, of which ~9 us is the codec
streamer's own buffering; the stale-drop scan and the pairing of outputs with requests ~5 us),
i.e. ~0.4 us per request. Timed on the common steps alone the ratio was 1.02-1.07 (median 1.04,
six pairs). The rest is a cost of the workload: every 8th step streams a codec chunk for every
request at once (~1,400 us against ~740 us at n=64), and those steps sitting above the median
move the omni median up by 0-3 points.

Run with ``pytest benchmarks -o addopts="" --benchmark-enable -p no:cacheprovider``.
"""

from __future__ import annotations

import statistics

import pytest
from sched_step_child import ROUNDS, StepChild


@pytest.mark.parametrize("n", [8, 64, 1024])
@pytest.mark.parametrize("mode,target", [("omni-off", 1.10), ("chunk-transfer", 1.05)])
def test_step_cost_vs_upstream(benchmark, n, mode, target):
    # Both children build at once (their setups overlap on the 2 cores); timing starts only
    # once both are ready, and from then on exactly one of them runs at a time.
    up = StepChild("upstream", n, omni=False)
    om = StepChild("omni", n, omni=mode == "chunk-transfer")
    try:
        up.wait_ready()
        om.wait_ready()
        up_t, om_t = [], []
        for _ in range(ROUNDS // 2):
            up_t.append(up.step())
            om_t.append(om.step())
        up_med, om_med = statistics.median(up_t), statistics.median(om_t)
        ratio = om_med / up_med
        benchmark.extra_info.update(
            running=n,
            mode=mode,
            upstream_median_us=up_med * 1e6,
            omni_median_us=om_med * 1e6,
            ratio=round(ratio, 3),
            target=target,
            isolation="process per scheduler",
        )
        print(
            f"\n[{mode} n={n}] upstream {up_med * 1e6:.1f} us, "
            f"omni {om_med * 1e6:.1f} us, ratio {ratio:.3f} (target <= {target})"
        )
        # pytest-benchmark's own table: the omni step as a round trip from here (the step in
        # the omni child plus the pipe both ways), not the in-child time the ratio uses.
        benchmark.pedantic(om.step, rounds=ROUNDS // 2 - 10, iterations=1)
    finally:
        up.close()
        om.close()
