"""The runtime's ``VllmConfig``: the one function that assembles it, and the stage switches.

``runtime_vllm_config`` is the only place the runtime (and its tests and benchmarks) builds a
``VllmConfig``: CPU device, vLLM's uni executor with ``OmniARWorker``, chunked prefill, float32
weights, and the omni stage (if any) in ``additional_config`` (see ``omni_runtime.config``).
A config with a stage runs the omni scheduler (``OmniARScheduler``, or ``OmniARAsyncScheduler``
under async scheduling); one without a stage is a plain vLLM engine (upstream's scheduler)
that still executes on our worker.

The conformance harness builds its own config for both sides of a comparison and does not use
this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)

from omni_runtime.config import Materialization, OmniStageConfig, stage_additional_config
from omni_runtime.engine.graph import BUILTIN_MODELS, ARStageSpec
from omni_runtime.models import model_dir
from omni_runtime.sched import OmniARAsyncScheduler, OmniARScheduler

__all__ = [
    "ASYNC_SCHEDULER",
    "BACKENDS",
    "BUILTIN_MODELS",
    "Backend",
    "EngineOptions",
    "SYNC_SCHEDULER",
    "WORKER_CLS",
    "resolve_model",
    "runtime_vllm_config",
    "stage_vllm_config",
]

WORKER_CLS = "omni_runtime.worker.OmniARWorker"
SYNC_SCHEDULER = f"{OmniARScheduler.__module__}.{OmniARScheduler.__qualname__}"
ASYNC_SCHEDULER = f"{OmniARAsyncScheduler.__module__}.{OmniARAsyncScheduler.__qualname__}"


# Where each AR stage's EngineCore runs: in the orchestrator's process (``StageEngine``), in
# its own process through vLLM's multiprocess client (``MPStageEngine``), or in a Ray actor
# (``RayStageEngine``); see ``omni_runtime.engine.backends``.
Backend = Literal["inprocess", "multiprocess", "ray"]
BACKENDS: tuple[Backend, ...] = ("inprocess", "multiprocess", "ray")


@dataclass(frozen=True)
class EngineOptions:
    """Run-time switches that must not change any output (C-22, C-52)."""

    async_scheduling: bool = True
    materialization: Materialization = "inline"
    prefix_caching: bool = True
    seed: int = 0
    backend: Backend = "inprocess"
    # ``backend="ray"`` only: the cluster to join ("host:port", or "auto"); None starts a local
    # Ray instance (or uses the one this process already initialised).
    ray_address: str | None = None


def resolve_model(model: str) -> str:
    """A built-in model name ("thinker", "talker", "code2wav") or a folder path."""
    if model in BUILTIN_MODELS:
        return str(model_dir(model))
    return model


def runtime_vllm_config(
    model: str,
    *,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    block_size: int = 16,
    num_blocks: int | None = None,
    prefix_caching: bool = True,
    async_scheduling: bool = False,
    seed: int = 0,
    stage: OmniStageConfig | None = None,
) -> VllmConfig:
    """The ``VllmConfig`` of one runtime engine.

    ``model`` is a built-in model name or a folder; ``num_blocks`` overrides the KV block count
    (None: vLLM sizes the pool); ``stage`` None builds a plain vLLM engine on our worker.
    """
    scheduler_cls: str | None = None
    if stage is not None:
        scheduler_cls = ASYNC_SCHEDULER if async_scheduling else SYNC_SCHEDULER
    return VllmConfig(
        model_config=ModelConfig(
            model=resolve_model(model),
            skip_tokenizer_init=True,
            max_model_len=max_model_len,
            dtype="float32",
            seed=seed,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=True,
            async_scheduling=async_scheduling,
            is_encoder_decoder=False,
            scheduler_cls=scheduler_cls,
        ),
        cache_config=CacheConfig(
            block_size=block_size,
            enable_prefix_caching=prefix_caching,
            prefix_caching_hash_algo="sha256",
            num_gpu_blocks_override=num_blocks,
        ),
        parallel_config=ParallelConfig(distributed_executor_backend="uni", worker_cls=WORKER_CLS),
        device_config=DeviceConfig(device="cpu"),
        additional_config=stage_additional_config(stage) if stage is not None else {},
    )


def stage_vllm_config(
    spec: ARStageSpec, stages: tuple[str, ...], options: EngineOptions
) -> VllmConfig:
    """The ``VllmConfig`` of the AR stage ``spec`` in the pipeline ``stages``."""
    stage = OmniStageConfig(
        stage_id=spec.id,
        stages=stages,
        downstream=spec.downstream,
        chunk_processor=spec.chunk_processor,
        omni_pooler_payload_include_hidden=spec.include_hidden,
        materialization=options.materialization,
        downstream_needs_full_prefix=spec.downstream_needs_full_prefix,
        prompt_embeds_dim=spec.prompt_embeds_dim,
    )
    return runtime_vllm_config(
        spec.model,
        max_model_len=spec.max_model_len,
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        block_size=spec.block_size,
        num_blocks=spec.num_blocks,
        prefix_caching=options.prefix_caching,
        async_scheduling=options.async_scheduling,
        seed=options.seed,
        stage=stage,
    )
