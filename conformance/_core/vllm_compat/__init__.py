"""The harness's one seam to vLLM internals, one module per concern.

``versions``  the supported vLLM releases, the version check, and ``ByRelease`` tables that key
              every per-release difference by the release that introduced it;
``state``     scheduler state, and the in-place checks that two snapshots would be equal
              (``stale_output``: a request's stale-output bookkeeping, which 0.28 reshaped);
``scheduler_output``  what a ``SchedulerOutput`` says was scheduled, and from which position;
``stats``     statistics, request events and KV-cache events, as plain values;
``features``, ``kv_layout``  the axes the release can drive; hybrid layouts by vLLM's planner;
``kv_connector``, ``ec_connector``  the shipped KV and encoder-cache connectors' step metadata;
``encoder_cache``, ``pause``  a multimodal model's encoder cache; the engine's pause states;
``structured``, ``aux_outputs``  grammars and bitmasks; sampling masks and routed experts.

Callers import this package (``from conformance._core import vllm_compat as vc``); the names below are
its public surface. Supporting another vLLM release is a change inside this package.
"""

from conformance._core.vllm_compat.aux_outputs import (
    AuxRunner,
    aux_output_fields,
    aux_runner,
    same_aux_outputs,
)
from conformance._core.vllm_compat.ec_connector import (
    ec_metadata,
    ec_transfer_params,
    empty_ec_output,
    encoder_only,
    encoder_only_flag,
)
from conformance._core.vllm_compat.encoder_cache import (
    encoder_cache_state,
    encoder_schedule_fields,
    same_encoder_cache,
)
from conformance._core.vllm_compat.features import axis_unavailable
from conformance._core.vllm_compat.kv_connector import (
    hisparse_worker_meta,
    offload_jobs,
    offload_worker_meta,
)
from conformance._core.vllm_compat.pause import pause_state, set_pause
from conformance._core.vllm_compat.scheduler_output import (
    computed_before,
    draft_token_ids,
    finished_ids,
    prompt_length,
    resumed_all_token_ids,
    resumed_ids,
    schedule_fields,
    scheduled_drafts,
    spec_tokens_to_schedule,
)
from conformance._core.vllm_compat.stale_output import stale_in_fields
from conformance._core.vllm_compat.state import (
    ADMISSION_QUEUES,
    QUEUE_FIELDS,
    base_output_fields,
    block_ids_reader,
    block_pool,
    block_table,
    finish_reason_name,
    finished_sets,
    finished_unreported,
    free_block_order,
    has_stale_tokens,
    is_finished,
    live_request_ids,
    none_hash,
    num_cached_hashes,
    num_free_blocks,
    output_extra_fields,
    output_facts,
    output_trace_headers,
    output_type_name,
    pooled_output,
    preemption_counts,
    prefill_stats_fields,
    queue_ids,
    request_block_ids,
    request_fields,
    same_outputs,
    same_scheduler_state,
    scheduler_queues,
    set_none_hash,
    status_name,
)
from conformance._core.vllm_compat.stats import (
    STATS_FIELDS,
    capture_kv_events,
    plain,
    request_events,
    scheduler_stats,
    shut_down_parts,
    spec_decode_metrics,
    take_kv_events,
)
from conformance._core.vllm_compat.structured import (
    GrammarRows,
    assign_backend,
    defers_sampling,
    grammar_fields,
    grammar_rows,
    hold_grammar_compilation,
    init_grammar,
    settle_grammars,
)
from conformance._core.vllm_compat.versions import (
    ALLOW_UNTESTED_ENV,
    SUPPORTED_VLLM,
    ByRelease,
    Change,
    EnvironmentProblem,
    absent_paths,
    check_vllm,
    environment_versions,
    installed_release,
    introductions,
    is_untested,
    release,
    vllm_version,
)

# Every table of recorded field paths that differ between releases, one per concern: what a
# recording's ``absent_fields`` lists (``conformance.release.record.absent_fields``).
RECORDED_FIELDS: tuple[ByRelease[frozenset[str]], ...] = (QUEUE_FIELDS, STATS_FIELDS)

__all__ = [
    "ADMISSION_QUEUES",
    "QUEUE_FIELDS",
    "RECORDED_FIELDS",
    "STATS_FIELDS",
    "absent_paths",
    "introductions",
    "ALLOW_UNTESTED_ENV",
    "SUPPORTED_VLLM",
    "ByRelease",
    "AuxRunner",
    "aux_output_fields",
    "aux_runner",
    "same_aux_outputs",
    "axis_unavailable",
    "pause_state",
    "set_pause",
    "ec_metadata",
    "ec_transfer_params",
    "empty_ec_output",
    "encoder_only",
    "encoder_only_flag",
    "encoder_cache_state",
    "encoder_schedule_fields",
    "same_encoder_cache",
    "GrammarRows",
    "assign_backend",
    "defers_sampling",
    "grammar_fields",
    "grammar_rows",
    "hold_grammar_compilation",
    "init_grammar",
    "settle_grammars",
    "hisparse_worker_meta",
    "offload_jobs",
    "offload_worker_meta",
    "Change",
    "EnvironmentProblem",
    "base_output_fields",
    "block_pool",
    "block_ids_reader",
    "block_table",
    "capture_kv_events",
    "shut_down_parts",
    "check_vllm",
    "computed_before",
    "draft_token_ids",
    "finished_ids",
    "plain",
    "prompt_length",
    "resumed_all_token_ids",
    "resumed_ids",
    "schedule_fields",
    "scheduled_drafts",
    "spec_tokens_to_schedule",
    "environment_versions",
    "finish_reason_name",
    "finished_sets",
    "finished_unreported",
    "free_block_order",
    "has_stale_tokens",
    "installed_release",
    "is_finished",
    "is_untested",
    "live_request_ids",
    "none_hash",
    "num_cached_hashes",
    "num_free_blocks",
    "output_extra_fields",
    "pooled_output",
    "output_trace_headers",
    "output_facts",
    "output_type_name",
    "preemption_counts",
    "prefill_stats_fields",
    "queue_ids",
    "release",
    "request_block_ids",
    "request_events",
    "request_fields",
    "same_outputs",
    "same_scheduler_state",
    "scheduler_queues",
    "scheduler_stats",
    "spec_decode_metrics",
    "take_kv_events",
    "set_none_hash",
    "stale_in_fields",
    "status_name",
    "vllm_version",
]
