"""Worker / runner benchmarks: decode throughput and the payload critical path.

* ``test_decode_throughput[N]`` — thinker decode tokens/s with N = 1, 8, 32 running requests,
  one full step per round (vLLM's scheduler, our runner); ``extra_info["tokens_per_s"]``.
* ``test_payload_critical_path[model]`` — the critical path (``execute_model`` +
  ``sample_tokens``) of a 512-token prefill with payloads, background over inline
  (``extra_info["ratio"]``, target <= 0.5 with the ``heavy`` model; ``thinker``: hidden rows
  only).
* ``test_bytes_per_token[mode]`` — bytes crossing the stage boundary per generated token,
  token-only vs include-hidden.

See docs/design.md, "How the benchmarks measure". Run: ``pytest benchmarks/test_bench_worker.py
-p no:cacheprovider --benchmark-enable --benchmark-only -o addopts=""``.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save_file
from vllm import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from conformance._core.config import (
    HarnessConfig,
    block_hasher,
    build_kv_cache_config,
    build_scheduler,
)
from conformance._core.driver import WorkerExecutor
from omni_runtime.config import OmniStageConfig
from omni_runtime.models import LlamaLM, LlamaLMConfig, load_model, model_dir
from omni_runtime.models.llama import init_llama_state_dict
from omni_runtime.worker import OmniARModelRunner
from omni_runtime.worker.materialize import BackgroundOutput


@pytest.fixture(scope="module")
def thinker_dir() -> str:
    return str(model_dir("thinker"))


def _stage(**kw: Any) -> OmniStageConfig:
    return OmniStageConfig(
        stage_id="thinker", stages=("thinker", "talker"), downstream=("talker",), **kw
    )


def _setup(
    model_path: str,
    model: LlamaLM,
    n: int,
    *,
    max_tokens: int,
    prompt_len: int,
    stage: OmniStageConfig | None = None,
    budget: int | None = None,
) -> tuple[Scheduler, OmniARModelRunner]:
    cfg = HarnessConfig(
        model=model_path,
        num_blocks=n * 40 + 8,
        max_num_seqs=max(n, 1),
        max_num_batched_tokens=budget or max(256, n * prompt_len),
        max_model_len=512,
        enable_prefix_caching=False,
        additional_config={"omni_stage": stage.to_dict()} if stage else {},
    )
    sched = build_scheduler(Scheduler, cfg)
    runner = OmniARModelRunner(sched.vllm_config, model)
    runner.initialize_kv_cache(build_kv_cache_config(cfg))
    h = block_hasher(cfg.block_size)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(n):
        prompt = [7 + (i * 13 + j) % 400 for j in range(prompt_len)]
        sched.add_request(Request(f"r{i}", prompt, sp, None, arrival_time=0.0, block_hasher=h))
    return sched, runner


def payload_bytes(payload: Any) -> int:
    """The bytes of a payload's tensors (hidden rows, conditioning, multimodal outputs)."""
    tensors = (payload.hidden, payload.conditioning, *payload.multimodal.values())
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _step(sched: Scheduler, runner: OmniARModelRunner) -> None:
    so = sched.schedule()
    sched.update_from_output(so, WorkerExecutor(runner).execute(so))


@pytest.mark.parametrize("n", [1, 8, 32])
def test_decode_throughput(benchmark, thinker_dir, n) -> None:
    model = load_model(thinker_dir)
    assert isinstance(model, LlamaLM)
    rounds = 150
    sched, runner = _setup(thinker_dir, model, n, max_tokens=rounds + 40, prompt_len=16)
    _step(sched, runner)  # prefill: from here on every step is n decodes
    benchmark.pedantic(_step, args=(sched, runner), rounds=rounds, warmup_rounds=10)
    # The median: the benchmark host is shared, and a mean is dominated by descheduling spikes.
    median = benchmark.stats.stats.median
    benchmark.extra_info["running_requests"] = n
    benchmark.extra_info["tokens_per_s"] = round(n / median, 1)
    benchmark.extra_info["step_ms"] = round(median * 1e3, 3)


# ---- critical path: background vs inline -----------------------------------------------------


def _heavy_model_dir(root: Path) -> str:
    cfg = LlamaLMConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    )
    folder = root / "heavy"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    save_file(init_llama_state_dict(cfg, 7), str(folder / "model.safetensors"), {"format": "pt"})
    return str(folder)


@pytest.mark.parametrize("variant", ["heavy", "thinker"])
def test_payload_critical_path(benchmark, thinker_dir, tmp_path, variant) -> None:
    if variant == "heavy":
        path, outputs = _heavy_model_dir(tmp_path), ("logits",)
    else:
        path, outputs = thinker_dir, ()
    model = load_model(path)
    assert isinstance(model, LlamaLM)
    n, prompt_len = 16, 32  # one 512-token prefill step
    runners = {}
    so = None
    for mode in ("inline", "background"):
        stage = _stage(materialization=mode, multimodal_outputs=outputs)
        sched, runner = _setup(
            path, model, n, max_tokens=4, prompt_len=prompt_len, stage=stage, budget=n * prompt_len
        )
        runners[mode] = runner
        if so is None:
            so = sched.schedule()
    assert so is not None and so.total_num_scheduled_tokens == n * prompt_len

    def critical(runner: OmniARModelRunner) -> tuple[float, Any]:
        t0 = time.perf_counter()
        runner.execute_model(so)
        out = runner.sample_tokens(None)
        return time.perf_counter() - t0, out

    def finish(out: Any) -> None:
        if isinstance(out, BackgroundOutput):
            out.get_output()

    times: dict[str, list[float]] = {"inline": [], "background": []}
    for _ in range(3):  # warm-up
        for r in runners.values():
            finish(critical(r)[1])
    for _ in range(25):  # alternate so machine drift hits both modes equally
        for mode, r in runners.items():
            dt, out = critical(r)
            times[mode].append(dt)
            finish(out)  # joined off the clock: only the critical path is timed

    pending: list[Any] = []

    def background_round() -> None:
        runners["background"].execute_model(so)
        pending.append(runners["background"].sample_tokens(None))

    def collect() -> None:
        while pending:
            finish(pending.pop())

    benchmark.pedantic(background_round, setup=collect, rounds=20, warmup_rounds=2)
    collect()
    inline_ms = statistics.median(times["inline"]) * 1e3
    background_ms = statistics.median(times["background"]) * 1e3
    benchmark.extra_info.update(
        variant=variant,
        step_tokens=n * prompt_len,
        inline_critical_ms=round(inline_ms, 3),
        background_critical_ms=round(background_ms, 3),
        ratio=round(background_ms / inline_ms, 3),
    )
    for r in runners.values():
        r.shutdown()


# ---- bytes crossing the stage boundary -------------------------------------------------------


@pytest.mark.parametrize("include_hidden", [False, True], ids=["token_only", "include_hidden"])
def test_bytes_per_token(benchmark, thinker_dir, include_hidden) -> None:
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    from omni_runtime.adapters.input import InputAdapter, StageInput
    from omni_runtime.engine import vllm_compat as engine_compat
    from omni_runtime.engine.config import runtime_vllm_config

    stage = _stage(omni_pooler_payload_include_hidden=include_hidden)
    vc = runtime_vllm_config(
        thinker_dir,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        block_size=16,
        prefix_caching=False,
        async_scheduling=False,
        stage=stage,
    )
    ec = EngineCore(vc, executor_class=UniProcExecutor, log_stats=False)
    totals = {"bytes": 0, "tokens": 0}

    def run() -> None:
        adapter = InputAdapter(
            stage, max_model_len=256, block_hasher=engine_compat.block_hasher(ec)
        )
        for i in range(8):
            ec.add_request(
                adapter.build(
                    StageInput(
                        request_id=f"b{totals['tokens']}-{i}",
                        sampling_params=SamplingParams(
                            max_tokens=32, ignore_eos=True, temperature=0
                        ),
                        prompt_token_ids=[5 + (i * 7 + j) % 500 for j in range(24)],
                        arrival_time=0.0,
                    )
                )
            )
        while ec.scheduler.has_requests():
            outputs, _ = ec.step()
            for eco in outputs.values():
                for o in eco.outputs:
                    totals["tokens"] += len(o.new_token_ids)
            for chunk in ec.scheduler.transfer.sink.drain():  # type: ignore[union-attr]
                totals["bytes"] += 8 * len(chunk.token_ids)
                if chunk.payload is not None:
                    totals["bytes"] += payload_bytes(chunk.payload)

    try:
        benchmark.pedantic(run, rounds=3, warmup_rounds=0)
    finally:
        ec.shutdown()
    benchmark.extra_info["mode"] = "include_hidden" if include_hidden else "token_only"
    benchmark.extra_info["bytes_per_token"] = round(totals["bytes"] / totals["tokens"], 1)
    benchmark.extra_info["generated_tokens"] = totals["tokens"]
