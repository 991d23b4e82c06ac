"""The harness's one seam to vLLM internals, one module per concern.

``versions``  the supported vLLM releases, the version check, and ``ByRelease`` tables that key
              every per-release difference by the release that introduced it;
``state``     scheduler state: block pool, KV coordinator, requests, admission queues, outputs,
              and the checks that two schedulers' (or two steps' outputs') snapshots would be
              equal, made in place on both at once;
``scheduler_output``  what a ``SchedulerOutput`` says was scheduled, and from which position.

Callers import this package (``from conformance import vllm_compat as vc``); the names below are
its public surface. Supporting another vLLM release is a change inside this package.
"""

from conformance.vllm_compat.scheduler_output import (
    computed_before,
    finished_ids,
    prompt_length,
    resumed_all_token_ids,
    schedule_fields,
)
from conformance.vllm_compat.state import (
    ADMISSION_QUEUES,
    base_output_fields,
    block_ids_reader,
    block_pool,
    block_table,
    finish_reason_name,
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
    output_type_name,
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
from conformance.vllm_compat.versions import (
    ALLOW_UNTESTED_ENV,
    SUPPORTED_VLLM,
    ByRelease,
    Change,
    EnvironmentProblem,
    check_vllm,
    environment_versions,
    installed_release,
    is_untested,
    release,
    vllm_version,
)

__all__ = [
    "ADMISSION_QUEUES",
    "ALLOW_UNTESTED_ENV",
    "SUPPORTED_VLLM",
    "ByRelease",
    "Change",
    "EnvironmentProblem",
    "base_output_fields",
    "block_pool",
    "block_ids_reader",
    "block_table",
    "check_vllm",
    "computed_before",
    "finished_ids",
    "prompt_length",
    "resumed_all_token_ids",
    "schedule_fields",
    "environment_versions",
    "finish_reason_name",
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
    "output_facts",
    "output_type_name",
    "preemption_counts",
    "prefill_stats_fields",
    "queue_ids",
    "release",
    "request_block_ids",
    "request_fields",
    "same_outputs",
    "same_scheduler_state",
    "scheduler_queues",
    "set_none_hash",
    "status_name",
    "vllm_version",
]
