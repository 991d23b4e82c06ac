"""Scheduler step cost: omni vs upstream, measured side by side in the same run.

One step is ``schedule()`` + ``update_from_output()`` with N running decode requests (8, 64 and
1,024). Upstream and
omni steps alternate round by round so drift on the machine hits both equally; the reported
figure is the ratio of medians (targets: <= 1.10x with omni features off, <= 1.05x with chunk
transfer on, at 64 and 1,024 running requests; at 8 the omni pass's fixed cost per step, a few
microseconds, is most of the difference). With chunk transfer on, the omni side's figure also
holds two costs of the workload rather than of the transfer pass: its requests are the input
adapter's ``OmniRequest`` objects, and upstream's own update runs slower over two request types
in one process than over one (the omni side's by 2-3% of a step at 64, with transfer off); and
every 8th step streams a codec chunk for every request at once, which moves the omni median up.
Run with ``pytest benchmarks -o addopts="" --benchmark-enable -p no:cacheprovider``.
"""

from __future__ import annotations

import statistics
import time

import pytest
from vllm import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from conformance.config import HarnessConfig, block_hasher, build_scheduler
from omni_runtime.adapters import InputAdapter, StageInput
from omni_runtime.config import OmniStageConfig, stage_additional_config
from omni_runtime.conformance_subject import talker_stage
from omni_runtime.sched import OmniARScheduler

ROUNDS = 300
# The same talker stage the gate's omni subject runs.
TALKER = OmniStageConfig.from_dict(talker_stage())


def _ready(cls, n: int, omni: bool):
    cfg = HarnessConfig(
        num_blocks=n * 24 + 8, max_num_seqs=n, max_num_batched_tokens=max(256, n * 16),
        max_model_len=512,
        additional_config=stage_additional_config(TALKER) if omni else {},
    )
    sched = build_scheduler(cls, cfg)
    h = block_hasher(cfg.block_size)
    sp = SamplingParams(max_tokens=ROUNDS + 50, ignore_eos=True)
    for i in range(n):
        prompt = [7 + (i * 13 + j) % 400 for j in range(16)]
        if omni:
            adapter = InputAdapter(TALKER, max_model_len=512, block_hasher=h, live_ids=sched.requests)
            req = adapter.build(StageInput(f"r{i}", sp, prompt_token_ids=prompt, arrival_time=0.0))
        else:
            req = Request(f"r{i}", prompt, sp, None, arrival_time=0.0, block_hasher=h)
        sched.add_request(req)
    _step(sched)  # prefill every request: from here on each step is N decodes
    return sched


def _step(sched) -> None:
    so = sched.schedule()
    ids = list(so.num_scheduled_tokens)
    out = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[11 + i % 200] for i in range(len(ids))],
    )
    sched.update_from_output(so, out)


def _timed(sched) -> float:
    t = time.perf_counter()
    _step(sched)
    return time.perf_counter() - t


@pytest.mark.parametrize("n", [8, 64, 1024])
@pytest.mark.parametrize("mode,target", [("omni-off", 1.10), ("chunk-transfer", 1.05)])
def test_step_cost_vs_upstream(benchmark, n, mode, target):
    omni_on = mode == "chunk-transfer"
    up = _ready(Scheduler, n, omni=False)
    om = _ready(OmniARScheduler, n, omni=omni_on)
    up_t, om_t = [], []
    for _ in range(ROUNDS // 2):
        up_t.append(_timed(up))
        om_t.append(_timed(om))
    ratio = statistics.median(om_t) / statistics.median(up_t)
    benchmark.extra_info.update(
        running=n, mode=mode, upstream_median_us=statistics.median(up_t) * 1e6,
        omni_median_us=statistics.median(om_t) * 1e6, ratio=round(ratio, 3), target=target,
    )
    print(f"\n[{mode} n={n}] upstream {statistics.median(up_t)*1e6:.1f} us, "
          f"omni {statistics.median(om_t)*1e6:.1f} us, ratio {ratio:.3f} (target <= {target})")
    benchmark.pedantic(_step, args=(om,), rounds=ROUNDS // 2 - 10, iterations=1)
