"""OmniARWorker inside vLLM's real ``EngineCore`` (uni executor), against Hugging Face.

What these tests prove:

* C-08 — greedy tokens equal a full-recompute Hugging Face ``LlamaForCausalLM`` (eager
  attention, no paging) of the same weights, with prefix caching on and off (prompts share
  prefixes and later waves hit the cache), under chunked prefill with token budgets of 16,
  under forced preemption (a tiny block pool), in sync and async (batch-queue) scheduling.
* C-52 / C-55 — inline and background materialization deliver identical chunks (payload rows,
  multimodal outputs, conditioning, token ids) and tokens through the omni scheduler's outbox,
  even when every runner scratch buffer is scribbled over after each engine step; prefix-cache
  merges deliver the cached prompt rows, equal (to fp tolerance) to a run without the cache.
* C-30 / C-31 — token-only and include-hidden runs give identical tokens; token-only chunks
  carry no hidden rows but still carry each request's prefill conditioning, equal to the
  include-hidden run's; the conditioning arrives exactly once even when vLLM drops the step
  that carried it (``reset_prefix_cache(reset_running_requests=True)`` with that step in flight).
* C-54 — connector output is collected on the engine's thread once per executed step, payloads
  are built on the builder thread, and a builder error surfaces from ``EngineCore.step``.
* Sampling — seeded random sampling gives a request the same tokens alone or in a batch.
* Prompt embeds — a request fed the token embeddings as ``prompt_embeds`` generates the same
  tokens as the token-id request.
* ``vllm.LLM`` — generates on CPU with our worker and scheduler.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.engine.core import EngineCore
from vllm.v1.executor.uniproc_executor import UniProcExecutor
from vllm.v1.request import Request

from omni_runtime.adapters.input import InputAdapter, StageInput
from omni_runtime.config import OmniStageConfig
from omni_runtime.engine import vllm_compat as engine_compat
from omni_runtime.engine.config import runtime_vllm_config
from omni_runtime.models import load_model, model_dir
from omni_runtime.payload import StageChunk
from omni_runtime.worker import OmniARModelRunner

os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
os.environ["HF_HUB_OFFLINE"] = "1"

MAX_MODEL_LEN = 128
MAX_TOKENS = 10
WORKER = "omni_runtime.worker.OmniARWorker"


@pytest.fixture(scope="module")
def thinker_dir() -> str:
    return str(model_dir("thinker"))


def _prompts(seed: int, n: int) -> list[list[int]]:
    """Prompts that share prefixes (one full block and more) so prefix caching can hit."""
    rng = random.Random(seed)
    base = [rng.randrange(3, 512) for _ in range(48)]
    out = []
    for i in range(n):
        if i % 3 == 2:
            out.append([rng.randrange(3, 512) for _ in range(rng.randrange(5, 40))])
        else:
            keep = 16 * (1 + i % 3)
            out.append(base[:keep] + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 20))])
    return out


PROMPTS = _prompts(1, 8)


@pytest.fixture(scope="module")
def hf_reference(thinker_dir: str) -> Callable[[list[int]], list[int]]:
    """Greedy continuation by Hugging Face, full recompute each step (cached per prompt)."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(
        thinker_dir, attn_implementation="eager", dtype=torch.float32
    ).eval()
    cache: dict[tuple[int, ...], list[int]] = {}

    def ref(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in cache:
            ids = list(prompt)
            with torch.no_grad():
                for _ in range(MAX_TOKENS):
                    logits = hf(torch.tensor([ids])).logits[0, -1]
                    ids.append(int(logits.argmax()))
            cache[key] = ids[len(prompt) :]
        return cache[key]

    return ref


def make_engine(
    model: str,
    *,
    prefix: bool = True,
    async_: bool = False,
    budget: int = 256,
    max_seqs: int = 8,
    blocks: int | None = None,
    stage: OmniStageConfig | None = None,
) -> EngineCore:
    vc = runtime_vllm_config(
        model,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        block_size=16,
        num_blocks=blocks,
        prefix_caching=prefix,
        async_scheduling=async_,
        stage=stage,
    )
    return EngineCore(vc, executor_class=UniProcExecutor, log_stats=False)


def runner_of(ec: EngineCore) -> OmniARModelRunner:
    return engine_compat.model_runner(ec)


def plain_request(ec: EngineCore, rid: str, prompt: list[int], **sp: Any) -> Request:
    kw: dict[str, Any] = dict(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    kw.update(sp)
    params = SamplingParams(**kw)
    return Request(
        request_id=rid,
        prompt_token_ids=list(prompt),
        sampling_params=params,
        pooling_params=None,
        arrival_time=0.0,
        block_hasher=engine_compat.block_hasher(ec),
    )


class Run:
    """Drives an engine like vLLM's busy loop and records what comes out."""

    def __init__(self, ec: EngineCore, after_step: Callable[[], None] | None = None) -> None:
        self.ec = ec
        self.tokens: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}
        self.chunks: list[StageChunk] = []
        self.max_preemptions = 0
        self.after_step = after_step

    def step(self) -> None:
        outputs, _ = engine_compat.step(self.ec)
        for req in engine_compat.scheduler_requests(self.ec.scheduler).values():
            self.max_preemptions = max(self.max_preemptions, req.num_preemptions)
        for eco in (outputs or {}).values():
            for out in eco.outputs:
                self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.prefill_stats is not None:
                    self.cached[out.request_id] = out.prefill_stats.num_cached_tokens
        transfer = getattr(self.ec.scheduler, "transfer", None)
        if transfer is not None:
            self.chunks.extend(transfer.sink.drain())
        if self.after_step is not None:
            self.after_step()

    def busy(self) -> bool:
        return bool(self.ec.scheduler.has_requests() or engine_compat.has_queued_steps(self.ec))

    def run(self, waves: Iterable[list[Request]], steps_between: int = 3) -> Run:
        for wave in waves:
            for r in wave:
                self.ec.add_request(r)
            for _ in range(steps_between):
                if self.busy():
                    self.step()
        while self.busy():
            self.step()
        return self


def _waves(ec: EngineCore, prompts: list[list[int]], prefix: str = "r") -> list[list[Request]]:
    reqs = [plain_request(ec, f"{prefix}{i}", p) for i, p in enumerate(prompts)]
    half = len(reqs) // 2
    return [reqs[:half], reqs[half:]]


# ---- C-08: model-level parity ---------------------------------------------------------------


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("prefix", [True, False], ids=["cache", "nocache"])
@pytest.mark.parametrize("budget", [16, 256], ids=["chunk16", "budget256"])
def test_greedy_matches_hf(thinker_dir, hf_reference, async_, prefix, budget) -> None:
    ec = make_engine(thinker_dir, prefix=prefix, async_=async_, budget=budget)
    try:
        run = Run(ec).run(_waves(ec, PROMPTS))
    finally:
        ec.shutdown()
    for i, p in enumerate(PROMPTS):
        assert run.tokens[f"r{i}"] == hf_reference(p), f"r{i}"
    if prefix:
        # Second-wave prompts share whole blocks with the first wave: the cache must hit.
        assert sum(run.cached.values()) > 0, run.cached
    else:
        assert sum(run.cached.values()) == 0


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_greedy_matches_hf_under_preemption(thinker_dir, hf_reference, async_) -> None:
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(30, 60))] for _ in range(6)]
    # 10 blocks of 16 tokens for 6 requests of 40..70 tokens each: preemption is forced.
    ec = make_engine(thinker_dir, async_=async_, budget=32, blocks=10, prefix=False)
    try:
        reqs = [plain_request(ec, f"p{i}", p) for i, p in enumerate(prompts)]
        run = Run(ec).run([reqs])
    finally:
        ec.shutdown()
    assert run.max_preemptions > 0
    for i, p in enumerate(prompts):
        assert run.tokens[f"p{i}"] == hf_reference(p), f"p{i}"


# ---- payload contracts through the omni scheduler's outbox ----------------------------------


def _stage(**kw: Any) -> OmniStageConfig:
    return OmniStageConfig(
        stage_id="thinker", stages=("thinker", "talker"), downstream=("talker",), **kw
    )


def _omni_waves(ec: EngineCore, stage: OmniStageConfig, prompts: list[list[int]], **sp: Any):
    adapter = InputAdapter(
        stage, max_model_len=MAX_MODEL_LEN, block_hasher=engine_compat.block_hasher(ec)
    )
    params = dict(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    params.update(sp)
    reqs = [
        adapter.build(
            StageInput(
                request_id=f"o{i}",
                sampling_params=SamplingParams(**params),
                prompt_token_ids=p,
                arrival_time=0.0,
            )
        )
        for i, p in enumerate(prompts)
    ]
    half = len(reqs) // 2
    return [reqs[:half], reqs[half:]]


def _scribbler(ec: EngineCore) -> Callable[[], None]:
    runner = runner_of(ec)

    def scribble() -> None:
        for buf in runner.persistent_buffers().values():
            if isinstance(buf, torch.Tensor):
                buf.fill_(float("nan"))
            else:
                buf.fill(-12345)

    return scribble


def _omni_run(
    model: str,
    stage: OmniStageConfig,
    *,
    async_: bool = True,
    scribble: bool = False,
    prefix: bool = True,
    prompts: list[list[int]] = PROMPTS,
    **sp: Any,
) -> Run:
    ec = make_engine(model, async_=async_, budget=32, stage=stage, prefix=prefix)
    try:
        run = Run(ec, _scribbler(ec) if scribble else None)
        run.run(_omni_waves(ec, stage, prompts, **sp))
    finally:
        ec.shutdown()
    return run


def _chunk_key(c: StageChunk) -> tuple:
    p = c.payload
    return (
        c.request_id,
        c.seq,
        c.token_ids,
        c.is_final,
        None if p is None else (p.start, p.num_tokens, p.hidden is None, sorted(p.multimodal)),
    )


def _tensors_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("async_", [True, False], ids=["async", "sync"])
def test_inline_and_background_identical_under_scribbling(thinker_dir, async_) -> None:
    kw = dict(downstream_needs_full_prefix=True, multimodal_outputs=("logits",))
    inline = _omni_run(thinker_dir, _stage(materialization="inline", **kw), async_=async_)
    background = _omni_run(
        thinker_dir, _stage(materialization="background", **kw), async_=async_, scribble=True
    )
    inline_scribbled = _omni_run(
        thinker_dir, _stage(materialization="inline", **kw), async_=async_, scribble=True
    )
    assert background.tokens == inline.tokens == inline_scribbled.tokens
    for other in (background, inline_scribbled):
        assert [_chunk_key(c) for c in other.chunks] == [_chunk_key(c) for c in inline.chunks]
        for a, b in zip(inline.chunks, other.chunks, strict=True):
            if a.payload is None:
                continue
            assert b.payload is not None
            assert _tensors_equal(a.payload.hidden, b.payload.hidden)
            assert _tensors_equal(a.payload.conditioning, b.payload.conditioning)
            for name, t in a.payload.multimodal.items():
                assert _tensors_equal(t, b.payload.multimodal[name])
    # Every request received hidden rows for every position it computed, exactly once, and
    # its prefill conditioning once.
    assert any(c.payload is not None and c.payload.start == 0 and c.seq == 0 for c in inline.chunks)


def _rows_by_position(run: Run) -> dict[str, dict[int, torch.Tensor]]:
    rows: dict[str, dict[int, torch.Tensor]] = {}
    for c in run.chunks:
        p = c.payload
        if p is None or p.hidden is None:
            continue
        for j in range(p.num_tokens):
            rows.setdefault(c.request_id, {}).setdefault(p.start + j, p.hidden[j])
    return rows


def test_prefix_merge_delivers_cached_rows(thinker_dir) -> None:
    stage = _stage(downstream_needs_full_prefix=True)
    cached = _omni_run(thinker_dir, stage, prefix=True)
    uncached = _omni_run(thinker_dir, stage, prefix=False)
    assert sum(cached.cached.values()) > 0
    assert cached.tokens == uncached.tokens
    a, b = _rows_by_position(cached), _rows_by_position(uncached)
    for i, p in enumerate(PROMPTS):
        rid = f"o{i}"
        # Every prompt position and every fed-back output position has a row.
        expected = set(range(len(p) + MAX_TOKENS - 1))
        assert set(a[rid]) == expected, rid
        assert set(b[rid]) == expected, rid
        for pos in expected:
            torch.testing.assert_close(a[rid][pos], b[rid][pos], atol=1e-5, rtol=1e-5)


def test_token_only_same_tokens_no_hidden_conditioning_crosses(thinker_dir) -> None:
    sp = dict(temperature=0.9, top_k=40, top_p=0.95)
    full = _omni_run(thinker_dir, _stage(), **sp)
    token_only = _omni_run(thinker_dir, _stage(omni_pooler_payload_include_hidden=False), **sp)
    assert token_only.tokens == full.tokens
    assert all(c.payload is None or c.payload.hidden is None for c in token_only.chunks)
    cond_full = {
        c.request_id: c.payload.conditioning
        for c in full.chunks
        if c.payload and c.payload.conditioning is not None
    }
    cond_tok = [
        (c.request_id, c.payload.conditioning)
        for c in token_only.chunks
        if c.payload and c.payload.conditioning is not None
    ]
    # Exactly one conditioning per request, equal to the include-hidden run's.
    assert sorted(r for r, _ in cond_tok) == sorted(f"o{i}" for i in range(len(PROMPTS)))
    for rid, cond in cond_tok:
        assert torch.equal(cond, cond_full[rid])
    # Each request still gets exactly one terminal delivery.
    finals = sorted(c.request_id for c in token_only.chunks if c.is_final)
    assert finals == sorted(f"o{i}" for i in range(len(PROMPTS)))


@pytest.mark.parametrize("include_hidden", [False, True], ids=["token_only", "hidden"])
def test_conditioning_survives_forced_preemption_in_flight(thinker_dir, include_hidden) -> None:
    """reset_prefix_cache(reset_running_requests=True) while the prefill-completing step is in
    flight: vLLM drops that step's output (token and payload) and recomputes; the conditioning
    must still arrive exactly once, and greedy tokens stay those of the undisturbed run."""
    stage = _stage(omni_pooler_payload_include_hidden=include_hidden)
    ec = make_engine(thinker_dir, async_=True, budget=256, stage=stage)
    try:
        wave = [r for w in _omni_waves(ec, stage, PROMPTS[:1]) for r in w]
        run = Run(ec)
        for r in wave:
            ec.add_request(r)
        run.step()  # schedules and executes the whole prefill; its output is still in flight
        assert ec.reset_prefix_cache(reset_running_requests=True) in (True, False)
        while run.busy():
            run.step()
    finally:
        ec.shutdown()
    conds = sorted(
        c.request_id for c in run.chunks if c.payload and c.payload.conditioning is not None
    )
    assert conds == ["o0"]
    assert run.tokens["o0"] == _omni_run(thinker_dir, stage, prompts=PROMPTS[:1]).tokens["o0"]


# ---- C-54: connector thread and builder errors ----------------------------------------------


def test_connector_collected_on_engine_thread_once_per_step(thinker_dir) -> None:
    ec = make_engine(
        thinker_dir, async_=True, budget=32, stage=_stage(materialization="background")
    )
    runner = runner_of(ec)
    calls: list[int] = []
    samples = 0
    original_sample = runner.sample_tokens

    def collect() -> None:
        calls.append(threading.get_ident())
        return None

    def counting_sample(grammar_output=None):
        nonlocal samples
        if runner._pending is not None:
            samples += 1
        return original_sample(grammar_output)

    runner.collect_connector_output = collect  # type: ignore[method-assign]
    runner.sample_tokens = counting_sample  # type: ignore[method-assign]
    try:
        Run(ec).run(_omni_waves(ec, _stage(), PROMPTS[:4]))
    finally:
        ec.shutdown()
    main = threading.get_ident()
    assert calls and set(calls) == {main}
    assert len(calls) == samples
    builder_threads = runner.materializer.builder_thread_ids  # type: ignore[union-attr]
    assert builder_threads and main not in builder_threads


def _tokens_with_build_fault(thinker_dir, mode: str, async_: bool, fail_at: int | None):
    """The run's tokens, with build number ``fail_at`` raising once; and the fault's thread."""
    ec = make_engine(thinker_dir, async_=async_, budget=32, stage=_stage(materialization=mode))
    builder = runner_of(ec).builder
    original = builder.build
    count = 0
    threads: list[int] = []

    def failing_build(plan, inputs):
        nonlocal count
        count += 1
        if count == fail_at:
            threads.append(threading.get_ident())
            raise RuntimeError("builder exploded")
        return original(plan, inputs)

    builder.build = failing_build  # type: ignore[method-assign]
    try:
        return Run(ec).run(_omni_waves(ec, _stage(), PROMPTS[:4])).tokens, threads
    finally:
        ec.shutdown()


@pytest.mark.parametrize("mode,async_", [("background", True), ("inline", False)])
def test_a_one_off_builder_fault_changes_nothing(thinker_dir, mode, async_) -> None:
    """A one-off payload-build fault fails nobody and changes no token. Inline, the build is
    part of the step, which is undone and run again (``worker.recovery``); in the background it
    ran on the builder thread after the step returned, and its error reaches the caller's
    thread when the engine collects the step (C-54), where the build is redone from its
    snapshot."""
    clean, _ = _tokens_with_build_fault(thinker_dir, mode, async_, None)
    faulted, threads = _tokens_with_build_fault(thinker_dir, mode, async_, 3)
    assert threads and faulted == clean
    assert (threads[0] == threading.get_ident()) == (mode == "inline")


# ---- sampling and prompt embeds ---------------------------------------------------------------


def test_seeded_sampling_is_batch_independent(thinker_dir) -> None:
    sp = dict(temperature=0.8, top_k=50, top_p=0.9, seed=1234)
    prompt = PROMPTS[0]
    ec = make_engine(thinker_dir, async_=True, budget=32)
    try:
        alone = Run(ec).run([[plain_request(ec, "x", prompt, **sp)]]).tokens["x"]
        crowd = [plain_request(ec, f"c{i}", p, temperature=1.0) for i, p in enumerate(PROMPTS)]
        crowd.insert(3, plain_request(ec, "x2", prompt, **sp))
        batched = Run(ec).run([crowd]).tokens
    finally:
        ec.shutdown()
    assert batched["x2"] == alone
    assert len(alone) == MAX_TOKENS


def test_prompt_embeds_match_token_ids(thinker_dir, hf_reference) -> None:
    model = load_model(thinker_dir)
    prompt = PROMPTS[1]
    with torch.no_grad():
        embeds = model.embed(torch.tensor(prompt)).clone()
    ec = make_engine(thinker_dir, async_=True, budget=16)
    try:
        req = Request(
            request_id="e",
            prompt_token_ids=None,
            prompt_embeds=embeds,
            sampling_params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
            pooling_params=None,
            arrival_time=0.0,
            block_hasher=engine_compat.block_hasher(ec),
        )
        tokens = Run(ec).run([[req]]).tokens["e"]
    finally:
        ec.shutdown()
    assert tokens == hf_reference(prompt)


# ---- vllm.LLM ---------------------------------------------------------------------------------


def test_vllm_llm_generates(thinker_dir, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    llm = LLM(
        model=thinker_dir,
        skip_tokenizer_init=True,
        worker_cls=WORKER,
        scheduler_cls="omni_runtime.sched.OmniARScheduler",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=4,
        dtype="float32",
    )
    try:
        prompt = PROMPTS[0]
        outs = llm.generate(
            [{"prompt_token_ids": prompt}],
            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, detokenize=False),
        )
        got = list(outs[0].outputs[0].token_ids)
    finally:
        llm.llm_engine.engine_core.shutdown()
    model = load_model(thinker_dir)
    assert got == model.greedy_generate(prompt, 8, stop_at_eos=False).tolist()
