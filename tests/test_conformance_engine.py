"""The omni schedulers plug into vLLM's real ``EngineCore`` and behave as upstream's there.

``EngineCore`` (uni executor) is built with ``scheduler_cls`` = ``OmniARScheduler`` /
``OmniARAsyncScheduler`` and the harness's ``DeterministicTokenWorker`` (``worker_cls``), and run
through sync ``step`` and async ``step_with_batch_queue`` with a block budget tight enough to
preempt and an abort mid-run. Every step's ``EngineCoreOutputs`` (ids, tokens, finish and stop
reasons) must equal the same run with upstream's ``Scheduler`` / ``AsyncScheduler``, so the
engine's own calls into the scheduler (``has_requests``, ``schedule``, ``update_from_output``,
``finish_requests``, ``get_grammar_bitmask``) are covered, not only the harness's.
"""

from __future__ import annotations

import os

import pytest

from conformance._core.config import HarnessConfig, block_hasher, build_vllm_config
from conformance._core.token_worker import QUALNAME

pytestmark = pytest.mark.clauses("C-01", "C-04", "C-07")

SCHEDULERS = {
    False: ("vllm.v1.core.sched.scheduler.Scheduler", "omni_runtime.sched.OmniARScheduler"),
    True: (
        "vllm.v1.core.sched.async_scheduler.AsyncScheduler",
        "omni_runtime.sched.OmniARAsyncScheduler",
    ),
}


def _run_engine(scheduler_cls: str, async_: bool) -> tuple[list, dict]:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor.uniproc_executor import UniProcExecutor
    from vllm.v1.request import Request

    from omni_runtime.engine import vllm_compat as engine_compat

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    cfg = HarnessConfig(
        async_scheduling=async_, num_blocks=12, max_model_len=128, max_num_batched_tokens=64
    )
    vc = build_vllm_config(
        cfg,
        scheduler_cls=scheduler_cls,
        worker_cls=QUALNAME,
        num_gpu_blocks_override=cfg.num_blocks,
    )
    engine = EngineCore(vc, UniProcExecutor, log_stats=False)
    facts = {
        "scheduler": type(engine.scheduler).__name__,
        "preemptions": 0,
        "batch_queue": engine.batch_queue_size,
    }
    try:
        shared = list(range(50, 66))
        for i in range(6):
            sp = SamplingParams(
                max_tokens=40, ignore_eos=True, stop_token_ids=[5, 6] if i % 3 == 1 else None
            )
            engine.add_request(
                Request(
                    f"e{i}",
                    shared + list(range(100 + 7 * i, 110 + 7 * i)),
                    sp,
                    None,
                    arrival_time=float(i),
                    block_hasher=block_hasher(cfg.block_size),
                )
            )
        steps: list = []
        for n in range(200):
            if not engine.scheduler.has_requests() and not engine_compat.has_queued_steps(engine):
                break
            if n == 6:
                engine.abort_requests(["e5"])
            out, _ = engine_compat.step(engine)
            facts["preemptions"] = max(
                facts["preemptions"],
                sum(r.num_preemptions for r in engine.scheduler.requests.values()),
            )
            steps.append(
                sorted(
                    (o.request_id, tuple(o.new_token_ids), str(o.finish_reason), o.stop_reason)
                    for eco in (out or {}).values()
                    for o in eco.outputs
                )
            )
        facts["left"] = len(engine.scheduler.requests)
        return steps, facts
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_", [False, True], ids=["step", "step_with_batch_queue"])
def test_engine_core_outputs_match_upstream(async_):
    upstream_cls, omni_cls = SCHEDULERS[async_]
    expected, up_facts = _run_engine(upstream_cls, async_)
    got, omni_facts = _run_engine(omni_cls, async_)
    assert omni_facts["scheduler"].startswith("OmniAR")
    assert omni_facts["batch_queue"] == (2 if async_ else 1)
    assert up_facts["preemptions"] > 0, "the run must preempt to mean anything"
    assert omni_facts["left"] == up_facts["left"] == 0
    assert got == expected
    assert sum(len(s) for s in expected) > 40
