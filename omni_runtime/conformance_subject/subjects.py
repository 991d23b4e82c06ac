"""The ``omni-scheduler`` and ``omni`` subjects: the omni schedulers with the harness's token
source, then with the real model runner over generated weights, each declaring the
capabilities the other modules of this package implement; and their entry-point factories,
which refuse a vLLM release the runtime does not support.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from conformance.api import (
    AddRequest,
    BaseSubject,
    DeclaredAttributes,
    DifferenceEntry,
    DifferenceWitness,
    HarnessConfig,
    SourceLayout,
    SubjectAreas,
    SubjectUnsupported,
    build_kv_cache_config,
    build_vllm_config,
    image_features,
    lora_request,
    make_sampling_params,
    prompt_embeddings,
    request_block_hasher,
)
from omni_runtime.conformance_subject.delivery import OmniChunkDelivery
from omni_runtime.conformance_subject.input_adapter import OmniInputAdapterProbe
from omni_runtime.conformance_subject.reference import OmniModelReference, shared_model
from omni_runtime.conformance_subject.runner import OmniFaultContainment, OmniRunnerProbes
from omni_runtime.conformance_subject.stages import (
    MODEL_KEY,
    PACKAGE,
    TOKEN_UPDATES,
    WORKER_FEATURES,
)
from omni_runtime.conformance_subject.witnesses import difference_witnesses

# The runtime's layers (docs/design.md, "The runtime") that ``omni-conformance reach`` reports,
# relative to the package; a file two areas name counts in the first, so the connectors leave
# the rest of ``engine/`` to the orchestrator's area. This package's own subject code, the CLI
# and the text and audio helpers are not the runtime's serving path and are left out.
REACH_AREAS: dict[str, tuple[str, ...]] = {
    "scheduler": ("sched/scheduler.py", "sched/process_stage.py", "sched/__init__.py"),
    "chunk path": ("sched/transfer.py", "sched/processors.py"),
    "payloads": ("payload.py", "adapters/output.py"),
    "inputs": ("adapters/input.py", "adapters/__init__.py"),
    "worker and runner": ("worker/",),
    "models": ("models/",),
    "connectors": ("engine/connectors.py", "engine/_relay.py", "adapters/shm_wire.py"),
    "engine and orchestrator": ("engine/",),
    "config and platform": ("config.py", "platform.py", "vllm_support.py"),
}


class OmniSchedulerSubject(BaseSubject):
    """The omni schedulers with the harness's token source (no real worker)."""

    name = "omni-scheduler"
    sync_scheduler = "omni_runtime.sched.OmniARScheduler"
    async_scheduler = "omni_runtime.sched.OmniARAsyncScheduler"

    def differences(self) -> Sequence[DifferenceEntry]:
        from omni_runtime.differences import DIFFERENCES

        return DIFFERENCES

    def make_request(
        self, op: AddRequest, prompt: list[int], cfg: HarnessConfig, scheduler: Any, arrival: float
    ) -> Any:
        from omni_runtime.adapters.input import InputAdapter, StageInput
        from omni_runtime.config import OmniStageConfig

        stage = OmniStageConfig.from_vllm_config(scheduler.vllm_config)
        if stage is None or op.plain or cfg.runner == "pooling":
            # A plain vLLM client's request reaches the stage's engine as upstream builds it
            # (``Request.from_engine_core_request``): no stage input, no omni slot. So does a
            # pooling request: the stage input adapter builds generating stages' inputs only.
            return super().make_request(op, prompt, cfg, scheduler, arrival)
        adapter = InputAdapter(
            stage,
            max_model_len=cfg.max_model_len,
            block_hasher=request_block_hasher(cfg),
            live_ids=scheduler.requests,
        )
        return adapter.build(
            StageInput(
                request_id=op.request_id,
                sampling_params=make_sampling_params(op, cfg),
                prompt_token_ids=None if op.embeds else prompt,
                prompt_embeds=prompt_embeddings(prompt, cfg) if op.embeds else None,
                final_stage_id=op.final_stage,
                arrival_time=arrival,
                trace_headers=op.headers(),
                client_index=op.client_index,
                priority=op.priority,
                resumable=op.resumable,
                mm_features=image_features(op, prompt, cfg.model_runner_v2) or None,
                lora_request=lora_request(op),
            )
        )

    def request_facts(self, request: Any) -> dict[str, Any]:
        from omni_runtime.adapters.input import omni_state_of

        state = omni_state_of(request)
        if state is None:
            return {}
        return {
            "has_downstream": state.has_downstream,
            "final_stage_id": state.final_stage_id,
            "stage_id": state.stage_id,
        }

    def scheduler_facts(self, scheduler: Any) -> dict[str, dict[str, Any]]:
        # OMNI-ERR-001's condition: requests whose chunk processor or connector raised.
        fn = getattr(scheduler, "omni_failed_request_ids", None)
        return {rid: {"transfer_failed": True} for rid in fn()} if fn is not None else {}

    def live_omni_ids(self, scheduler: Any) -> set[str]:
        fn = getattr(scheduler, "omni_request_ids", None)
        return set(fn()) if fn is not None else set()

    def drain_chunks(self, scheduler: Any) -> list[Any]:
        transfer = getattr(scheduler, "transfer", None)
        drain = getattr(getattr(transfer, "sink", None), "drain", None)
        return list(drain()) if drain is not None else []

    def feature_configs(self) -> dict[str, dict[str, Any]]:
        return dict([TOKEN_UPDATES])

    def declared_attributes(self) -> DeclaredAttributes:
        from omni_runtime.adapters import DECLARED_REQUEST_ATTRIBUTES, OmniRequestState
        from omni_runtime.payload import StageChunk, StagePayload
        from omni_runtime.sched import DECLARED_SCHEDULER_ATTRIBUTES

        return DeclaredAttributes(
            request={name: OmniRequestState for name in DECLARED_REQUEST_ATTRIBUTES},
            scheduler=frozenset(DECLARED_SCHEDULER_ATTRIBUTES),
            # The outbox legitimately holds chunks (with tensors) until they are delivered.
            send_path=frozenset({"transfer"}),
            modality_types=(StagePayload, StageChunk),
        )

    def chunk_delivery(self) -> OmniChunkDelivery:
        return OmniChunkDelivery()

    def source_layout(self) -> SourceLayout:
        return SourceLayout(
            worker_roots=(PACKAGE / "worker", PACKAGE / "models"),
            # Shipped with the package, so the gate checks them in any installation.
            import_contracts=PACKAGE / "import_contracts.toml",
            payload_root=PACKAGE,
            payload_type="StagePayload",
            payload_builders=("adapters/",),
            payload_exceptions={
                ("payload.py", "trimmed_before"): "the payload type's own trimmed copy (C-45)",
                ("engine/connectors.py", "_unpack"): "wire decoding; belongs in adapters/",
            },
        )

    def input_adapter(self) -> OmniInputAdapterProbe:
        return OmniInputAdapterProbe(self)

    def difference_witnesses(self) -> tuple[DifferenceWitness, ...]:
        return difference_witnesses()

    def reach_areas(self) -> SubjectAreas:
        return SubjectAreas(package="omni_runtime", areas=REACH_AREAS)


class OmniSubject(OmniSchedulerSubject):
    """The whole runtime: the omni schedulers and the real model runner over real weights.

    ``runner_cls`` lets a mutant swap the runner class (the harness calls ``make_worker``).
    """

    name = "omni"
    worker_cls = "omni_runtime.worker.OmniARWorker"
    runner_cls: type | None = None

    def feature_configs(self) -> dict[str, dict[str, Any]]:
        return {**dict([TOKEN_UPDATES]), **WORKER_FEATURES}

    def worker_config(self, cfg: HarnessConfig) -> HarnessConfig:
        from omni_runtime.models import model_dir

        # The real worker needs real weights: the runtime's generated thinker model (or the
        # model a feature names, ``OmniRunnerProbes.payload_feature(postprocess=True)``).
        name = cfg.additional_config.get(MODEL_KEY, "thinker")
        return cfg.with_(model=str(model_dir(name)))

    def make_worker(self, cfg: HarnessConfig) -> Any:
        from omni_runtime.worker import OmniARModelRunner

        cls = self.runner_cls or OmniARModelRunner
        runner = cls(build_vllm_config(cfg), shared_model(cfg.model), torch.device("cpu"))
        runner.initialize_kv_cache(build_kv_cache_config(cfg))
        return runner

    def runner_probes(self) -> OmniRunnerProbes:
        return OmniRunnerProbes()

    def fault_containment(self) -> OmniFaultContainment:
        return OmniFaultContainment()

    def model_reference(self) -> OmniModelReference:
        return OmniModelReference()


def require_supported_vllm() -> None:
    """Refuse, as unsupported rather than broken, a vLLM release the runtime does not support."""
    from omni_runtime.vllm_support import UnsupportedVllm, check_vllm

    try:
        check_vllm()
    except UnsupportedVllm as exc:
        raise SubjectUnsupported(str(exc)) from None


def omni_subject() -> OmniSubject:
    require_supported_vllm()
    return OmniSubject()


def omni_scheduler_subject() -> OmniSchedulerSubject:
    require_supported_vllm()
    return OmniSchedulerSubject()
