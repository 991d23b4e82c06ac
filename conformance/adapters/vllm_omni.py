"""vllm-omni's autoregressive schedulers as a conformance subject (``--subject vllm-omni``).

Checks ``OmniARScheduler`` / ``OmniARAsyncScheduler`` (``vllm_omni.core.sched.omni_ar_scheduler``)
with the harness's token source: the harness's ``VllmConfig`` turned into vllm-omni's
``OmniModelConfig`` for one final AR text stage, and requests built as vllm-omni's ``OmniRequest``,
as its engine builds them. Importing vllm-omni patches vLLM, so the factory imports the scheduler
module inside the harness's pristine guard and the oracle then runs in a process of its own.
Nothing here imports vLLM or vllm-omni at import time (the release matrix asks
``environment_requirements`` where vllm-omni is absent), and of the gate only ``conformance.api``
is imported. What is built and why, release by release: ``docs/vllm-omni.md``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from conformance.api import (
    AddRequest,
    BaseSubject,
    DeclaredAttributes,
    Difference,
    DifferenceEntry,
    DifferenceWitness,
    HarnessConfig,
    SourceLayout,
    SubjectUnsupported,
    build_scheduler,
    release,
    request_kwargs,
)

from . import vllm_omni_chunks as chunks

DISTRIBUTION = "vllm-omni"
PACKAGE = "vllm_omni"
SCHEDULER_MODULE = "vllm_omni.core.sched.omni_ar_scheduler"
# vllm-omni publishes X.Y.0 for each even vLLM minor in this range (PyPI, checked with
# ``pip index versions vllm-omni``); 0.30.0 is the newest.
PUBLISHED_MINORS: tuple[int, ...] = tuple(range(14, 31, 2))

# The stage fields of a single, final, turn-based AR text stage (``OmniModelConfig``).
TEXT_STAGE: dict[str, Any] = {
    "stage_id": 0,
    "model_stage": "thinker",
    "worker_type": "ar",
    "engine_output_type": "text",
    "final_output": True,
    "async_chunk": False,
    "session_mode": "turn",
    "use_v2_model_runner": False,
    "supports_native_mrv2_data_plane": False,
    "requires_full_payload_input": False,
    "omni_kv_config": None,
}


# ---- which release, and whether it can run here ----------------------------------------------


def _minor_of(vllm_version: str) -> tuple[int, int]:
    major, minor, _ = release(vllm_version)
    return major, minor


def requirement_for(vllm_version: str) -> str:
    """``vllm-omni==X.Y.0`` for vLLM ``X.Y.*``; ``SubjectUnsupported`` where none is published."""
    major, minor = _minor_of(vllm_version)
    if major != 0 or minor not in PUBLISHED_MINORS:
        published = ", ".join(f"0.{m}" for m in PUBLISHED_MINORS)
        raise SubjectUnsupported(
            f"vllm-omni publishes no release for vLLM {major}.{minor} "
            f"(it publishes one for each of vLLM {published})"
        )
    return f"{DISTRIBUTION}=={major}.{minor}.0"


def environment_requirements(vllm_version: str) -> list[str]:
    """What a matrix cell on ``vllm_version`` must install besides vLLM and the harness."""
    return [requirement_for(vllm_version)]


def _installed(distribution: str) -> str | None:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def _importable(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def check_environment() -> str:
    """The installed vllm-omni version when it matches the installed vLLM minor; otherwise
    ``SubjectUnsupported`` with one line saying what to install. Imports nothing."""
    vllm = _installed("vllm")
    if vllm is None:
        raise SubjectUnsupported("vLLM is not installed (vllm-omni runs on vLLM)")
    wanted = requirement_for(vllm)
    omni = _installed(DISTRIBUTION)
    if omni is None or not _importable(PACKAGE):
        raise SubjectUnsupported(
            f"vllm-omni is not installed: pip install '{wanted}' (the release for vLLM {vllm})"
        )
    if _minor_of(omni) != _minor_of(vllm):
        raise SubjectUnsupported(
            f"vllm-omni {omni} targets vLLM {'.'.join(map(str, _minor_of(omni)))}, "
            f"but vLLM {vllm} is installed: pip install '{wanted}'"
        )
    return omni


# ---- the differences vllm-omni documents -----------------------------------------------------


def _absent_upstream(ctx: Mapping[str, Any]) -> bool:
    return ctx.get("upstream") is None


def _omni_output_envelope(ctx: Mapping[str, Any]) -> bool:
    """The output's class is ``OmniEngineCoreOutput`` where upstream's is its own, or a trailing
    field of that class that upstream's output does not have carries its generated-token count."""
    if not _absent_upstream(ctx):
        return False
    field = str(ctx.get("path", "")).rsplit(".", 1)[-1]
    value = ctx.get("subject")
    if field == "__type__":
        return value == "OmniEngineCoreOutput"
    if field in ("num_generation_tokens", "new_prompt_len_snapshot"):
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    # A streaming session's turn ended: the orchestrator keeps the session for its next input.
    return field == "is_segment_finished" and value is True


def _synthesized_abort(ctx: Mapping[str, Any]) -> bool:
    """A whole output upstream does not emit: no tokens, finish reason abort, for a request the
    subject finished outside ``update_from_output`` (an abort) and had not reported yet."""
    value = ctx.get("subject")
    path = str(ctx.get("path", ""))
    rid = ctx.get("request_id")
    if not _absent_upstream(ctx) or not isinstance(value, Mapping) or rid is None:
        return False
    if path != f"outputs.{rid}":
        return False
    facts = (ctx.get("subject_state") or {}).get(rid, {})
    return (
        bool(facts.get(AWAITING_FINISH_REPORT))
        and value.get("finish_reason") == "abort"
        and not value.get("new_token_ids")
        and value.get("stop_reason") is None
    )


# The fact ``scheduler_facts`` records for requests in the scheduler's unreported finished set.
AWAITING_FINISH_REPORT = "vllm_omni_awaiting_finish_report"
SCHED = "vllm_omni/core/sched"
VO_TEST = "tests/test_vllm_omni_subject.py::test_documented_differences_happen"

DIFFERENCES: tuple[Difference, ...] = (
    Difference(
        id="VLLM-OMNI-OUT-001",
        fields=(
            "outputs.*.__type__",
            "outputs.*.num_generation_tokens",
            "outputs.*.is_segment_finished",
            "outputs.*.new_prompt_len_snapshot",
        ),
        condition=(
            "every output: its class is OmniEngineCoreOutput, and (vllm-omni 0.30) its trailing "
            "num_generation_tokens (absent upstream) holds a token count; the output that ends "
            "a streaming session's turn sets is_segment_finished (and may carry the session's "
            "prompt length in new_prompt_len_snapshot)"
        ),
        applies=_omni_output_envelope,
        rationale=(
            "vllm-omni replaces vLLM's EngineCoreOutput with its msgspec subclass "
            "OmniEngineCoreOutput, whose trailing optional fields carry multimodal outputs, "
            "serialized pooling payloads, segment ends, streaming prompt lengths and the "
            "request's generated-token count (added in 0.30) to the orchestrator; the AR "
            "scheduler builds every request output through one envelope, which in 0.30 fills "
            "num_generation_tokens. Upstream "
            "decoders read the leading fields only, which the envelope fills as upstream does."
        ),
        documented_at=(
            "vllm_omni/patch.py (module body: EngineCoreOutput rebound to OmniEngineCoreOutput "
            "in every loaded vllm module)",
            "vllm_omni/engine/__init__.py:OmniEngineCoreOutput (a comment per added field)",
            f"{SCHED}/omni_scheduler_mixin.py:OmniSchedulerMixin._make_omni_engine_output",
            "vllm_omni/engine/orchestrator.py (docstring of the session finish marker: streaming "
            "segment stops set is_segment_finished=True)",
        ),
        tests=(VO_TEST,),
        clauses=("C-02",),
    ),
    Difference(
        id="VLLM-OMNI-ABORT-001",
        fields=("outputs.*",),
        condition=(
            "a request finished outside update_from_output (an abort) gets one output with no "
            "tokens and finish reason abort at the next update"
        ),
        applies=_synthesized_abort,
        rationale=(
            "The AR scheduler reports every request it finished, including aborted ones, in the "
            "next EngineCoreOutputs of the request's client, and emits an ABORT output for each "
            "that got no output of its own in that step (its 'synthetic-abort policy'), so the "
            "orchestrator sees every stage request end; upstream emits nothing for a request the "
            "client aborted."
        ),
        documented_at=(
            f"{SCHED}/omni_scheduler_mixin.py:OmniSchedulerMixin._attach_finished_request_sets "
            "(docstring: AR's synthetic-abort policy)",
            f"{SCHED}/omni_ar_scheduler.py:OmniARScheduler.update_from_output "
            "(synthesize_abort_outputs=True)",
            f"{SCHED}/omni_scheduler_mixin.py:OmniSchedulerMixin._log_failed_chunk_sends "
            "(docstring: an abort synthesized by finish_requests)",
            f"{SCHED}/omni_ar_scheduler.py:OmniARScheduler._emit_streaming_context_overflow_outputs"
            " (docstring: the synthesized FinishReason.ABORT output) [from 0.30]",
        ),
        tests=(VO_TEST,),
        clauses=("C-02",),
    ),
)


# ---- the subject ------------------------------------------------------------------------------


def omni_model_config(model_config: Any, overrides: Mapping[str, Any] | None = None) -> Any:
    """The harness's ``ModelConfig`` as the ``OmniModelConfig`` of a plain AR text stage, with a
    feature's stage ``overrides`` (``vllm_omni_chunks.CHUNK_STAGE``: a stage that streams)."""
    from vllm_omni.config import OmniModelConfig

    known = getattr(OmniModelConfig, "__dataclass_fields__", {})
    fields = {**TEXT_STAGE, **(overrides or {})}
    stage = {k: v for k, v in fields.items() if k in known}
    return OmniModelConfig.from_vllm_model_config(model_config, **stage)


# What ``omni-conformance reach`` reports of vllm-omni's own code, area by area, relative to the
# installed ``vllm_omni`` package; a path a release lacks (0.28 has no connector model_runner/)
# is reported as missing there.
_CONNECTORS = "distributed/omni_connectors/"
REACH_AREAS: dict[str, tuple[str, ...]] = {
    "AR scheduler": tuple(
        f"core/sched/{m}.py"
        for m in (
            "omni_ar_scheduler",
            "omni_scheduler_mixin",
            "omni_scheduling_coordinator",
            "output",
            "utils",
        )
    ),
    "chunk transfer adapter": (f"{_CONNECTORS}transfer_adapter/",),
    "connector and payload path": (
        *(
            _CONNECTORS + m
            for m in (
                "connectors/shm_connector.py",
                "connectors/base.py",
                "factory.py",
                "adapter.py",
                "utils/serialization.py",
                "utils/config.py",
                "model_runner/omni_connector_payload_transport.py",
                "model_runner/omni_connector_runtime.py",
            )
        ),
        "engine/serialization.py",
    ),
    "worker": ("worker/",),
    "request and engine types": ("request.py", "engine/__init__.py", "outputs/__init__.py"),
}


class VllmOmniSubject(BaseSubject):
    """vllm-omni's ``OmniARScheduler`` / ``OmniARAsyncScheduler`` on a plain AR text stage."""

    name = "vllm-omni"
    sync_scheduler = f"{SCHEDULER_MODULE}.OmniARScheduler"
    async_scheduler = f"{SCHEDULER_MODULE}.OmniARAsyncScheduler"

    def __init__(self, omni_version: str) -> None:
        self.omni_version = omni_version

    def build_scheduler(self, cfg: HarnessConfig) -> Any:
        overrides = cfg.additional_config.get(chunks.FEATURE_KEY)
        if overrides:
            chunks.register_connector()

        def omni_model(vllm_config: Any) -> None:
            vllm_config.model_config = omni_model_config(vllm_config.model_config, overrides)

        # As the oracle's is built (statistics, KV events, grammars per the configuration),
        # with vllm-omni's model config.
        scheduler = build_scheduler(self.scheduler_class(cfg), cfg, adapt=omni_model)
        adapter = chunks.transfer_adapter(scheduler)
        if adapter is not None:
            chunks.step_driven(adapter)
        return scheduler

    # ---- the chunk path (``vllm_omni_chunks``) ----

    def chunk_delivery(self) -> chunks.VllmOmniChunkDelivery:
        return chunks.VllmOmniChunkDelivery()

    def receiving_stage(self) -> chunks.VllmOmniReceivingStage:
        return chunks.VllmOmniReceivingStage(_minor_of(self.omni_version))

    def feature_configs(self) -> dict[str, dict[str, Any]]:
        feature = chunks.VllmOmniChunkDelivery.processor_feature
        return {feature.name: {"additional_config": dict(feature.additional_config)}}

    def receive_outputs(self, scheduler: Any, outputs: Any) -> Any:
        # The adapter's sender runs after the step that queued its chunks (one pass).
        adapter = chunks.transfer_adapter(scheduler)
        if adapter is not None:
            chunks.pump(adapter)
        return outputs

    def drain_chunks(self, scheduler: Any) -> list[Any]:
        adapter = chunks.transfer_adapter(scheduler)
        if adapter is None:
            return []
        chunks.pump(adapter)
        drain = getattr(getattr(adapter.connector, "sink", None), "drain", None)
        return list(drain()) if drain is not None else []

    def make_request(
        self, op: AddRequest, prompt: list[int], cfg: HarnessConfig, scheduler: Any, arrival: float
    ) -> Any:
        from vllm_omni.request import OmniRequest

        external = op.request_id
        if cfg.additional_config.get(chunks.FEATURE_KEY):
            external = chunks.unique_external_id(op.request_id, scheduler)
        return OmniRequest(external_req_id=external, **request_kwargs(op, prompt, cfg, arrival))

    # ---- what vllm-omni declares (``vllm_omni_declarations``, imported where used) ----

    def declared_attributes(self) -> DeclaredAttributes | None:
        from . import vllm_omni_declarations as declarations

        return declarations.declared_attributes(_minor_of(self.omni_version)[1])

    def input_adapter(self) -> Any:
        from . import vllm_omni_declarations as declarations

        return declarations.VllmOmniInputProbe(self)

    def source_layout(self) -> SourceLayout:
        from . import vllm_omni_declarations as declarations

        return declarations.source_layout()

    def difference_witnesses(self) -> tuple[DifferenceWitness, ...]:
        from . import vllm_omni_declarations as declarations

        return declarations.difference_witnesses()

    def differences(self) -> Sequence[DifferenceEntry]:
        return DIFFERENCES

    def scheduler_facts(self, scheduler: Any) -> dict[str, dict[str, Any]]:
        # VLLM-OMNI-ABORT-001's condition: ids finished but not yet reported to their client.
        pending = getattr(scheduler, "finished_req_ids_dict", None) or {}
        facts = {rid: {AWAITING_FINISH_REPORT: True} for ids in pending.values() for rid in ids}
        if chunks.transfer_adapter(scheduler) is not None:
            # A streaming stage sends every request's outputs and end downstream.
            for rid in scheduler.requests:
                facts.setdefault(rid, {})["has_downstream"] = True
        return facts

    def __repr__(self) -> str:
        return f"<subject {self.name} (vllm-omni {self.omni_version})>"

    def reach_areas(self) -> Any:
        """The parts of vllm-omni that ``omni-conformance reach`` reports (``REACH_AREAS``)."""
        from conformance.api import SubjectAreas

        return SubjectAreas(package=PACKAGE, areas=REACH_AREAS)


def vllm_omni_subject() -> VllmOmniSubject:
    """The subject, after checking the environment; imports vllm-omni's scheduler module (and
    with it ``vllm_omni.patch``) so that the loader's pristine guard sees what that changes."""
    omni_version = check_environment()
    importlib.import_module(SCHEDULER_MODULE)
    return VllmOmniSubject(omni_version)


vllm_omni_subject.environment_requirements = environment_requirements  # type: ignore[attr-defined]
