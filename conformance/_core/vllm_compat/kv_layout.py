"""Hybrid KV-cache layouts: per-layer specs grouped by vLLM's own planner, as an engine does.

A layout (``HarnessConfig.kv_layout``) names the kind of each attention layer of a hybrid model:
full attention beside sliding-window layers (``hybrid-swa``), chunked local attention
(``hybrid-local``), a compressor's ring buffer of one block per request, never prefix-cached
(``hybrid-ring``), Mamba layers whose state is cached in "align" mode (``hybrid-mamba``), or a
DSA model's sparse MLA and indexer caches under HiSparse (``hisparse``). ``configure`` sets the
``VllmConfig`` as vLLM's config code sets it for such a model (Mamba cache mode and block size,
the padded Mamba page, HiSparse's connector, the hybrid KV-cache manager on); ``build`` makes the per-layer ``KVCacheSpec``s a model's layers
report and hands them to vLLM's grouping and sizing functions with the harness's block count,
then resolves the scheduler and hash block sizes as ``EngineCore`` does. Where the grouping entry
point moved between releases is a ``ByRelease`` entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conformance._core.vllm_compat.versions import ByRelease, Change

LAYOUTS: tuple[str, ...] = (
    "hybrid-swa",
    "hybrid-mamba",
    "hybrid-local",
    "hybrid-ring",
    "hisparse",
)
# Layer kinds per layout: the first is the model's full-attention layer. HiSparse's are per
# layer of the model (``_hisparse_specs``).
_KINDS: dict[str, tuple[str, ...]] = {
    "hybrid-swa": ("full", "sliding"),
    "hybrid-mamba": ("full", "mamba"),
    "hybrid-local": ("full", "local"),
    "hybrid-ring": ("full", "ring"),
    "hisparse": ("sparse", "indexer"),
}
# HiSparse's host pool, in blocks: two more than a request of the harness's context needs (the
# least vLLM accepts), so requests compete for host pages as for device ones.
_HISPARSE_HOST_SPARE_BLOCKS = 4
# Blocks of the sliding window: short enough that the harness's prompts outgrow it, so blocks
# fall out of the window while a request runs.
_WINDOW_BLOCKS = 2
# The Mamba layers' cache block, in harness blocks (``HarnessConfig.block_size``): with the
# prefix-match unit left at one harness block, hits may end inside a Mamba block (vLLM's
# fine-grained hash hits), and the request block hasher keeps the harness's block size.
_MAMBA_BLOCKS = 2

# vLLM groups layers and sizes groups in ``kv_cache_utils`` until 0.33, which moved grouping to
# ``kv_cache_planning`` (the whole model's groups) and sizing to a KV-cache config builder.
_PLANNER: ByRelease[str] = ByRelease(
    "KV-cache planner",
    "kv_cache_utils",
    [
        Change(
            "0.33.0",
            "kv_cache_planning",
            "grouping moved to kv_cache_planning, sizing to KVCacheConfigBuilder",
        )
    ],
)
# Whether ``EngineCore`` resolves the KV-cache memory layout before planning (the planner reads it).
_RESOLVES_LAYOUT: ByRelease[bool] = ByRelease(
    "KV-cache layout resolution",
    False,
    [Change("0.29.0", True, "resolve_kv_cache_layout: one memory layout for the whole model")],
)
# Whether ``KVCacheConfig`` carries the resolved hash block and hit alignment for connectors.
_ALIGNMENT_FIELDS: ByRelease[bool] = ByRelease(
    "KV-cache config alignment fields",
    False,
    [Change("0.32.0", True, "KVCacheConfig.hash_block_size and cache_hit_alignment_tokens")],
)


# ``CacheConfig`` options an axis sets that a release may lack; without one the release behaves
# as with it off (its default), so the option is left out there rather than the axis.
CACHE_OPTIONS_MISSING: ByRelease[frozenset[str]] = ByRelease(
    "cache options missing",
    frozenset({"enable_mamba_shared_prefix_checkpoint"}),
    [
        Change(
            "0.33.0",
            frozenset(),
            "enable_mamba_shared_prefix_checkpoint: a Mamba checkpoint at an EAGLE sibling's "
            "shared-prefix junction (present by 0.33)",
        )
    ],
)


@dataclass(frozen=True)
class BuiltLayout:
    """The scheduler's KV-cache config and the block sizes ``EngineCore`` resolves for it."""

    kv_cache_config: Any
    scheduler_block_size: int
    hash_block_size: int


def cache_block_size(layout: str, block_size: int) -> int:
    """The ``CacheConfig.block_size`` a layout runs with (``block_size``: the harness's)."""
    return block_size * _MAMBA_BLOCKS if layout == "hybrid-mamba" else block_size


def prefix_match_unit(layout: str, block_size: int) -> int | None:
    """``CacheConfig.prefix_match_unit``: one harness block for the Mamba layout."""
    return block_size if layout == "hybrid-mamba" else None


def _check(layout: str) -> tuple[str, ...]:
    try:
        return _KINDS[layout]
    except KeyError:
        raise ValueError(f"unknown KV layout {layout!r}; known {list(LAYOUTS)}") from None


def _attention_spec(cls: type, shape: dict[str, Any], block_size: int, **kw: Any) -> Any:
    import torch

    return cls(
        block_size=block_size,
        num_kv_heads=shape["num_key_value_heads"],
        head_size=shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"],
        dtype=torch.float32,
        **kw,
    )


def _mamba_state(shape: dict[str, Any]) -> tuple[tuple[tuple[int, ...], ...], tuple[Any, ...]]:
    """A Mamba2 layer's state for the model's width: a conv window and per-head SSM states."""
    import torch

    heads = shape["num_key_value_heads"]
    head_dim = shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    shapes = ((3, shape["hidden_size"]), (heads, head_dim, head_dim))
    return shapes, (torch.float32, torch.float32)


def configure(vllm_config: Any, layout: str, shape: dict[str, Any]) -> None:
    """Set ``vllm_config`` as vLLM's config code sets it for a model with this layout."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    kinds = _check(layout)
    # A GPU engine runs hybrid models with the hybrid KV-cache manager; the harness's CPU
    # platform would turn it off (and unify the layers' specs), so it stands in for a GPU here.
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    if layout == "hisparse":
        _configure_hisparse(vllm_config, shape)
        return
    if "mamba" not in kinds:
        return
    from vllm.model_executor.models.config import MambaModelConfig

    # Prefix caching on: "align" mode, the Mamba block equal to the cache block.
    MambaModelConfig.verify_and_update_config(vllm_config)
    cache = vllm_config.cache_config
    # What the platform's hybrid check does: pad the Mamba page to the attention page.
    shapes, dtypes = _mamba_state(shape)
    attn_page = _attention_spec(FullAttentionSpec, shape, cache.block_size).page_size_bytes
    mamba_page = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1).page_size_bytes
    assert attn_page >= mamba_page, (attn_page, mamba_page)
    if attn_page != mamba_page:
        cache.mamba_page_size_padded = attn_page


def _configure_hisparse(vllm_config: Any, shape: dict[str, Any]) -> None:
    """What ``VllmConfig`` sets on a CUDA machine for ``--kv-transfer-config`` naming
    ``HiSparseConnector``: the connector, with a host pool of ``_HISPARSE_HOST_SPARE_BLOCKS``
    blocks more than a request needs, and ``HiSparseConfig`` in the attention config. vLLM
    refuses HiSparse off CUDA when it validates the configuration; the pool it then pins is the
    worker's, which the harness does not run, so the harness sets the fields after validation,
    standing in for the GPU as for the hybrid KV-cache manager above."""
    from vllm.config import HiSparseConfig, KVTransferConfig  # type: ignore[attr-defined]

    cache = vllm_config.cache_config
    max_len = vllm_config.model_config.max_model_len
    host_blocks = -(-max_len // cache.block_size) + _HISPARSE_HOST_SPARE_BLOCKS
    source_page = shape["num_hidden_layers"] * _sparse_spec(shape, cache.block_size).page_size_bytes
    vllm_config.kv_transfer_config = KVTransferConfig(
        kv_connector="HiSparseConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"host_pool_gib": host_blocks * source_page / 2**30},
    )
    vllm_config.attention_config.hisparse_config = HiSparseConfig()


def _sparse_spec(shape: dict[str, Any], block_size: int) -> Any:
    """A DSA model's sparse MLA layer as it reports itself: latent and rope rows, the index
    group's leader, a top-k buffer of ``index_topk`` rows."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=shape["kv_lora_rank"] + shape["qk_rope_head_dim"],
        dtype=torch.bfloat16,
        cache_dtype_str="auto",
        topk_buffer_width=shape["index_topk"],
        is_index_group_leader=True,
    )


def _hisparse_specs(shape: dict[str, Any], block_size: int) -> dict[str, Any]:
    """Each layer of a DSA model: its sparse MLA cache and its indexer's key cache (one byte
    per element plus a scale per 128)."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

    index_dim = shape["index_head_dim"]
    specs: dict[str, Any] = {}
    for i in range(shape["num_hidden_layers"]):
        specs[f"model.layers.{i}.self_attn.attn"] = _sparse_spec(shape, block_size)
        specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
            block_size=block_size,
            num_kv_heads=1,
            head_size=index_dim + index_dim // 128 * 4,
            dtype=torch.uint8,
            cache_role=SparseCacheRole.INDEXER,
        )
    return specs


def layer_specs(vllm_config: Any, layout: str, shape: dict[str, Any]) -> dict[str, Any]:
    """The ``KVCacheSpec`` each layer reports (``get_kv_cache_spec``), by layer name."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    cache = vllm_config.cache_config
    if layout == "hisparse":
        return _hisparse_specs(shape, cache.block_size)
    specs: dict[str, Any] = {}
    for i, kind in enumerate(_check(layout)):
        if kind == "mamba":
            shapes, dtypes = _mamba_state(shape)
            specs[f"model.layers.{i}.mixer"] = MambaSpec(
                shapes=shapes,
                dtypes=dtypes,
                block_size=cache.mamba_block_size,
                page_size_padded=cache.mamba_page_size_padded,
                mamba_cache_mode=cache.mamba_cache_mode,
                # A state slot per draft token, as vLLM's Mamba layers report under speculative
                # decoding (0.30's KDA RecoverSSM and 0.33's ReplaySSM, which report none, are
                # not configured here).
                num_speculative_blocks=vllm_config.num_speculative_tokens,
            )
            continue
        name = f"model.layers.{i}.self_attn.attn"
        if kind == "sliding":
            window = _WINDOW_BLOCKS * cache.block_size
            specs[name] = _attention_spec(
                SlidingWindowSpec, shape, cache.block_size, sliding_window=window
            )
        elif kind == "local":
            # Chunked local attention (Llama 4's): a token attends only within its chunk, so
            # blocks of earlier chunks are freed as a request runs, and hits stop at a chunk.
            chunk = _WINDOW_BLOCKS * cache.block_size
            specs[name] = _attention_spec(
                ChunkedLocalAttentionSpec, shape, cache.block_size, attention_chunk_size=chunk
            )
        elif kind == "ring":
            from vllm.v1.kv_cache_interface import CircularBufferSpec

            # A compressing layer's ring (DeepSeek V4's): one block per request for its whole
            # life holding the keys still being compressed; no prefix caching, no hit lookup.
            specs[name] = _attention_spec(CircularBufferSpec, shape, cache.block_size)
        else:
            specs[name] = _attention_spec(FullAttentionSpec, shape, cache.block_size)
    return specs


def _register_specs(vllm_config: Any) -> None:
    """Register vLLM's built-in spec managers, as ``EngineCore`` does before planning (the
    registry HiSparse's group roles are looked up in; a release without it has none to fill)."""
    try:
        from vllm.v1.core.single_type_kv_cache_manager import (  # type: ignore[attr-defined]
            register_all_kvcache_specs,
        )
    except ImportError:
        return
    register_all_kvcache_specs(vllm_config)


def _plan(vllm_config: Any, specs: dict[str, Any], num_blocks: int) -> Any:
    """vLLM's ``KVCacheConfig`` for one worker holding every layer: its grouping, then its sizing
    for exactly ``num_blocks`` blocks. The start-up check that the cache holds a request of
    ``max_model_len`` is left out, as the harness's one-group cache (smaller still) leaves it."""
    if _PLANNER.value() == "kv_cache_planning":
        from vllm.v1.core import kv_cache_planning as planning  # type: ignore[attr-defined]
        from vllm.v1.core.kv_cache_config_builder import (  # type: ignore[import-not-found]
            get_kv_cache_config_builder,
        )

        groups = planning.get_global_kv_cache_groups(vllm_config, [specs])
        builder = get_kv_cache_config_builder(vllm_config)
        return builder.get_kv_cache_config_from_groups(vllm_config, groups, num_blocks)
    from vllm.v1.core import kv_cache_utils as utils

    groups = utils.get_kv_cache_groups(vllm_config, specs)  # type: ignore[attr-defined]
    # Sized from memory, with ``num_gpu_blocks_override`` (set by ``build``) taking precedence.
    memory = num_blocks * sum(spec.page_size_bytes for spec in specs.values())
    return utils.get_kv_cache_config_from_groups(  # type: ignore[attr-defined]
        vllm_config, groups, memory
    )


def build(vllm_config: Any, layout: str, shape: dict[str, Any], num_blocks: int) -> BuiltLayout:
    """Group ``layout``'s layers with vLLM's planner into a ``num_blocks``-block KV cache and
    resolve the block sizes, updating ``vllm_config`` as ``EngineCore`` does."""
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        resolve_kv_cache_block_sizes,
    )

    cache = vllm_config.cache_config
    _register_specs(vllm_config)
    specs = layer_specs(vllm_config, layout, shape)
    # The block count is the harness's, as a user's ``--num-gpu-blocks-override`` pins it.
    cache.num_gpu_blocks_override = num_blocks
    if _RESOLVES_LAYOUT.value():
        from vllm.v1.attention.backends.utils import (  # type: ignore[attr-defined]
            resolve_kv_cache_layout,
        )

        # The one layout the harness's token worker reports (``TokenWorker``), as for one rank;
        # a DSA model's indexer backend reports block-outermost only, which HiSparse needs.
        memory_layout = "BLHNC" if layout == "hisparse" else "LBNHC"
        resolve_kv_cache_layout(vllm_config, [[memory_layout]], list(specs.values()))
    kv_cache_config = generate_scheduler_kv_cache_config([_plan(vllm_config, specs, num_blocks)])
    cache.num_gpu_blocks = kv_cache_config.num_blocks
    # Every group of these layouts caches prefixes, so the smallest group block is the one
    # ``EngineCore`` takes (0.30 on leaves scratch groups out of that minimum).
    cache.block_size = min(g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups)
    scheduler_block, hash_block = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    if _ALIGNMENT_FIELDS.value():
        from vllm.v1.core.kv_cache_utils import (  # type: ignore[attr-defined]
            resolve_cache_hit_alignment_tokens,
        )

        kv_cache_config.hash_block_size = hash_block
        kv_cache_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
            kv_cache_config, vllm_config, scheduler_block, hash_block
        )
    return BuiltLayout(kv_cache_config, scheduler_block, hash_block)
