"""The scheduler axes: parts of vLLM's scheduler the plain-decode workload never reaches.

An ``Axis`` is a change to the suite's configuration (statistics, KV events, speculative
decoding, the priority policy, a deeper batch queue) and the per-request fields its workloads
draw (``request_values``: field of ``AddRequest`` -> values, first the default). The lock-step
machine draws those fields for each request only on an axis that has them, so the plain
machine's examples are unchanged; ``record``'s corpus runs every axis too. ``AXES`` is the
catalogue the invariant suite parametrizes over; ``unavailable`` says why an axis cannot run on
the installed release (the report then says not applicable).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from conformance._core import ec_connectors, kv_connectors
from conformance._core.config import DSA_MODEL, MM_MODEL, MOE_MODEL, HarnessConfig
from conformance._core.grammars import GRAMMAR_VALUES
from conformance._core.multimodal import IMAGE_DRAWS

# Per-request draws of the KV-cache manager's request options (``AddRequest``): a client that
# wants every reused block re-published as an event ("full"), and one that skips reading the
# prefix cache (local and connector hits), as a prompt-logprobs request does. Default first.
REPORT_MODES: tuple[str | None, ...] = (None, "full")
SKIP_READING: tuple[bool, ...] = (False, False, True)


# Snapshot sections whose difference an axis run reports after the run instead of at once: the
# first is kept (and saved shrunk, with its own trace), the section is then left out, and the
# rest of the snapshot is still compared. Scheduler statistics: a subject that reports them
# differently (less often, say) would otherwise end every session at its first report, and
# nothing the axis drives after it would be checked.
DEFERRED_SECTIONS: tuple[str, ...] = ("stats",)


@dataclass(frozen=True)
class Axis:
    name: str
    summary: str
    # ``HarnessConfig`` fields the axis sets on top of the suite's configuration.
    changes: Mapping[str, Any]
    # Per-request draws: an ``AddRequest`` field and the values it may take (default first).
    request_values: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    # The scheduling modes the axis runs in (``sync``, ``async``).
    modes: tuple[str, ...] = ("sync", "async")
    # The engine also pauses and resumes the scheduler (``conformance._core.machine.Pauses``).
    pauses: bool = False

    @property
    def streams_input(self) -> bool:
        """Whether the axis's requests may be streaming sessions, whose client then also
        streams them input (``conformance._core.machine.StreamsInput``)."""
        return "resumable" in self.request_values

    def config(self, base: HarnessConfig) -> HarnessConfig:
        return base.with_(**self.changes)

    def unavailable(self, mode: str | None = None) -> str | None:
        """Why the installed vLLM cannot run this axis (None: it can), or the axis in ``mode``
        (``sync``, ``async``) when given."""
        from conformance._core.vllm_compat import axis_unavailable

        why = axis_unavailable(self.name)
        if why is None and self.changes.get("model_runner_v2"):
            from conformance._core.vllm_compat.aux_outputs import v2_scheduler_unavailable

            why = v2_scheduler_unavailable()
        if why is None and mode is not None:
            why = axis_unavailable(f"{self.name}:{mode}")
        return why


# The Mamba layout with the harness connector as a P/D producer restoring Mamba state, with KV
# events and statistics: what the hybrid-mamba connector axes share.
MAMBA_PRODUCER: dict[str, Any] = {
    "kv_layout": "hybrid-mamba",
    "kv_connector": kv_connectors.HARNESS_HYBRID,
    "kv_role": "kv_producer",
    "kv_connector_extra": {"divergent_hybrid_hits": True},
    "kv_events": True,
    "log_stats": True,
}

AXES: tuple[Axis, ...] = (
    Axis(
        "stats-events",
        "log_stats on (SchedulerStats, request events) and KV-cache events published; "
        "requests that re-publish the blocks their hits reuse, or skip reading the prefix cache",
        {"log_stats": True, "kv_events": True},
        request_values={
            "kv_cache_report_mode": REPORT_MODES,
            "skip_reading_prefix_cache": SKIP_READING,
        },
    ),
    Axis(
        "spec-decode",
        "three drafts a step from the token source (sync) or placeholders (async), with "
        "spec-decoding statistics and per-request metrics",
        {"num_speculative_tokens": 3, "log_stats": True},
    ),
    Axis(
        "priority",
        "the priority policy: drawn priorities and client arrival times (ties, a lagging "
        "clock), preemption picks the lowest-priority victim",
        {"scheduling_policy": "priority", "log_stats": True},
        request_values={"priority": (0, -1, 1, 2), "arrival": (None, 0.0, 0.5)},
    ),
    Axis(
        "spec-decode-dynamic",
        "dynamic speculative decoding: the batch-size schedule sets each step's draft count "
        "(3 drafts alone, 2 beside one other request, none with three, 1 beyond), which the "
        "runner proposes after the step",
        {
            "num_speculative_tokens": 3,
            "log_stats": True,
            "spec_options": {
                "num_speculative_tokens_per_batch_size": [
                    [1, 1, 3],
                    [2, 2, 2],
                    [3, 3, 0],
                    [4, 4096, 1],
                ]
            },
        },
    ),
    Axis(
        "prompt-embeds",
        "prompts sent as embeddings (prompt_embeds, no token ids) beside token prompts: "
        "their length read from the rows, their blocks hashed by the rows' bytes, so equal "
        "embeddings share prefix-cache blocks and token prompts never hit them",
        {"log_stats": True},
        request_values={"embeds": (False, True)},
    ),
    Axis(
        "data-parallel-rank",
        "the engine as one rank of a data-parallel group: each step's outputs also carry, per "
        "client, the ids it finished (stopped, length-capped or aborted), a client with no "
        "other output that step included; the group's coordinator counts them to end a wave",
        {"data_parallel": True},
    ),
    Axis(
        "spec-decode-eagle",
        "spec-decode with an EAGLE head, the scheduler built for Model Runner V2: lookahead "
        "slots reserved for the drafter, no prefill chunk ending inside its read-ahead, block "
        "hashes that cover a token past the block, drafting skipped in steps none can use",
        {
            "num_speculative_tokens": 2,
            "spec_method": "eagle",
            "model_runner_v2": True,
            "log_stats": True,
        },
    ),
    Axis(
        "pipeline-2",
        "pipeline parallel size 2: two steps in flight, sync scheduler as async",
        {"pipeline_parallel_size": 2, "log_stats": True},
        modes=("sync",),
    ),
    Axis(
        "pipeline-4",
        "pipeline parallel size 4: four steps in flight, with spec decoding",
        {"pipeline_parallel_size": 4, "num_speculative_tokens": 2},
        modes=("sync",),
    ),
    # KV connectors (``conformance._core.kv_connectors``), statistics on for their counters.
    *(
        Axis(
            f"kv-example-{role}",
            f"vLLM's example connector as {role}: connector metadata every step, never a hit"
            + {
                "producer": "; a preemption drops a pending hand-off's stale output",
                "consumer": "; async scheduling defers block frees past in-flight steps",
                "both": "; both of the above",
            }[role],
            {"kv_connector": "ExampleConnector", "kv_role": f"kv_{role}", "log_stats": True},
        )
        for role in ("producer", "consumer", "both")
    ),
    Axis(
        "kv-offload",
        "vLLM's CPU offloading connector with a 16-block CPU tier: stores, and loads after "
        "evictions and prefix-cache resets",
        {
            "kv_connector": "OffloadingConnector",
            "kv_connector_extra": {"cpu_bytes_to_use": 16 * 8192},
            "log_stats": True,
        },
    ),
    *(
        Axis(
            f"kv-harness-{policy}",
            "the harness connector: external hits loaded sync and async (waiting for remote "
            f"KV), load failures under policy {policy!r}, delayed frees, kv_transfer_params",
            {
                "kv_connector": kv_connectors.HARNESS,
                "kv_load_failure_policy": policy,
                "log_stats": True,
            },
            request_values={"kv_transfer_params": kv_connectors.HARNESS_PLANS},
        )
        for policy in ("recompute", "fail")
    ),
    # Hybrid KV-cache layouts (``vllm_compat.kv_layout``): several KV-cache groups, grouped by
    # vLLM's planner, with KV events (each stored block names its group) and statistics.
    Axis(
        "hybrid-swa",
        "full attention beside a sliding-window group: blocks out of the window freed as "
        "requests run, hits the window group must also cover, events of two groups",
        {"kv_layout": "hybrid-swa", "kv_events": True, "log_stats": True},
    ),
    Axis(
        "hybrid-local",
        "full attention beside chunked local attention (32-token chunks): blocks of a "
        "request's earlier chunks freed as it runs, hits the local group must also cover",
        {"kv_layout": "hybrid-local", "kv_events": True, "log_stats": True},
    ),
    Axis(
        "hybrid-ring",
        "full attention beside a compressor's ring buffer (one block per request for its "
        "life, never prefix-cached): the ring group claims its block at admission, takes no "
        "part in hits and frees it at finish",
        {"kv_layout": "hybrid-ring", "kv_events": True, "log_stats": True},
    ),
    Axis(
        "hybrid-mamba",
        "full attention beside a Mamba group in align mode: chunks split at Mamba blocks, "
        "hits inside a Mamba block (a 16-token hash unit in 32-token blocks), state copies",
        {"kv_layout": "hybrid-mamba", "kv_events": True, "log_stats": True},
    ),
    Axis(
        "hybrid-mamba-spec-decode",
        "full attention beside a Mamba group without prefix caching, under speculative "
        "decoding: each request's Mamba state keeps a slot per draft token (MTP/EAGLE-style "
        "blocks beyond its running state), allocated and freed with it",
        {
            "kv_layout": "hybrid-mamba",
            "enable_prefix_caching": False,
            "num_speculative_tokens": 2,
            "kv_events": True,
            "log_stats": True,
        },
    ),
    Axis(
        "hisparse",
        "HiSparse on a DeepSeek sparse-attention shape: each layer's MLA cache backed by a host "
        "pool, device pages resident or hot per request, spilled to host pages the worker "
        "writes back and reclaimed when the pool reuses them; prefix hits served from host "
        "pages; the scheduler built for Model Runner V2, which HiSparse needs",
        {
            "kv_layout": "hisparse",
            "model": str(DSA_MODEL),
            "block_size": 64,
            "num_blocks": 8,
            "max_num_batched_tokens": 128,
            "model_runner_v2": True,
            "log_stats": True,
        },
    ),
    Axis(
        "hybrid-swa-retention",
        "hybrid-swa keeping a sliding-window checkpoint only every 64 tokens "
        "(prefix_cache_retention_interval) and at the prompt's replay boundary: the blocks "
        "between are not cached, so hits land on the kept checkpoints",
        {
            "kv_layout": "hybrid-swa",
            "cache_options": {"prefix_cache_retention_interval": 64},
            "kv_events": True,
            "log_stats": True,
        },
    ),
    Axis(
        "hybrid-mamba-retention",
        "hybrid-mamba keeping a Mamba state only every 64 tokens and at the prompt's replay "
        "boundary (prefix_cache_retention_interval), instead of every block; prefix-cache keys "
        "per Mamba block (no prefix_match_unit), so hits end on Mamba block boundaries",
        {
            "kv_layout": "hybrid-mamba",
            "cache_options": {"prefix_cache_retention_interval": 64, "prefix_match_unit": None},
            "kv_events": True,
            "log_stats": True,
        },
    ),
    *(
        Axis(
            f"hybrid-{kind}-eagle",
            f"hybrid-{kind} with an EAGLE head (two drafts) that drops each hit's last block: "
            "every group's hit shortened, the window or Mamba state the drafter needs kept one "
            "block further"
            + (
                "; a Mamba checkpoint also at a sibling's shared-prefix junction"
                if kind == "mamba"
                else ""
            ),
            {
                "kv_layout": f"hybrid-{kind}",
                "num_speculative_tokens": 2,
                "spec_method": "eagle",
                # The legacy drop of each hit's last block, which the coordinator applies per
                # group (hash lookahead, the default, leaves hits whole).
                "spec_options": {"disable_lookahead_block_hashes": True},
                # Mamba: also a checkpoint where an EAGLE sibling resumed (0.33; off before).
                **(
                    {"cache_options": {"enable_mamba_shared_prefix_checkpoint": True}}
                    if kind == "mamba"
                    else {}
                ),
                "kv_events": True,
                "log_stats": True,
            },
        )
        for kind in ("swa", "mamba")
    ),
    Axis(
        "hybrid-swa-connector",
        "the sliding-window layout with the harness connector (both roles): external hits "
        "into two groups, out-of-window blocks freed before a hand-off, the divergent-hit "
        "lookup falling back where no Mamba group is",
        {
            "kv_layout": "hybrid-swa",
            "kv_connector": kv_connectors.HARNESS_HYBRID,
            "kv_connector_extra": {"divergent_hybrid_hits": True},
            "log_stats": True,
        },
        request_values={"kv_transfer_params": kv_connectors.HARNESS_HYBRID_PLANS},
    ),
    Axis(
        "hybrid-mamba-connector",
        "the Mamba layout with the harness connector as a P/D producer that restores Mamba "
        "state: divergent local hits, boundary-state and partial-tail offloads at finish",
        {
            **MAMBA_PRODUCER,
            # Enough blocks that no admission runs the pool dry: under pressure 0.33 admits a
            # synchronous external hit its Mamba group then cannot allocate ("Cannot get 1
            # free blocks"), on both sides alike.
            "num_blocks": 64,
        },
        request_values={
            "kv_transfer_params": kv_connectors.HARNESS_HYBRID_PLANS,
            "kv_cache_report_mode": REPORT_MODES,
            "skip_reading_prefix_cache": SKIP_READING,
        },
    ),
    Axis(
        "hybrid-mamba-connector-chunked",
        "hybrid-mamba-connector with 16-token prefill chunks (half a Mamba block): requests "
        "stop at the prompt's sub-block checkpoint, and one aborted there hands its safe "
        "partial Mamba tail to the producer at finish; 16 blocks, so a Mamba hit outlives "
        "its full-attention blocks",
        {
            **MAMBA_PRODUCER,
            # 16 blocks: evictions take a prefix's full-attention blocks while a Mamba state
            # of it survives, a lookup then reconciles the deeper Mamba hit; no synchronous
            # external hit is drawn, which 0.33 cannot allocate under such pressure.
            "num_blocks": 16,
            # A sibling rather than the axis's own budget: smaller chunks steer its draws away
            # from branches of the Mamba chunk split that hybrid-mamba-connector reaches.
            "long_prefill_token_threshold": 16,
        },
        request_values={
            "kv_transfer_params": kv_connectors.HARNESS_HYBRID_PRESSURE_PLANS,
            "kv_cache_report_mode": REPORT_MODES,
            "skip_reading_prefix_cache": SKIP_READING,
        },
        # The tail survives only from the step that ends at the checkpoint to the next
        # schedule; async scheduling schedules the next chunk before the abort can come.
        modes=("sync",),
    ),
    Axis(
        "logprobs",
        "sampled-token logprobs: requests ask for 0-5 candidates per token, the runner returns "
        "every request's rows (per token, with offsets, under speculative decoding), each output "
        "must carry exactly its own request's rows for the tokens it emits, stops included; "
        "prompt logprobs (no prefix-cache hit read for them), returned once the prompt is "
        "computed and carried by that step's output; 16-token prefill chunks, so partial "
        "prefills share steps with sampling requests",
        {"log_stats": True, "long_prefill_token_threshold": 16},
        request_values={"logprobs": (None, 0, 1, 5), "prompt_logprobs": (None, None, 0, 2)},
    ),
    Axis(
        "logprobs-spec-decode",
        "logprobs with three drafts a step: rows per sampled token, a request's share found by "
        "its offset and cut where a stop ends its accepted drafts",
        {"log_stats": True, "num_speculative_tokens": 3, "long_prefill_token_threshold": 16},
        request_values={"logprobs": (None, 1, 5)},
    ),
    # Limits (``SamplingParams.min_tokens``, the context, the sequence caps).
    Axis(
        "limits",
        "min_tokens (the runner samples no stop id or EOS before it, as vLLM's sampler masks "
        "them), repetition detection over outputs that fall into loops of 1-4 tokens (found, "
        "missed for a longer pattern, held off by min_tokens, or switched off by zero sizes), a "
        "64-token context that requests reach (finished as length-capped), three sequences at "
        "most",
        {"max_model_len": 64, "max_num_seqs": 3, "log_stats": True},
        request_values={
            "min_tokens": (0, 2, 10),
            # (max_pattern_size, min_pattern_size, min_count); min 0 means 1 and zero sizes
            # switch detection off.
            "repetition": (None, (3, 0, 3), (2, 2, 2), (4, 1, 2), (0, 0, 0)),
        },
    ),
    Axis(
        "limits-active-seqs",
        "max_num_active_seqs 2 of 4 sequences (admission stops while two run), and an 8-token "
        "long-prefill cap floored at a fair share of the budget (adaptive)",
        {
            "max_num_seqs": 4,
            "long_prefill_token_threshold": 8,
            "scheduler_options": {
                "max_num_active_seqs": 2,
                "long_prefill_token_threshold_adaptive": True,
            },
            "log_stats": True,
        },
    ),
    Axis(
        "pooling",
        "a pooling model (the causal LM converted to an embedding model, as vLLM converts it): "
        "requests with PoolingParams, no context slot kept for a sampled token, a request "
        "finished by its pooled output once its prompt is computed, each output carrying its "
        "own request's embedding",
        {"runner": "pooling", "log_stats": True},
    ),
    Axis(
        "lora",
        "requests with three LoRA adapters under max_loras 2: a step admits no request whose "
        "adapter would make a third, prefix-cache hits only within one adapter; under the "
        "priority policy, so the requests a step skips go back into the priority queue",
        {"max_loras": 2, "log_stats": True, "scheduling_policy": "priority"},
        request_values={"lora": (0, 1, 2, 3), "priority": (0, 0, 1, -1)},
    ),
    Axis(
        "prefill-cadence",
        "prefill_schedule_interval 3: new prefills start only every third step, decodes in between",
        {"scheduler_options": {"prefill_schedule_interval": 3}, "log_stats": True},
    ),
    Axis(
        "pause",
        "the engine pauses its scheduler (no new requests; nothing at all) and resumes it, "
        "with requests waiting, running, preempted and arriving meanwhile",
        {"log_stats": True},
        pauses=True,
    ),
    Axis(
        "pause-multimodal",
        "pause with images: the engine also drops its encoder cache (reset_encoder_cache, as a "
        "weight update does), so images cached or in use are encoded again",
        {"model": str(MM_MODEL), "log_stats": True},
        request_values={"images": IMAGE_DRAWS},
        pauses=True,
    ),
    Axis(
        "streaming-sessions",
        "streaming input sessions: resumable requests stop at max_tokens and wait for more "
        "input under their id; input applied at once to a waiting session or queued behind a "
        "running turn, the turn's output kept in the prompt; the stream's end finishing a "
        "waiting session at once or a running one after its queued turns",
        {"log_stats": True},
        request_values={"resumable": (False, True, True)},
    ),
    Axis(
        "streaming-sessions-multimodal",
        "streaming sessions of a multimodal model: requests and later chunks carry images, "
        "which the session takes on past what it holds and encodes when their tokens come; "
        "statistics off (no queued event for a resumed turn)",
        {"model": str(MM_MODEL)},
        request_values={"resumable": (False, True, True), "images": IMAGE_DRAWS},
    ),
    # Structured outputs (``conformance._core.grammars``): drawn grammars compile 0-2 steps
    # after admission, the token source follows each bitmask but sometimes breaks it.
    Axis(
        "structured-outputs",
        "xgrammar grammars (JSON schema, regex, choice, one that fails to compile): waiting for "
        "compilation, bitmasks, grammar-rejected tokens, deferred sampling under async",
        {"structured_outputs": "xgrammar", "log_stats": True},
        request_values={"grammar": GRAMMAR_VALUES},
    ),
    Axis(
        "structured-spec-decode",
        "structured outputs with three drafts a step: drafts validated against the grammar "
        "(sync), grammar-invalidated drafts and their statistics (async)",
        {"structured_outputs": "xgrammar", "num_speculative_tokens": 3, "log_stats": True},
        request_values={"grammar": GRAMMAR_VALUES},
    ),
    # Encoder-cache connectors (``conformance._core.ec_connectors``): vLLM's example connector.
    *(
        Axis(
            f"ec-{role}",
            f"vLLM's example EC connector as {role}: EC metadata every step, the connector's "
            "finish hook and output"
            + {
                "producer": "; an encoder-only instance of the multimodal model (images drawn): "
                "nothing sampled, a request stops once its prompt is consumed",
                "consumer": "",
                "both": "; ec_transfer_params from its producer half",
            }[role],
            {
                "ec_connector": ec_connectors.EXAMPLE,
                "ec_role": f"ec_{role}",
                "log_stats": True,
                # The producer is an encoder-only instance, which from 0.29 needs a model with
                # an encoder to run.
                **({"model": str(MM_MODEL)} if role == "producer" else {}),
            },
            request_values={"images": IMAGE_DRAWS} if role == "producer" else {},
        )
        for role in ("producer", "consumer", "both")
    ),
    # Multimodal inputs (``conformance._core.multimodal``): a LLaVA-shaped model, whose encoder
    # budget and cache vLLM sizes at the token budget (48 tokens: three large images).
    Axis(
        "multimodal",
        "images in requests: encoder inputs scheduled with the tokens that need them under the "
        "encoder compute budget, images shared between requests served from the encoder "
        "cache, unused entries evicted when space runs out, an image's placeholder tokens "
        "scheduled in chunks, prefix-cache hits keyed by the images a block shows, an "
        "identifier reused for an image of another size",
        {"model": str(MM_MODEL), "log_stats": True},
        request_values={"images": IMAGE_DRAWS},
    ),
    Axis(
        "multimodal-whole-images",
        "multimodal with chunked multimodal input off: a step that cannot take an image's "
        "placeholder tokens whole stops before the image",
        {"model": str(MM_MODEL), "disable_chunked_mm_input": True, "log_stats": True},
        request_values={"images": IMAGE_DRAWS},
    ),
    Axis(
        "multimodal-v2",
        "multimodal with the scheduler built for Model Runner V2: each step names the images "
        "a worker installs and those it can drop once their tokens are computed "
        "(encoder_input_updates), resumed requests sent whole as new ones; each step also "
        "counts its encoder inputs (iteration details)",
        {
            "model": str(MM_MODEL),
            "model_runner_v2": True,
            "iteration_details": True,
            "log_stats": True,
        },
        request_values={"images": IMAGE_DRAWS},
    ),
    Axis(
        "ec-consumer-multimodal",
        "multimodal with vLLM's example EC connector as consumer, three of the images already "
        "stored by a producer: the scheduler loads those from the connector instead of "
        "encoding them (no encoder budget spent), in the step's EC metadata",
        {
            "model": str(MM_MODEL),
            "ec_connector": ec_connectors.EXAMPLE,
            "ec_role": "ec_consumer",
            "ec_connector_extra": {"stored": ["cat", "map", "icon"]},
            "log_stats": True,
        },
        request_values={"images": IMAGE_DRAWS},
    ),
    # Auxiliary outputs (``vllm_compat.aux_outputs``): what the runner returns beside tokens,
    # which the scheduler must route to the right request's output.
    Axis(
        "sampling-masks",
        "the runner returns each step's sampling masks (Model Runner V2): each output carries "
        "its own request's mask as new_sampling_mask",
        {"return_sampling_mask": True},
    ),
    Axis(
        "routed-experts",
        "a mixture-of-experts model whose runner returns the experts each scheduled token was "
        "routed to: the whole prompt's routing on a request's first output, then per token",
        {"return_routed_experts": True, "model": str(MOE_MODEL)},
    ),
    Axis(
        "routed-experts-hybrid-connector",
        "routed experts (the aux-output connector, 0.31+) with the Mamba layout and the harness "
        "connector as a P/D producer: the connector caps local and external hits at what it "
        "can emit routing for",
        {
            "return_routed_experts": True,
            "model": str(MOE_MODEL),
            "kv_layout": "hybrid-mamba",
            "kv_connector": kv_connectors.HARNESS_HYBRID,
            "kv_role": "kv_producer",
            "kv_connector_extra": {"divergent_hybrid_hits": True},
            "num_blocks": 64,  # as hybrid-mamba-connector: no admission runs the pool dry
        },
        request_values={"kv_transfer_params": kv_connectors.HARNESS_HYBRID_PLANS},
    ),
)

BY_NAME: dict[str, Axis] = {a.name: a for a in AXES}


def axis(name: str) -> Axis:
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown scheduler axis {name!r}; known {sorted(BY_NAME)}") from None
