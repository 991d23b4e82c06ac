"""Harness configuration and the one place that builds vLLM schedulers from it.

A ``HarnessConfig`` pins everything that makes two scheduler runs comparable: block size and
budget, token budgets, prefix caching, sync or async scheduling, the model-runner flavour, the
hash function (sha256) and the model folder whose ``config.json`` shapes the KV cache. Subjects
receive a ``VllmConfig`` + ``KVCacheConfig`` built here, so upstream and subject start from
identical configuration objects (built twice, never shared: schedulers mutate nothing in them, but
a subject must not be able to affect the oracle through a shared object).

Importing this module pins the process-wide vLLM switches that change observable scheduler
behaviour (the V1 model-runner flavour, offline hub) before vLLM reads its environment; vLLM
caches ``envs`` once an ``EngineCore`` starts, so a later pin would be silently ignored.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler

TINY_MODEL = Path(__file__).parents[1] / "assets" / "tiny-llama"
BUNDLED_TINY = "conformance:assets/tiny-llama"
# A mixture-of-experts shape (the routed-experts axis), named in traces as the tiny model is.
MOE_MODEL = Path(__file__).parents[1] / "assets" / "tiny-moe"
BUNDLED_MOE = "conformance:assets/tiny-moe"
# A multimodal shape (the multimodal axes): LLaVA around the tiny model's text layers, with a
# 56-pixel vision tower of 14-pixel patches (16 tokens an image) and the tokenizer and processor
# files vLLM reads to size the encoder budget. No weights: the token source stands in for it.
MM_MODEL = Path(__file__).parents[1] / "assets" / "tiny-llava"
# A DeepSeek sparse-attention shape (the HiSparse axis): MLA layers each with a lightning
# indexer, ``index_topk`` set. No weights: only the layers' KV-cache specs are read.
DSA_MODEL = Path(__file__).parents[1] / "assets" / "tiny-dsa"
# Folder -> the name a saved trace gives it, so that traces replay on another machine.
BUNDLED_MODELS: dict[Path, str] = {
    TINY_MODEL: BUNDLED_TINY,
    MOE_MODEL: BUNDLED_MOE,
    MM_MODEL: "conformance:assets/tiny-llava",
    DSA_MODEL: "conformance:assets/tiny-dsa",
}

# V2 runner folds resumed requests into scheduled_new_reqs; both sides must agree on one flavour.
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass(frozen=True)
class HarnessConfig:
    block_size: int = 16
    num_blocks: int = 64
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    max_model_len: int = 256
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    async_scheduling: bool = False
    long_prefill_token_threshold: int = 0
    model: str = str(TINY_MODEL)
    seed: int = 0
    additional_config: dict[str, Any] = field(default_factory=dict)
    # Ids the token source samples at a fixed share of positions (``Feature.token_edges``).
    token_edges: tuple[int, ...] = ()
    # Draft tokens per step (speculative decoding): vLLM schedules what the token source drafted
    # (sync) or placeholders for the runner's own drafts (async), and the source verifies them
    # (``conformance._core.tokens``). 0: off.
    num_speculative_tokens: int = 0
    # The speculative method the configuration names: "ngram" (no draft model) or "eagle" (the
    # model's own folder as its draft head), which also reserves lookahead slots for the
    # drafter, keeps a prefill chunk from ending inside the drafter's read-ahead, and either
    # hashes each block with a token past it (0.33) or drops the last block of every hit.
    spec_method: str = "ngram"
    # Further ``SpeculativeConfig`` fields (``disable_lookahead_block_hashes``: an EAGLE head
    # drops the last block of each hit instead of hashing a token past each block).
    spec_options: dict[str, Any] = field(default_factory=dict)
    # The scheduler axes (``conformance._core.axes``). Left at their defaults they are not
    # written to a trace, so traces and recordings made before they existed read the same.
    # Statistics on: ``SchedulerStats``, request events and per-request spec-decode metrics
    # on the outputs, compared after normalisation (``vllm_compat.stats``).
    log_stats: bool = False
    # KV-cache events published, captured per step and compared (``vllm_compat.stats``).
    kv_events: bool = False
    # ``fcfs`` or ``priority`` (``AddRequest.priority``: lower is served first).
    scheduling_policy: str = "fcfs"
    # Pipeline-parallel size: the engine keeps this many steps in flight (its batch queue),
    # with the sync scheduler as with the async one.
    pipeline_parallel_size: int = 1
    # A KV connector (``conformance._core.kv_connectors``): its name in vLLM's connector factory
    # ("": none), role (kv_producer, kv_consumer, kv_both), what the scheduler does with a failed
    # load ("recompute" or "fail") and the connector's extra configuration.
    kv_connector: str = ""
    kv_role: str = "kv_both"
    kv_load_failure_policy: str = "fail"
    kv_connector_extra: dict[str, Any] = field(default_factory=dict)
    # Structured outputs: the grammar backend ("xgrammar"; "": off). On, the model gets the
    # harness's tokenizer (``conformance._core.grammars``) and requests may name a grammar
    # (``AddRequest.grammar``).
    structured_outputs: str = ""
    # An encoder-cache connector (``conformance._core.ec_connectors``): its name in vLLM's EC
    # connector factory ("": none), role (ec_producer, ec_consumer, ec_both) and extra
    # configuration (the example connector's storage folder is made per configuration).
    ec_connector: str = ""
    ec_role: str = "ec_producer"
    ec_connector_extra: dict[str, Any] = field(default_factory=dict)
    # Auxiliary outputs the runner returns and the scheduler routes to each request's output
    # (``vllm_compat.aux_outputs``): sampling masks (``new_sampling_mask``), and routed experts
    # (``routed_experts``, for a mixture-of-experts model such as ``MOE_MODEL``).
    return_sampling_mask: bool = False
    return_routed_experts: bool = False
    # A hybrid model's KV-cache layout (``vllm_compat.kv_layout``): "hybrid-swa" (full
    # attention beside sliding-window layers) or "hybrid-mamba" (beside Mamba layers cached in
    # "align" mode), grouped by vLLM's planner into several KV-cache groups ("": one group).
    kv_layout: str = ""
    # With a multimodal model (``MM_MODEL``): an image's placeholder tokens are scheduled in one
    # step or not at all (``SchedulerConfig.disable_chunked_mm_input``), instead of in chunks.
    disable_chunked_mm_input: bool = False
    # Further ``SchedulerConfig`` fields, for the limits and cadence axes (``max_num_active_seqs``,
    # ``long_prefill_token_threshold_adaptive``, ``prefill_schedule_interval``): releases differ
    # in which they have (``vllm_compat.features``).
    scheduler_options: dict[str, Any] = field(default_factory=dict)
    # Further ``CacheConfig`` fields, for the retention axes (``prefix_cache_retention_interval``:
    # how densely sliding-window and Mamba groups keep prefix-cache checkpoints), keyed per
    # release like ``scheduler_options``.
    cache_options: dict[str, Any] = field(default_factory=dict)
    # The scheduler built for vLLM's Model Runner V2 (as ``VLLM_USE_V2_MODEL_RUNNER=1`` builds
    # it): resumed requests sent as new ones with their whole token list, the images a worker
    # must install or drop (``encoder_input_updates``), drafts skipped in steps none can use.
    model_runner_v2: bool = False
    # ``ObservabilityConfig.enable_logging_iteration_details``: each step's output also counts
    # the encoder inputs it schedules (``scheduled_encoder_input_stats``), with ``log_stats``.
    iteration_details: bool = False
    # ``ModelConfig.runner``: "generate", or "pooling" (the model converted to an embedding
    # model, as vLLM converts a causal LM): every request then pools (``PoolingParams``), the
    # runner returns a pooled output once a prompt is computed, and nothing is sampled.
    runner: str = "generate"
    # LoRA: adapters a step may serve at once (``LoRAConfig.max_loras``; 0: LoRA off). Requests
    # then may name an adapter (``AddRequest.lora``).
    max_loras: int = 0
    # The engine is one rank of a data-parallel group (``data_parallel_size`` > 1, which the
    # harness does not start): its scheduler then also reports, per client, the ids each step
    # finished (``include_finished_set``), which the group's coordinator counts.
    data_parallel: bool = False

    def with_(self, **changes: Any) -> HarnessConfig:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name, default in _AXIS_DEFAULTS.items():
            if d[name] == default:
                del d[name]
        # Saved traces must replay on another machine: name bundled models relative to us.
        here = Path(self.model).resolve()
        for folder, name in BUNDLED_MODELS.items():
            if here == folder.resolve():
                d["model"] = name
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HarnessConfig:
        data = dict(data)
        for folder, name in BUNDLED_MODELS.items():
            if data.get("model") == name:
                data["model"] = str(folder)
        data["token_edges"] = tuple(data.get("token_edges", ()))  # a list in JSON
        return cls(**data)

    def model_shape(self) -> dict[str, Any]:
        """The model's ``config.json``; a multimodal model's text layers (``text_config``) are
        the shape that matters here (KV cache, vocabulary, end of sequence), read over it."""
        shape = _model_config(self.model)
        return {**shape, **shape.get("text_config", {})}

    @property
    def multimodal(self) -> bool:
        """Whether the model takes images (its requests may carry them: ``AddRequest.images``)."""
        return "vision_config" in _model_config(self.model)


@functools.cache
def _model_config(model: str) -> dict[str, Any]:
    """A model folder's ``config.json``, read once: the pause rule's precondition asks whether
    the model is multimodal before every step hypothesis draws."""
    return json.loads((Path(model) / "config.json").read_text())  # type: ignore[no-any-return]


# The axis fields and their defaults: omitted from ``to_dict`` at the default.
_AXIS_DEFAULTS: dict[str, Any] = {
    "log_stats": False,
    "kv_events": False,
    "scheduling_policy": "fcfs",
    "pipeline_parallel_size": 1,
    "kv_connector": "",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "fail",
    "kv_connector_extra": {},
    "structured_outputs": "",
    "ec_connector": "",
    "ec_role": "ec_producer",
    "ec_connector_extra": {},
    "return_sampling_mask": False,
    "return_routed_experts": False,
    "kv_layout": "",
    "disable_chunked_mm_input": False,
    "scheduler_options": {},
    "cache_options": {},
    "max_loras": 0,
    "spec_method": "ngram",
    "spec_options": {},
    "model_runner_v2": False,
    "iteration_details": False,
    "runner": "generate",
    "data_parallel": False,
}

_HASH_READY = False


def block_hasher(block_size: int, lookahead_tokens: int = 0):
    """vLLM's sha256 request block hasher (each block's hash also covering ``lookahead_tokens``
    tokens past it, as ``EngineCore``'s does for an EAGLE head: ``request_block_hasher``);
    ``init_none_hash`` runs once per process."""
    global _HASH_READY
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    if not _HASH_READY:
        init_none_hash(sha256)
        _HASH_READY = True
    if not lookahead_tokens:  # releases before lookahead hashes take two arguments
        return get_request_block_hasher(block_size, sha256)
    return get_request_block_hasher(block_size, sha256, lookahead_tokens)


def request_block_hasher(cfg: HarnessConfig):
    """The block hasher ``EngineCore`` gives each request under ``cfg``: at the scheduler's
    hash block size (a hybrid layout resolves its own) and covering 0.33's
    ``num_hash_lookahead_tokens`` past each block (an EAGLE head's read-ahead)."""
    if not cfg.kv_layout and (cfg.spec_method == "ngram" or not cfg.num_speculative_tokens):
        return block_hasher(cfg.block_size)
    return block_hasher(*_hashing(json.dumps(cfg.to_dict(), sort_keys=True)))


@functools.cache
def _hashing(cfg_json: str) -> tuple[int, int]:
    """(hash block size, lookahead tokens) of a configuration, resolved once per process."""
    cfg = HarnessConfig.from_dict(json.loads(cfg_json))
    vllm_config = build_vllm_config(cfg)
    lookahead = int(getattr(vllm_config, "num_hash_lookahead_tokens", 0))
    if not cfg.kv_layout:
        return cfg.block_size, lookahead
    return build_hybrid_kv_cache(cfg, vllm_config).hash_block_size, lookahead


def build_vllm_config(
    cfg: HarnessConfig,
    *,
    scheduler_cls: type | str | None = None,
    worker_cls: str | None = None,
    num_gpu_blocks_override: int | None = None,
):
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    from conformance._core.ec_connectors import ec_transfer_kw, encoder_only_kw
    from conformance._core.kv_connectors import kv_transfer_kw
    from conformance._core.vllm_compat import aux_outputs

    v2 = cfg.model_runner_v2 or aux_outputs.needs_v2_runner(
        cfg.return_sampling_mask, cfg.return_routed_experts
    )
    if v2 and not aux_outputs.v2_runner_on():
        # vLLM validates these outputs against the runner flavour (``runner_flavour``).
        with aux_outputs.runner_flavour(True):
            return build_vllm_config(
                cfg,
                scheduler_cls=scheduler_cls,
                worker_cls=worker_cls,
                num_gpu_blocks_override=num_gpu_blocks_override,
            )
    sched_kw: dict[str, Any] = {} if scheduler_cls is None else {"scheduler_cls": scheduler_cls}
    parallel_kw: dict[str, Any] = {} if worker_cls is None else {"worker_cls": worker_cls}
    runner_kw: dict[str, Any] = {} if cfg.runner == "generate" else {"runner": cfg.runner}
    model_config = ModelConfig(
        model=cfg.model,
        **tokenizer_kw(cfg),
        max_model_len=cfg.max_model_len,
        dtype="float32",
        seed=cfg.seed,
        **aux_outputs.model_config_kw(cfg.return_sampling_mask, cfg.return_routed_experts),
        **encoder_only_kw(cfg),
        **runner_kw,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.max_model_len,
        enable_chunked_prefill=cfg.enable_chunked_prefill,
        long_prefill_token_threshold=cfg.long_prefill_token_threshold,
        async_scheduling=cfg.async_scheduling,
        is_encoder_decoder=False,
        disable_chunked_mm_input=cfg.disable_chunked_mm_input,
        policy=cfg.scheduling_policy,  # type: ignore[arg-type]  # checked by SchedulerConfig
        **sched_kw,
        **cfg.scheduler_options,
    )
    cache_config = CacheConfig(
        **{
            **kv_layout_cache_kw(cfg),
            "enable_prefix_caching": cfg.enable_prefix_caching,
            "prefix_caching_hash_algo": "sha256",
            "num_gpu_blocks_override": num_gpu_blocks_override,
            # An axis's own cache options over the layout's (a coarser prefix-match unit).
            **cache_options(cfg),
        }
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        parallel_config=ParallelConfig(
            distributed_executor_backend="uni",
            pipeline_parallel_size=cfg.pipeline_parallel_size,
            **parallel_kw,
        ),
        device_config=DeviceConfig(device="cpu"),
        additional_config=dict(cfg.additional_config),
        **observability_kw(cfg),
        **kv_transfer_kw(cfg),
        **ec_transfer_kw(cfg),
        **structured_outputs_kw(cfg),
        **aux_outputs.vllm_config_kw(cfg.return_routed_experts),
        **lora_kw(cfg),
    )
    vllm_config.cache_config.num_gpu_blocks = cfg.num_blocks
    if cfg.iteration_details:
        vllm_config.observability_config.enable_logging_iteration_details = True
    if cfg.kv_layout:
        from conformance._core.vllm_compat import kv_layout

        kv_layout.configure(vllm_config, cfg.kv_layout, cfg.model_shape())
    if cfg.num_speculative_tokens:
        from vllm.config import SpeculativeConfig

        # n-gram: a method that needs no draft model. The harness's token source drafts in its
        # place; the scheduler only reads how many drafts a step may carry.
        method_kw: dict[str, Any] = (
            {
                "method": "ngram",
                "prompt_lookup_min": 1,
                "prompt_lookup_max": cfg.num_speculative_tokens,
            }
            if cfg.spec_method == "ngram"
            # The harness's token source drafts in the head's place too; vLLM reads only the
            # head's configuration, never its weights, on the scheduler's side.
            else {"method": cfg.spec_method, "model": cfg.model}
        )
        spec_options = dict(cfg.spec_options)
        if not aux_outputs.LOOKAHEAD_HASHES.value():
            # The drop it selects is all a release without lookahead hashes does.
            spec_options.pop("disable_lookahead_block_hashes", None)
        vllm_config.speculative_config = SpeculativeConfig(
            num_speculative_tokens=cfg.num_speculative_tokens,
            target_model_config=model_config,
            target_parallel_config=vllm_config.parallel_config,
            **method_kw,
            **spec_options,
        )
        if cfg.log_stats and spec_metrics_field():
            # Per-request spec-decode metrics ride on the outputs only when asked for (and
            # only with drafts); "detailed" adds the per-step arrays, the most to get wrong.
            vllm_config.observability_config.per_request_spec_decode_metrics = "detailed"
    return vllm_config


def kv_layout_cache_kw(cfg: HarnessConfig) -> dict[str, Any]:
    """``CacheConfig``'s block arguments: a hybrid layout may set its own cache block and
    prefix-match unit (``vllm_compat.kv_layout``), as a user's flags would."""
    if not cfg.kv_layout:
        return {"block_size": cfg.block_size}
    from conformance._core.vllm_compat import kv_layout

    return {
        "block_size": kv_layout.cache_block_size(cfg.kv_layout, cfg.block_size),
        "prefix_match_unit": kv_layout.prefix_match_unit(cfg.kv_layout, cfg.block_size),
    }


def cache_options(cfg: HarnessConfig) -> dict[str, Any]:
    """``cfg.cache_options`` less those the installed release lacks and has off
    (``vllm_compat.kv_layout.CACHE_OPTIONS_MISSING``)."""
    if not cfg.cache_options:
        return {}
    from conformance._core.vllm_compat import kv_layout

    missing = kv_layout.CACHE_OPTIONS_MISSING.value()
    return {k: v for k, v in cfg.cache_options.items() if k not in missing}


def spec_metrics_field() -> bool:
    """Whether this vLLM has per-request spec-decode metrics (0.32 has them)."""
    from vllm.config import ObservabilityConfig

    return "per_request_spec_decode_metrics" in ObservabilityConfig.__dataclass_fields__


def lora_kw(cfg: HarnessConfig) -> dict[str, Any]:
    """``VllmConfig``'s LoRA arguments (none when LoRA is off)."""
    if not cfg.max_loras:
        return {}
    from vllm.config import LoRAConfig

    return {"lora_config": LoRAConfig(max_loras=cfg.max_loras, max_lora_rank=8)}


def observability_kw(cfg: HarnessConfig) -> dict[str, Any]:
    """``VllmConfig`` arguments for the statistics and KV-event axes (none when both are off)."""
    kw: dict[str, Any] = {}
    if cfg.kv_events:
        from vllm.config import KVEventsConfig

        # "null": the scheduler builds no socket; the harness captures what it publishes
        # (``vllm_compat.stats.capture_kv_events``).
        kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    return kw


def tokenizer_kw(cfg: HarnessConfig) -> dict[str, Any]:
    """``ModelConfig``'s tokenizer arguments: none loaded, unless grammars need one or the model
    is multimodal (vLLM's multimodal processor, which sizes the encoder budget, needs the
    model's own: it finds the image token in it)."""
    if cfg.multimodal:
        return {"skip_tokenizer_init": False, "tokenizer": cfg.model}
    if not cfg.structured_outputs:
        return {"skip_tokenizer_init": True}
    from conformance._core.grammars import tokenizer_folder

    return {"skip_tokenizer_init": False, "tokenizer": str(tokenizer_folder(cfg))}


def structured_outputs_kw(cfg: HarnessConfig) -> dict[str, Any]:
    """``VllmConfig``'s structured-outputs arguments (none when the axis is off)."""
    if not cfg.structured_outputs:
        return {}
    from vllm.config import StructuredOutputsConfig

    backend: Any = cfg.structured_outputs  # checked by StructuredOutputsConfig
    return {"structured_outputs_config": StructuredOutputsConfig(backend=backend)}


def build_kv_cache_config(cfg: HarnessConfig, vllm_config: Any = None):
    """The scheduler's ``KVCacheConfig``: one full-attention group, or a hybrid layout's groups
    as vLLM's planner makes them (updating ``vllm_config``, built here when not given)."""
    if cfg.kv_layout:
        return build_hybrid_kv_cache(cfg, vllm_config).kv_cache_config
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    shape = cfg.model_shape()
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(shape["num_hidden_layers"])]
    spec = FullAttentionSpec(
        block_size=cfg.block_size,
        num_kv_heads=shape["num_key_value_heads"],
        head_size=shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"],
        dtype=torch.float32,
    )
    return KVCacheConfig(
        num_blocks=cfg.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )


def build_hybrid_kv_cache(cfg: HarnessConfig, vllm_config: Any = None) -> Any:
    """``cfg.kv_layout``'s KV cache and block sizes (``vllm_compat.kv_layout.BuiltLayout``)."""
    from conformance._core.vllm_compat import kv_layout

    if vllm_config is None:
        vllm_config = build_vllm_config(cfg)
    return kv_layout.build(vllm_config, cfg.kv_layout, cfg.model_shape(), cfg.num_blocks)


def build_scheduler(
    scheduler_cls: type,
    cfg: HarnessConfig,
    *,
    log_stats: bool = False,
    adapt: Callable[[Any], None] | None = None,
) -> Scheduler:
    """A scheduler of ``scheduler_cls`` built exactly as ``EngineCore`` builds one. ``adapt``
    changes the ``VllmConfig`` first, for a runtime whose engine configures vLLM its own way
    (its model config, say): everything else (statistics, captured KV events, grammars
    compiled on the harness's clock) is then built as for the oracle."""
    from vllm.v1.structured_output import StructuredOutputManager

    from conformance._core.vllm_compat import (
        aux_outputs,
        capture_kv_events,
        hold_grammar_compilation,
    )

    v2 = cfg.model_runner_v2 or aux_outputs.needs_v2_runner(
        cfg.return_sampling_mask, cfg.return_routed_experts
    )
    if v2 and not aux_outputs.v2_runner_on():
        # The scheduler reads the runner flavour when built, as its configuration was.
        with aux_outputs.runner_flavour(True):
            return build_scheduler(scheduler_cls, cfg, log_stats=log_stats, adapt=adapt)
    vllm_config = build_vllm_config(cfg)
    if adapt is not None:
        adapt(vllm_config)
    blocks: dict[str, Any] = {"block_size": cfg.block_size}
    if cfg.kv_layout:
        # The scheduler and hash block sizes ``EngineCore`` resolves for the layout's groups.
        built = build_hybrid_kv_cache(cfg, vllm_config)
        kv_cache_config = built.kv_cache_config
        blocks = {
            "block_size": built.scheduler_block_size,
            "hash_block_size": built.hash_block_size,
        }
    else:
        kv_cache_config = build_kv_cache_config(cfg)
    scheduler = scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        **blocks,
        log_stats=log_stats or cfg.log_stats,
        # Given only when set, as the engine does for a data-parallel rank: a subclass whose
        # constructor names its arguments need not know it otherwise.
        **({"include_finished_set": True} if cfg.data_parallel else {}),
    )
    if cfg.kv_events:
        capture_kv_events(scheduler)
    if cfg.structured_outputs:
        # Grammars compile when the harness says, the same on both sides (``CompileClock``).
        hold_grammar_compilation(scheduler)
    return scheduler
