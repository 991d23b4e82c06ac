"""The one place where the worker touches vLLM fields that are private or move between releases.

Everything the worker and runner read from ``SchedulerOutput`` beyond its stable core (request
ids, scheduled token counts, new-request data), every vLLM class whose constructor changes
shape across releases (KV cache specs, compilation times) and every private vLLM name lives
here, so that a vLLM upgrade is reviewed in this file alone. Other worker modules import only
public vLLM types (``ModelRunnerOutput``, ``SchedulerOutput``, ``SamplingParams`` ...).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import AsyncModelRunnerOutput, KVConnectorOutput, ModelRunnerOutput

__all__ = [
    "AsyncModelRunnerOutput",
    "CachedRequestUpdate",
    "KVConnectorOutput",
    "KV_CACHE_LAYOUTS",
    "block_copies",
    "blocks_to_zero",
    "cached_request_updates",
    "compilation_times",
    "full_attention_spec",
    "kv_cache_geometry",
    "new_request_prefill_ids",
    "new_request_prompt_is_token_ids",
    "preempted_request_ids",
    "stop_token_ids",
]

# Our K/V tensors are [num_blocks, block_size, num_kv_heads, head_dim] per layer, layers in
# separate tensors: vLLM 0.33 calls that logical order LBNHC (the legacy "NHD").
KV_CACHE_LAYOUTS: list[str] = ["LBNHC"]


@dataclass(frozen=True)
class CachedRequestUpdate:
    """One entry of ``SchedulerOutput.scheduled_cached_reqs``, read field by field.

    ``new_block_ids`` is None when the request got no new blocks; ``resumed`` means the ids
    replace the request's block table instead of extending it. ``all_token_ids`` is only set
    (V1 model-runner flavour) for requests that were not scheduled in the previous step: it is
    the scheduler's full token list and overrides whatever the worker kept.
    ``num_output_tokens`` counts outputs plus in-flight placeholders as the scheduler sees them.
    """

    req_id: str
    num_computed_tokens: int
    new_block_ids: tuple[list[int], ...] | None
    resumed: bool
    num_output_tokens: int
    all_token_ids: list[int] | None


def cached_request_updates(scheduler_output: Any) -> Iterator[CachedRequestUpdate]:
    data = scheduler_output.scheduled_cached_reqs
    resumed: set[str] = set(getattr(data, "resumed_req_ids", ()) or ())
    all_ids: dict[str, list[int]] = getattr(data, "all_token_ids", None) or {}
    num_out: Sequence[int] = getattr(data, "num_output_tokens", None) or ()
    for i, req_id in enumerate(data.req_ids):
        yield CachedRequestUpdate(
            req_id=req_id,
            num_computed_tokens=data.num_computed_tokens[i],
            new_block_ids=data.new_block_ids[i],
            resumed=req_id in resumed,
            num_output_tokens=num_out[i] if i < len(num_out) else -1,
            all_token_ids=all_ids.get(req_id),
        )


def new_request_prefill_ids(new_req: Any) -> list[int] | None:
    """V2-runner flavour: the full token list (prompt + outputs) of a (re)scheduled request."""
    return getattr(new_req, "prefill_token_ids", None)


def new_request_prompt_is_token_ids(new_req: Any) -> list[bool] | None:
    return getattr(new_req, "prompt_is_token_ids", None)


def preempted_request_ids(scheduler_output: Any) -> set[str]:
    return set(getattr(scheduler_output, "preempted_req_ids", None) or ())


def blocks_to_zero(scheduler_output: Any) -> list[int]:
    return list(getattr(scheduler_output, "new_block_ids_to_zero", None) or ())


def block_copies(scheduler_output: Any) -> list[tuple[int, int]]:
    copies = getattr(scheduler_output, "kv_cache_block_copies", None) or ()
    return [(int(c[0]), int(c[1])) for c in copies]


def full_attention_spec(
    block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
) -> KVCacheSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype
    )


@dataclass(frozen=True)
class KVGeometry:
    num_blocks: int
    block_size: int
    layer_names: tuple[str, ...]


def kv_cache_geometry(kv_cache_config: KVCacheConfig) -> KVGeometry:
    """Blocks, block size and layer names of a single full-attention group."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(
            f"OmniARModelRunner supports exactly one KV cache group, got {len(groups)}"
        )
    spec = groups[0].kv_cache_spec
    return KVGeometry(
        num_blocks=int(kv_cache_config.num_blocks),
        block_size=int(spec.block_size),
        layer_names=tuple(groups[0].layer_names),
    )


def stop_token_ids(sampling_params: Any) -> set[int]:
    """EOS plus stop ids: the ids ``min_tokens`` must keep the sampler from emitting."""
    ids = set(getattr(sampling_params, "all_stop_token_ids", ()) or ())
    eos = getattr(sampling_params, "eos_token_id", None)
    if eos is not None and not getattr(sampling_params, "ignore_eos", False):
        ids.add(int(eos))
    return ids


def compilation_times() -> Any:
    """``CompilationTimes(0, 0)``: the runner executes eagerly and compiles nothing."""
    from vllm.v1.worker.worker_base import CompilationTimes

    return CompilationTimes(language_model=0.0, encoder=0.0)


def empty_model_runner_output() -> ModelRunnerOutput:
    # A fresh object rather than vLLM's shared EMPTY_MODEL_RUNNER_OUTPUT, which callers may mutate.
    return ModelRunnerOutput(req_ids=[], req_id_to_index={})
