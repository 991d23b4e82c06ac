"""This runtime as a conformance subject: what the gate may check of it, and where to look.

The gate (``conformance`` + ``invariants``) never imports this package; it finds these subjects
through the ``omni_conformance.subjects`` entry point, exactly as it finds any other runtime's:

* ``omni`` (``OmniSubject``) — the omni schedulers, the real model runner over the generated
  thinker weights, and every capability the suite can check: declared attributes (C-10..C-12),
  chunk delivery and generated processors (C-21, C-40..C-45), the source layout for the static
  audits (C-11, C-21), the input adapter (C-13), the runner's payload and materialization
  handles (C-22, C-30..C-31, C-50..C-55), a Hugging Face reference of the model (C-08) and
  a witness workload for each entry of its differences registry (C-03).
* ``omni-scheduler`` (``OmniSchedulerSubject``) — the schedulers alone, with the harness's token
  source; the worker-level properties are not applicable to it.

Everything omni-specific the suite relies on lives here: the stage dictionaries it runs with,
which processor streams which ids, how a ``StagePayload`` reads as the suite's ``PayloadView``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from conformance.capabilities import (
    ChunkView,
    DeclaredAttributes,
    DifferenceWitness,
    Feature,
    PayloadView,
    SourceLayout,
    StageInputSpec,
)
from conformance.config import HarnessConfig, block_hasher, build_kv_cache_config, build_vllm_config
from conformance.machine import TIGHT
from conformance.subjects import BaseSubject, DifferenceEntry, make_sampling_params
from conformance.workload import AddRequest, Step

PACKAGE = Path(__file__).resolve().parent
STAGES = ("thinker", "talker", "code2wav")
# Codec ids the talker streams to code2wav; larger ids are the talker's control tokens.
CODEC_VOCAB = 256
CODEC_STREAMER = "omni_runtime.sched.processors.CodecTokenStreamer"
HIDDEN_FORWARDER = "omni_runtime.sched.processors.HiddenRowsForwarder"


def talker_stage(**over: Any) -> dict[str, Any]:
    """Token-only talker stage streaming codec ids to code2wav on every sampled step."""
    return {
        "stage_id": "talker",
        "stages": list(STAGES),
        "downstream": ["code2wav"],
        "chunk_processor": CODEC_STREAMER,
        "omni_pooler_payload_include_hidden": False,
        **over,
    }


def thinker_stage(
    *,
    include_hidden: bool,
    full_prefix: bool | None = None,
    materialization: str = "inline",
    **over: Any,
) -> dict[str, Any]:
    """Thinker stage delivering hidden rows (or, token-only, the prefill conditioning)."""
    return {
        "stage_id": "thinker",
        "stages": list(STAGES),
        "downstream": ["talker"],
        "chunk_processor": HIDDEN_FORWARDER,
        "omni_pooler_payload_include_hidden": include_hidden,
        "downstream_needs_full_prefix": include_hidden if full_prefix is None else full_prefix,
        "materialization": materialization,
        **over,
    }


def _feature(name: str, stage: dict[str, Any], finals: tuple[str | None, ...], worker: bool):
    return name, {
        "additional_config": {"omni_stage": stage},
        "final_stages": list(finals),
        "use_worker": worker,
    }


TOKEN_UPDATES = _feature("token-updates", talker_stage(), (None, "talker", "code2wav"), False)
WORKER_FEATURES = dict(
    [
        _feature(
            "hidden-inline",
            thinker_stage(include_hidden=True, materialization="inline"),
            (None, "thinker", "talker"),
            True,
        ),
        _feature(
            "hidden-background",
            thinker_stage(include_hidden=True, materialization="background"),
            (None, "thinker", "talker"),
            True,
        ),
        _feature(
            "token-only-background",
            thinker_stage(include_hidden=False, materialization="background"),
            (None, "thinker", "code2wav"),
            True,
        ),
    ]
)


class FailMarkedRequests:
    """A chunk processor whose send path breaks for requests whose id contains ``fail``: the
    fault that makes OMNI-ERR-001 happen in its witness (C-03), loaded by dotted path from the
    stage config like any processor, so the unmodified runtime takes its own fault path."""

    requires_token_updates = True

    def __call__(
        self, request_id: str, payload: Any, is_final: bool, new_token_ids: Any = None
    ) -> Any:
        if "fail" in request_id and new_token_ids:
            raise RuntimeError(f"{request_id}: injected processor fault")
        return new_token_ids


def difference_witnesses() -> tuple[DifferenceWitness, ...]:
    """One workload per entry of ``omni_runtime.differences`` that makes it happen (C-03)."""
    token_updates = Feature.from_config(*TOKEN_UPDATES)
    send_fault = Feature(
        "send-fault",
        {"omni_stage": talker_stage(chunk_processor=f"{__name__}.FailMarkedRequests")},
    )
    steps = tuple(Step() for _ in range(12))
    return (
        # A request with a downstream consumer: its outputs carry chunk references and the EOF.
        DifferenceWitness(
            "OMNI-OUT-001",
            token_updates,
            (AddRequest("w-out", tuple(range(10, 30)), max_tokens=4), *steps[:6]),
        ),
        # The send path raises for one request: it alone is failed, its neighbour completes.
        DifferenceWitness(
            "OMNI-ERR-001",
            send_fault,
            (
                AddRequest("ok-1", tuple(range(10, 30)), max_tokens=6),
                AddRequest("fail-1", tuple(range(40, 60)), max_tokens=6),
                *steps,
            ),
        ),
    )


def stage_of(feature: Feature) -> dict[str, Any]:
    return dict(feature.additional_config.get("omni_stage") or {})


# ---- payloads as the suite reads them ------------------------------------------------------


def payload_view(payload: Any) -> PayloadView | None:
    if payload is None:
        return None
    return PayloadView(
        request_id=payload.request_id,
        start=payload.start,
        num_tokens=payload.num_tokens,
        hidden=payload.hidden,
        conditioning=payload.conditioning,
        multimodal=dict(payload.multimodal),
        has_tensors=payload.has_tensors,
    )


class OmniChunkDelivery:
    """The scheduler's ``ChunkTransferAdapter``: its sink, its chunks, its processor."""

    processor_feature = Feature(
        "chunk-contracts",
        {"omni_stage": talker_stage(chunk_processor=None)},
        (None, "talker", "code2wav"),
    )

    def install_sink(self, scheduler: Any, sink: Any) -> bool:
        transfer = getattr(scheduler, "transfer", None)
        if transfer is None:
            return False
        transfer.sink = sink
        return True

    def view(self, chunk: Any) -> ChunkView:
        ids = None
        if isinstance(chunk.data, torch.Tensor) and not chunk.data.is_floating_point():
            ids = tuple(int(t) for t in chunk.data.tolist())
        return ChunkView(
            chunk.request_id, chunk.seq, chunk.is_final, ids, payload_view(chunk.payload)
        )

    def payload_view(self, payload: Any) -> PayloadView | None:
        return payload_view(payload)

    def expected_tokens(self, feature: Feature, accepted: Sequence[int]) -> list[int] | None:
        if stage_of(feature).get("chunk_processor") != CODEC_STREAMER:
            return None
        return [t for t in accepted if 0 <= t < CODEC_VOCAB]

    def set_processor(self, scheduler: Any, processor: Callable[..., Any]) -> None:
        scheduler.transfer.set_processor(processor)

    def with_payloads(self, output: Any, rows: Sequence[tuple[int, Any] | None]) -> Any:
        from omni_runtime.adapters.output import synthetic_payloads
        from omni_runtime.payload import OmniModelRunnerOutput

        payloads = synthetic_payloads(output.req_ids, rows)
        return OmniModelRunnerOutput(
            req_ids=output.req_ids,
            req_id_to_index=output.req_id_to_index,
            sampled_token_ids=output.sampled_token_ids,
            omni_payloads=payloads,
        )


# ---- the runner's handles ------------------------------------------------------------------


class LazyFuture(Future):
    """A future whose work runs when its result is first asked for."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        super().__init__()
        self._call: tuple[Callable[..., Any], tuple[Any, ...]] | None = (fn, args)

    def _run(self) -> None:
        if self._call is not None:
            fn, args = self._call
            self._call = None
            try:
                self.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - delivered through the future
                self.set_exception(exc)

    def result(self, timeout: float | None = None) -> Any:
        self._run()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._run()
        return super().exception(timeout)

    def done(self) -> bool:
        return self._call is None


class DeferredPool:
    """An executor whose builds run on collection: buffer reuse always precedes the build."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> LazyFuture:
        return LazyFuture(fn, args)

    def shutdown(self, wait: bool = True) -> None:
        return None


class OmniMaterializationProbe:
    """Counts connector collections (and their threads) and builds of one runner."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.collector_threads: list[int] = []
        self.builds = 0
        self.build_threads: list[int] = []
        self._fail: tuple[int, BaseException] | None = None
        self._fail_request: tuple[str, BaseException] | None = None
        collect = runner.collect_connector_output
        build = runner.materializer.builder.build

        def collecting() -> Any:
            self.collector_threads.append(threading.get_ident())
            return collect()

        def building(plan: Any, inputs: Any) -> Any:
            self.builds += 1
            self.build_threads.append(threading.get_ident())
            if self._fail is not None and self.builds == self._fail[0]:
                raise self._fail[1]
            if self._fail_request is not None and self._fail_request[0] in plan.req_ids:
                raise self._fail_request[1]
            return build(plan, inputs)

        runner.collect_connector_output = collecting
        runner.materializer.builder.build = building

    def fail_build(self, number: int, error: BaseException) -> None:
        self._fail = (number, error)

    def fail_request(self, request_id: str, error: BaseException) -> None:
        self._fail_request = (request_id, error)

    def builder_threads(self) -> set[int]:
        return set(getattr(self.runner.materializer, "builder_thread_ids", ()))


GRAPHS: dict[str, dict[str, Any]] = {
    "thinker>talker>code2wav": {
        "stages": list(STAGES),
        "downstream": ["talker"],
        "chunk_processor": HIDDEN_FORWARDER,
    },
    "thinker>talker": {
        "stages": ["thinker", "talker"],
        "downstream": ["talker"],
        "chunk_processor": None,
    },
    "thinker>talker(codec)": {
        "stages": list(STAGES),
        "downstream": ["talker"],
        "chunk_processor": CODEC_STREAMER,
    },
}


class OmniRunnerProbes:
    graphs = tuple(GRAPHS)

    def payload_feature(
        self,
        *,
        include_hidden: bool,
        full_prefix: bool,
        materialization: str = "inline",
        graph: str | None = None,
        multimodal: bool = False,
    ) -> Feature:
        stage = thinker_stage(
            include_hidden=include_hidden, full_prefix=full_prefix, materialization=materialization
        )
        if graph is not None:
            stage.update(GRAPHS[graph])
        if multimodal:
            stage["multimodal_outputs"] = ["logits"]
        name = f"thinker-{include_hidden}-{full_prefix}-{materialization}-{graph}-{multimodal}"
        return Feature(name, {"omni_stage": stage}, use_worker=True)

    def includes_hidden(self, feature: Feature) -> bool:
        stage = stage_of(feature)
        return bool(stage) and bool(stage.get("omni_pooler_payload_include_hidden", True))

    def payloads(self, output: Any) -> list[PayloadView | None] | None:
        payloads = getattr(output, "omni_payloads", None)
        return None if payloads is None else [payload_view(p) for p in payloads]

    def failed_requests(self, output: Any) -> Mapping[str, str]:
        return dict(getattr(output, "omni_failed", None) or {})

    def reusable_buffers(self, runner: Any) -> Iterable[Any]:
        return runner.persistent_buffers().values()

    def defer_background_builds(self, runner: Any) -> None:
        # The materializer asks ``_executor()`` for its pool on every build.
        runner.materializer._executor = DeferredPool

    def instrument(self, runner: Any) -> OmniMaterializationProbe:
        return OmniMaterializationProbe(runner)

    def shutdown(self, runner: Any) -> None:
        runner.shutdown()


class OmniFaultContainment:
    """C-61: the runner retries a faulting step, then splits the batch to pin a persistent
    fault on its request (``omni_runtime.worker.recovery``); the scheduler fails that request."""

    cause_field = "omni_error"

    def feature(self, materialization: str) -> Feature:
        return OmniRunnerProbes().payload_feature(
            include_hidden=True, full_prefix=False, materialization=materialization
        )

    def embedding(self, worker: Any) -> Any:
        return worker.model.get_input_embeddings()

    def shutdown(self, worker: Any) -> None:
        worker.shutdown()


# ---- the model's independent reference -----------------------------------------------------

_MODELS: dict[str, Any] = {}


def shared_model(path: str) -> Any:
    """One read-only model per process; runners never write to their model."""
    if path not in _MODELS:
        from omni_runtime.models import load_model

        _MODELS[path] = load_model(path, device="cpu", dtype=torch.float32)
    return _MODELS[path]


class OmniModelReference:
    """Hugging Face ``LlamaForCausalLM`` (eager attention, full recompute) for greedy tokens;
    the runtime's own layers with unpaged attention for hidden rows."""

    features = ("hidden-inline", "token-only-background")

    def __init__(self) -> None:
        self._hf: dict[str, Any] = {}

    def greedy(self, model_path: str, prompt: Sequence[int], n: int) -> list[int]:
        if model_path not in self._hf:
            from transformers import LlamaForCausalLM

            self._hf[model_path] = LlamaForCausalLM.from_pretrained(
                model_path, attn_implementation="eager", dtype=torch.float32
            ).eval()
        hf = self._hf[model_path]
        ids = list(prompt)
        with torch.no_grad():
            while len(ids) - len(prompt) < n:
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt) :]

    def hidden_rows(self, model_path: str, tokens: Sequence[int]) -> torch.Tensor:
        from omni_runtime.models import reference_attention

        model = shared_model(model_path)
        with torch.inference_mode():
            ids = torch.tensor(list(tokens), dtype=torch.long)
            return model.forward_layers(
                model.embed(ids),
                torch.arange(len(ids)),
                lambda _i, q, k, v: reference_attention(q, k, v),
            )


# ---- the input adapter ---------------------------------------------------------------------


class OmniInputAdapterProbe:
    """The talker stage's ``InputAdapter`` over a live omni scheduler."""

    spec = StageInputSpec("talker", STAGES, hidden_size=64, vocab_size=512, max_model_len=128)

    def __init__(self, subject: BaseSubject) -> None:
        from omni_runtime.adapters import RequestRejected

        self.subject = subject
        self.rejection = RequestRejected

    def scheduler(self) -> Any:
        cfg = TIGHT.with_(additional_config={"omni_stage": talker_stage()})
        return self.subject.build_scheduler(cfg)

    def build(self, scheduler: Any, request_id: str, sampling_params: Any, **fields: Any) -> Any:
        from omni_runtime.adapters import InputAdapter, StageInput
        from omni_runtime.config import OmniStageConfig

        stage = OmniStageConfig.from_vllm_config(scheduler.vllm_config)
        assert stage is not None, "the probe's scheduler is built with an omni stage"
        adapter = InputAdapter(
            stage,
            max_model_len=self.spec.max_model_len,
            vocab_size=self.spec.vocab_size,
            hidden_size=self.spec.hidden_size,
            live_ids=scheduler.requests,
        )
        return adapter.build(StageInput(request_id, sampling_params, **fields))


# ---- the subjects --------------------------------------------------------------------------


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
        if stage is None:
            return super().make_request(op, prompt, cfg, scheduler, arrival)
        adapter = InputAdapter(
            stage,
            max_model_len=cfg.max_model_len,
            block_hasher=block_hasher(cfg.block_size),
            live_ids=scheduler.requests,
        )
        return adapter.build(
            StageInput(
                request_id=op.request_id,
                sampling_params=make_sampling_params(op, cfg),
                prompt_token_ids=prompt,
                final_stage_id=op.final_stage,
                arrival_time=arrival,
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

        # The real worker needs real weights: the runtime's generated thinker model.
        return cfg.with_(model=str(model_dir("thinker")))

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


def _supported() -> None:
    """Refuse, as unsupported rather than broken, a vLLM release the runtime does not support."""
    from conformance.subjects import SubjectUnsupported
    from omni_runtime.vllm_support import UnsupportedVllm, check_vllm

    try:
        check_vllm()
    except UnsupportedVllm as exc:
        raise SubjectUnsupported(str(exc)) from None


def omni_subject() -> OmniSubject:
    _supported()
    return OmniSubject()


def omni_scheduler_subject() -> OmniSchedulerSubject:
    _supported()
    return OmniSchedulerSubject()
