"""What the ``vllm-omni`` subject declares beyond lock-step parity: the attributes vllm-omni adds
to vLLM's requests and schedulers (C-10..C-12), its input path as an input-adapter probe (C-13,
C-60), where its worker code and inter-stage payloads live (C-11, C-21), and a witness workload
per registry entry (C-03).

Every name here was read from vllm-omni's source, release by release (0.28.0 and 0.30.0), and
checked against live objects (``tests/test_vllm_omni_subject.py``). Nothing here imports vLLM or
vllm-omni at import time; of the gate only ``conformance.api`` is imported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conformance.api import (
    TIGHT,
    Abort,
    AddRequest,
    DeclaredAttributes,
    DifferenceWitness,
    Feature,
    SourceLayout,
    StageInputSpec,
    Step,
    block_hasher,
)

# ---- attributes added to vLLM's objects (C-10..C-12) ------------------------------------------

# Per vllm-omni minor: (name, dotted type or Python type name) of what its code sets on a
# scheduler request beyond vLLM's ``Request``. OmniRequest.__init__ sets the first four; the
# stage engine's ``preprocess_add_request`` re-sets two of them (and, from 0.30, the sender's
# routing info); the AR scheduler sets the rest on streaming sessions and on segment stops.
_REQUEST_028: tuple[tuple[str, str], ...] = (
    ("prompt_embeds_payload", "vllm_omni.engine.PromptEmbedsPayload"),
    ("external_req_id", "str"),
    ("additional_information", "vllm_omni.engine.AdditionalInformationPayload"),
    ("model_intermediate_buffer", "dict"),
    # A segment stop records the async tokens still in flight (vLLM 0.27 dropped the field).
    ("async_tokens_to_discard", "int"),
    # Each streaming-session segment bumps it.
    ("_omni_segment_generation", "int"),
)
REQUEST_ATTRIBUTES: dict[int, tuple[tuple[str, str], ...]] = {
    28: _REQUEST_028,
    # 0.30: the stage engine keeps the sender's info for payload routing, the coordinator a
    # non-AR stage's initial model buffer, and MiniCPM-o 4.5's window its bookkeeping.
    30: _REQUEST_028
    + (
        ("payload_sender_info", "dict"),
        ("_omni_initial_model_buffer", "dict"),
        ("_minicpmo45_window_open_start", "int"),
        ("_minicpmo45_window_units", "list"),
        ("_minicpmo45_window_previous_token_ids", "list"),
        ("_minicpmo45_window_previous_len", "int"),
    ),
}

# Per vllm-omni minor: what OmniARScheduler / OmniARAsyncScheduler (with OmniSchedulerMixin) set
# on themselves beyond vLLM's Scheduler / AsyncScheduler. ``_last_stats_time`` is set lazily,
# on the first periodic statistics log.
_SCHEDULER_028 = frozenset(
    {
        "_kv_wait_start_ts",
        "_latest_omni_connector_output",
        "_last_stats_time",
        "_new_prompt_len_snapshot",
        "_omits_kv_transfer_cache",
        "_omni_kv_config",
        "_pooling_output_decoder",
        "active_kv_transfers",
        "chunk_transfer_adapter",
        "input_coordinator",
        "kv_transfer_criteria",
        "pending_stop_after_extraction",
        "requests_needing_kv_transfer",
        "transfer_triggered_requests",
        "waiting_for_transfer_free",
    }
)
SCHEDULER_ATTRIBUTES: dict[int, frozenset[str]] = {
    28: _SCHEDULER_028,
    # 0.30: the native MRv2 data plane's flag, inbox and terminal ids, streaming-context
    # overflows, and (lazily) outputs held for requests whose input timed out.
    30: _SCHEDULER_028
    | {
        "_native_data_plane",
        "_omni_connector_output_inbox",
        "_pending_data_plane_terminal_req_ids",
        "_streaming_context_overflow",
        "_pending_input_timeout_outputs",
    },
}
# The scheduler's send path: the chunk-transfer adapter accumulates the chunks (tensors
# included) it exchanges with the neighbouring stages.
SEND_PATH = frozenset({"chunk_transfer_adapter"})
# vllm-omni's wire payloads (``vllm_omni.engine``): prompt embeddings and additional information
# serialized for the engine's transport.
PAYLOAD_CLASSES = ("PromptEmbedsPayload", "AdditionalInformationPayload")


def _resolve(dotted: str) -> type:
    import builtins
    import importlib

    if "." not in dotted:
        return getattr(builtins, dotted)  # type: ignore[no-any-return]
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def declared_attributes(minor: int) -> DeclaredAttributes | None:
    """What vllm-omni ``0.<minor>`` adds to vLLM's requests and schedulers; None for a release
    whose source was not read (the audits are then not applicable there, not guessed)."""
    if minor not in REQUEST_ATTRIBUTES:
        return None
    import vllm_omni.engine as engine

    return DeclaredAttributes(
        request={name: _resolve(kind) for name, kind in REQUEST_ATTRIBUTES[minor]},
        scheduler=SCHEDULER_ATTRIBUTES[minor],
        send_path=SEND_PATH,
        modality_types=tuple(getattr(engine, name) for name in PAYLOAD_CLASSES),
    )


# ---- the source tree (C-11, C-21) -----------------------------------------------------------


def source_layout() -> SourceLayout:
    """Worker code under ``vllm_omni/worker`` (and ``worker_v2``, where a release has it); the
    inter-stage payload ``AdditionalInformationPayload`` built only by
    ``data_entry_keys.serialize_payload``, the boundary vllm-omni's payload module documents.
    vllm-omni ships no import-linter contracts (its pyproject configures none)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm_omni")
    assert spec is not None and spec.origin is not None
    root = Path(spec.origin).parent
    workers = tuple(p for p in (root / "worker", root / "worker_v2") if p.is_dir())
    return SourceLayout(
        worker_roots=workers,
        import_contracts=None,
        payload_root=root,
        payload_type="AdditionalInformationPayload",
        payload_builders=("data_entry_keys.py",),
    )


# ---- the input path (C-13, C-60) ------------------------------------------------------------


class VllmOmniInputProbe:
    """vllm-omni's stage-input path: the orchestrator's ``_build_next_stage_request`` (a token
    prompt through ``build_engine_core_request_from_tokens``, any other through vLLM's
    ``InputProcessor``, into an ``OmniEngineCoreRequest``), then the stage engine's
    ``StageEngineCoreProc.preprocess_add_request``, which builds the scheduler's request through
    vLLM's ``Request.from_engine_core_request`` with the name rebound to ``OmniRequest``.

    vllm-omni has no rejection type of its own: whatever either step raises is what the engine
    turns into an error output for the request (``EngineCore._handle_request_preproc_error``),
    so ``rejection`` is ``Exception``, and such an exception names no request and no field.
    The conditioning vector travels where vllm-omni carries inter-stage tensors, in the
    additional information; the final stage is the orchestrator's, no field of the stage's
    request, so the stage engine never sees it.
    """

    rejection = Exception

    def __init__(self, subject: Any, max_model_len: int = 128) -> None:
        self.subject = subject
        self.spec = StageInputSpec(
            "thinker", ("thinker",), hidden_size=64, vocab_size=512, max_model_len=max_model_len
        )

    def scheduler(self) -> Any:
        scheduler = self.subject.build_scheduler(TIGHT)
        # A stage fed embeddings is configured to take them (vLLM's --enable-prompt-embeds); only
        # the input processor reads the setting, the scheduler does not.
        scheduler.vllm_config.model_config.enable_prompt_embeds = True
        return scheduler

    def build(self, scheduler: Any, request_id: str, sampling_params: Any, **fields: Any) -> Any:
        from types import SimpleNamespace

        from vllm_omni.engine.orchestrator import Orchestrator
        from vllm_omni.engine.stage_engine_core_proc import StageEngineCoreProc

        prompt: dict[str, Any] = {
            k: fields[k] for k in ("prompt_token_ids", "prompt_embeds") if k in fields
        }
        information = fields.get("additional_information")
        if "conditioning" in fields:
            information = {**(information or {}), "conditioning": fields["conditioning"]}
        if information is not None:
            prompt["additional_information"] = information
        # The orchestrator's own routing (token prompts built directly, others through vLLM's
        # input processor) on an orchestrator holding only what that method reads: the stage's
        # pool (its configuration) and the processors it builds on first use.
        orchestrator = Orchestrator.__new__(Orchestrator)
        orchestrator.stage_pools = {0: SimpleNamespace(stage_vllm_config=scheduler.vllm_config)}
        orchestrator._stage_input_processors = {}
        core_request = orchestrator._build_next_stage_request(
            request_id, 0, prompt, sampling_params
        )
        # The stage engine's own preprocessing on an engine holding only what that method
        # reads (no multimodal cache, the scheduler's grammars, the engine's block hasher).
        engine = StageEngineCoreProc.__new__(StageEngineCoreProc)
        engine.mm_receiver_cache = None
        engine.structured_output_manager = scheduler.structured_output_manager
        engine.request_block_hasher = block_hasher(scheduler.cache_config.block_size)
        request, _ = engine.preprocess_add_request(core_request)
        return request

    def additional_information(self, request: Any) -> dict[str, Any]:
        from vllm_omni.engine.serialization import deserialize_additional_information

        carried = dict(deserialize_additional_information(request.additional_information))
        carried.pop("conditioning", None)  # the probe's own carriage of the conditioning
        return carried


# ---- difference witnesses (C-03) ------------------------------------------------------------

_PLAIN = Feature("off")


def difference_witnesses() -> tuple[DifferenceWitness, ...]:
    """One workload per registry entry of ``conformance.adapters.vllm_omni`` that makes it
    happen, in each scheduling mode."""
    out: tuple[Any, ...] = (
        AddRequest("w-out", tuple(range(10, 30)), max_tokens=3),
        *(Step() for _ in range(4)),
    )
    abort: tuple[Any, ...] = (
        AddRequest("a", tuple(range(10, 30)), max_tokens=8),
        AddRequest("b", tuple(range(40, 60)), max_tokens=8),
        Step(),
        Step(),
        Abort(("b",)),
        *(Step() for _ in range(3)),
    )
    return tuple(
        DifferenceWitness(entry, _PLAIN, ops, mode)
        for mode in ("sync", "async")
        for entry, ops in (("VLLM-OMNI-OUT-001", out), ("VLLM-OMNI-ABORT-001", abort))
    )
