"""Which scheduler axes (``conformance._core.axes``) the installed vLLM release can drive.

An axis a release lacks, or spells so differently that the harness cannot build it there, is
listed with the release that brought it and the reason the report gives (not applicable).
"""

from __future__ import annotations

from conformance._core.vllm_compat.aux_outputs import aux_axis_unavailable
from conformance._core.vllm_compat.sessions import NO_SESSIONS
from conformance._core.vllm_compat.versions import ByRelease, Change

# axis name -> why it cannot run; every axis runs on the releases after the last change.
_NO_FAILED_RECVING = (
    "the harness connector reports a whole failed load as KVConnectorOutput.failed_recving, "
    "which this release lacks (new in 0.30)"
)
_OLD_OFFLOAD = (
    "the harness stands in for the offloading connector's worker as 0.33 reports jobs "
    "(TransferJob.sync, completed job ids); this release's offloading protocol differs"
)
_MISSING_BEFORE_030 = {
    "kv-harness-recompute": _NO_FAILED_RECVING,
    "kv-harness-fail": _NO_FAILED_RECVING,
    "hybrid-swa-connector": _NO_FAILED_RECVING,
    "hybrid-mamba-connector": _NO_FAILED_RECVING,
    "hybrid-mamba-connector-chunked": _NO_FAILED_RECVING,
    "kv-offload": _OLD_OFFLOAD,
}
_NEGATIVE_CHUNK = (
    "vLLM 0.26 itself fails this axis: with drafts in flight near max_model_len its running "
    "loop schedules a negative token count (the clamp has no floor at 0 before 0.28), "
    "update_from_output then asserts and the request never finishes, so upstream is no oracle"
)
_ASYNC_SESSIONS = (
    "this release's own streaming sessions fail the gate under async scheduling (the upstream "
    "control: a session whose stream ended never gets its terminal outcome, C-62, seen on "
    "0.30); 0.31 changed how a stopped turn's in-flight output is handled "
    "(_handle_stopped_request resumes from the materialized frontier), and 0.33 passes"
)
_NO_ACTIVE_SEQS = (
    "SchedulerConfig.max_num_active_seqs and long_prefill_token_threshold_adaptive are new in 0.31"
)
_NO_CADENCE = (
    "prefill_schedule_interval throttles only a data-parallel engine's prefills before 0.33 "
    "(one engine: inert, so the axis would check nothing)"
)
_NO_HISPARSE = (
    "HiSparse (host-backed sparse-attention pages and their KV-cache managers) is new in 0.33"
)
_MIN_TOKENS_FIRST = (
    "vLLM 0.28 itself fails this axis: its check_stop tests min_tokens before the length "
    "limits (reordered in 0.29), so a request whose min_tokens reaches past max_model_len "
    "grows past its context and never finishes (C-62 on upstream alone); upstream is no oracle"
)
_NO_RING = "CircularBufferSpec (a compressor's ring-buffer KV cache) is new in 0.29"
# Sessions exist from 0.28; under async scheduling both sessions axes wait for 0.31.
_ASYNC_SESSIONS_MISSING = {
    "streaming-sessions:async": _ASYNC_SESSIONS,
    "streaming-sessions-multimodal:async": _ASYNC_SESSIONS,
}
_BEFORE_029 = {"hybrid-ring": _NO_RING, "limits": _MIN_TOKENS_FIRST}
_NEW_IN_031 = {
    "limits-active-seqs": _NO_ACTIVE_SEQS,
    "prefill-cadence": _NO_CADENCE,
    "hisparse": _NO_HISPARSE,
}
_NO_RETENTION = "CacheConfig.prefix_cache_retention_interval is new in 0.30"
_NEW_IN_030 = {
    "hybrid-swa-retention": _NO_RETENTION,
    "hybrid-mamba-retention": _NO_RETENTION,
}
MISSING_AXES: ByRelease[dict[str, str]] = ByRelease(
    "scheduler axes missing",
    {
        **_MISSING_BEFORE_030,
        **_NEW_IN_030,
        **_NEW_IN_031,
        "pipeline-4": _NEGATIVE_CHUNK,
        **_BEFORE_029,
        "streaming-sessions": NO_SESSIONS,
        "streaming-sessions-multimodal": NO_SESSIONS,
    },
    [
        Change(
            "0.28.0",
            {
                **_MISSING_BEFORE_030,
                **_NEW_IN_030,
                **_NEW_IN_031,
                **_ASYNC_SESSIONS_MISSING,
                **_BEFORE_029,
            },
            "a running request's chunk is floored at 0 (_reserve_prefill_lookahead)",
        ),
        Change(
            "0.29.0",
            {
                **_MISSING_BEFORE_030,
                **_NEW_IN_030,
                **_NEW_IN_031,
                **_ASYNC_SESSIONS_MISSING,
            },
            "CircularBufferSpec: a compressor's ring-buffer KV cache; check_stop tests the "
            "length limits before min_tokens",
        ),
        Change(
            "0.30.0",
            {
                "kv-offload": _OLD_OFFLOAD,
                **_NEW_IN_031,
                **_ASYNC_SESSIONS_MISSING,
            },
            "KVConnectorOutput.failed_recving: a worker reports a failed load; "
            "prefix_cache_retention_interval",
        ),
        Change(
            "0.31.0",
            {"kv-offload": _OLD_OFFLOAD, "prefill-cadence": _NO_CADENCE, "hisparse": _NO_HISPARSE},
            "a stopped session resumes from its materialized frontier (_handle_stopped_request); "
            "SchedulerConfig.max_num_active_seqs",
        ),
        Change(
            "0.33.0",
            {},
            "offloading TransferJob.sync: a load may block the step; a local prefill cadence",
        ),
    ],
)


# The encoder-cache connector axes, in a table of their own.
_NO_ENCODER_ONLY = (
    "this release has no encoder-only instance: an EC producer-only scheduler samples on "
    "(VllmConfig.is_encoder_only and its stop are new in 0.28)"
)
EC_MISSING_AXES: ByRelease[dict[str, str]] = ByRelease(
    "EC connector axes missing",
    {"ec-producer": _NO_ENCODER_ONLY},
    [
        Change("0.28.0", {}, "VllmConfig.is_encoder_only: an EC producer-only instance"),
    ],
)


def axis_unavailable(name: str) -> str | None:
    """Why the installed release cannot run axis ``name`` (None: it can)."""
    return (
        MISSING_AXES.value().get(name)
        or EC_MISSING_AXES.value().get(name)
        or aux_axis_unavailable(name)
    )
