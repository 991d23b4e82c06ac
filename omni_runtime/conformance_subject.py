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
* ``omni-process-stage`` (``ProcessStageSubject``) — ``omni`` with the schedulers as they run
  inside a stage process (``sched.process_stage``): requests cross to them as vLLM's
  ``EngineCoreRequest`` through vLLM's msgpack codec and are admitted by ``"release"``; each
  step's outputs cross back the same way, and its chunks are read out of shared memory as the
  parent reads them. What crossed, and what the crossing still holds, is the ``process_boundary``
  capability (C-46).

Everything omni-specific the suite relies on lives here: the stage dictionaries it runs with,
which processor streams which ids, how a ``StagePayload`` reads as the suite's ``PayloadView``.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from conformance._core.capabilities import (
    ChunkView,
    Crossing,
    DeclaredAttributes,
    DifferenceWitness,
    Feature,
    PayloadView,
    SourceLayout,
    StageInputSpec,
)
from conformance._core.config import (
    HarnessConfig,
    block_hasher,
    build_kv_cache_config,
    build_vllm_config,
)
from conformance._core.differences import Difference
from conformance._core.machine import TIGHT
from conformance._core.subjects import BaseSubject, DifferenceEntry, make_sampling_params
from conformance._core.workload import AddRequest, Step

PACKAGE = Path(__file__).resolve().parent
STAGES = ("thinker", "talker", "code2wav")
# Codec ids the talker streams to code2wav; larger ids are the talker's control tokens.
CODEC_VOCAB = 256
# Codec ids per streamed chunk: the streamer's default, which the talker stage uses. Stated
# here, not read from the class, so a changed default is a difference the gate reports.
CODEC_CHUNK = 8
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


def _feature(
    name: str,
    stage: dict[str, Any],
    finals: tuple[str | None, ...],
    worker: bool,
    edges: tuple[int, ...] = (),
):
    return name, {
        "additional_config": {"omni_stage": stage},
        "final_stages": list(finals),
        "use_worker": worker,
        "token_edges": list(edges),
    }


# The codec streamer keeps ids in [0, CODEC_VOCAB) as audio and drops the rest: the harness
# samples both ends of that range and the first id past it.
TOKEN_UPDATES = _feature(
    "token-updates",
    talker_stage(),
    (None, "talker", "code2wav"),
    False,
    (0, CODEC_VOCAB - 1, CODEC_VOCAB),
)
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

    # ``ChunkTransferAdapter`` asks a processor whose final call raised to release the request.
    releases_on_final_fault = True

    processor_feature = Feature(
        "chunk-contracts",
        {"omni_stage": talker_stage(chunk_processor=None)},
        (None, "talker", "code2wav"),
        # A stage's engine serves vLLM's own clients too: their requests carry no omni slot.
        plain_requests=True,
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
        view = payload_view(chunk.payload)
        data = chunk.data
        if isinstance(data, dict) and view is not None:
            # A processor's dict (``HiddenRowsForwarder``) is what the next stage reads its rows
            # from (the orchestrator's ``_collect_rows``), so the suite reads them there too.
            view = dataclasses.replace(
                view,
                hidden=data.get("hidden"),
                start=data.get("start", -1),  # -1: no start crossed, which no row matches
                conditioning=data.get("conditioning"),
            )
        return ChunkView(
            chunk.request_id, chunk.seq, chunk.is_final, ids, view, chunk.finish_reason
        )

    # Every EOF chunk of this runtime says why its request ended (``StageChunk.finish_reason``).
    eof_reasons = True

    def payload_view(self, payload: Any) -> PayloadView | None:
        return payload_view(payload)

    def batching_processors(self) -> dict[str, Callable[[], Any]]:
        """The shipped processors that define ``on_token_batch`` (C-40: a batch is the
        per-request calls at once)."""
        from omni_runtime.sched.processors import CodecTokenStreamer

        return {"CodecTokenStreamer": CodecTokenStreamer}

    # The step's output of a request names the chunk the step delivered for it
    # (``OmniEngineCoreOutput.omni_chunk_refs``, what a consumer of the outputs reads).
    output_refs_field = "omni_chunk_refs"
    output_eof_field = "omni_eof"

    def ref(self, chunk: Any) -> str:
        return str(chunk.ref)

    def expected_tokens(self, feature: Feature, accepted: Sequence[int]) -> list[int] | None:
        if stage_of(feature).get("chunk_processor") != CODEC_STREAMER:
            return None
        return [t for t in accepted if 0 <= t < CODEC_VOCAB]

    def expected_chunks(
        self, feature: Feature, steps: Sequence[Sequence[int]], last_step_ends: bool
    ) -> list[tuple[int, ...]] | None:
        """What ``CodecTokenStreamer`` promises, written plainly: a step that leaves at least
        ``CODEC_CHUNK`` audio ids buffered sends the largest multiple of it at once, and the EOF
        carries the rest (possibly none), with the ids of the step that ended the request. The
        streamer itself batches steps and spreads them lazily; this is the per-step reading it
        must agree with."""
        if self.expected_tokens(feature, []) is None:
            return None
        chunks: list[tuple[int, ...]] = []
        buffered: list[int] = []
        for i, ids in enumerate(steps):
            buffered += self.expected_tokens(feature, ids) or []
            if last_step_ends and i == len(steps) - 1:
                break
            if len(buffered) >= CODEC_CHUNK:
                cut = len(buffered) - len(buffered) % CODEC_CHUNK
                chunks.append(tuple(buffered[:cut]))
                del buffered[:cut]
        chunks.append(tuple(buffered))
        return chunks

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
        self._fail_request: tuple[str, BaseException, int | None] | None = None
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
                rid, error, left = self._fail_request
                if left is None or len(plan.req_ids) > 1:
                    raise error
                if left > 0:  # the request alone: a fault that clears after ``times`` builds
                    self._fail_request = (rid, error, left - 1)
                    raise error
            return build(plan, inputs)

        runner.collect_connector_output = collecting
        runner.materializer.builder.build = building

    def fail_build(self, number: int, error: BaseException) -> None:
        self._fail = (number, error)

    def fail_request(self, request_id: str, error: BaseException, times: int | None = None) -> None:
        self._fail_request = (request_id, error, times)

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


# ``additional_config`` key naming the generated model a worker feature runs (default: the
# thinker), and the one whose config turns on its payload postprocess.
MODEL_KEY = "omni_test_model"
POSTPROCESS_MODEL = "thinker-post"


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
        postprocess: bool = False,
    ) -> Feature:
        stage = thinker_stage(
            include_hidden=include_hidden, full_prefix=full_prefix, materialization=materialization
        )
        if graph is not None:
            stage.update(GRAPHS[graph])
        if multimodal:
            # One output every model has and one the model adds (``omni_output_producers``).
            stage["multimodal_outputs"] = ["logits", "hidden_norm"]
        name = f"thinker-{include_hidden}-{full_prefix}-{materialization}-{graph}-{multimodal}"
        extra: dict[str, Any] = {"omni_stage": stage}
        if postprocess:
            # The thinker's weights, with the payload postprocess its config turns on
            # (``LlamaLM.omni_postprocess``, "positions"); ``worker_config`` loads it.
            extra[MODEL_KEY] = POSTPROCESS_MODEL
            name += "-post"
        return Feature(name, extra, use_worker=True)

    def postprocessed(self, payload: PayloadView) -> bool:
        """The model's postprocess ran on ``payload``: it carries the positions its rows
        cover (``LlamaLM.tag_positions``)."""
        positions = payload.multimodal.get("positions")
        expected = torch.arange(payload.start, payload.start + payload.num_tokens)
        return isinstance(positions, torch.Tensor) and torch.equal(positions, expected)

    def final_feature(self, include_hidden: bool) -> Feature:
        stage = thinker_stage(include_hidden=include_hidden, downstream=[], chunk_processor=None)
        # Per-token multimodal outputs too: what the stage would build had it a downstream.
        stage["multimodal_outputs"] = ["logits", "hidden_norm"]
        return Feature(f"thinker-final-{include_hidden}", {"omni_stage": stage}, use_worker=True)

    def unknown_output_feature(self, name: str) -> Feature:
        stage = thinker_stage(include_hidden=False, full_prefix=False, materialization="inline")
        stage["multimodal_outputs"] = ["logits", name]
        return Feature(f"thinker-unknown-output-{name}", {"omni_stage": stage}, use_worker=True)

    def includes_hidden(self, feature: Feature) -> bool:
        stage = stage_of(feature)
        return bool(stage) and bool(stage.get("omni_pooler_payload_include_hidden", True))

    def payloads(self, output: Any) -> list[PayloadView | None] | None:
        payloads = getattr(output, "omni_payloads", None)
        return None if payloads is None else [payload_view(p) for p in payloads]

    def failed_requests(self, output: Any) -> Mapping[str, str]:
        return dict(getattr(output, "omni_failed", None) or {})

    def retry_features(self) -> tuple[Feature, ...]:
        # Budgets other than the default (2): a materializer that ignored the stage's setting
        # would retry as often as with the default, and only another budget shows it.
        base = self.payload_feature(
            include_hidden=True, full_prefix=True, materialization="background", multimodal=True
        )
        features = []
        for retries in (0, 1, 3):
            stage = {**stage_of(base), "step_retries": retries}
            config = {**base.additional_config, "omni_stage": stage}
            features.append(Feature(f"{base.name}-retries{retries}", config, use_worker=True))
        return tuple(features)

    def recovery_builds(self, feature: Feature, n: int) -> int:
        """The step's own build, ``step_retries`` builds of the whole step again, then each
        request alone: once for those that build, ``1 + step_retries`` times for the one that
        keeps failing (``omni_runtime.worker.materialize.recover_build``)."""
        retries = int(stage_of(feature).get("step_retries", 2))
        return 1 + retries + (n - 1) + (1 + retries)

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

    def stage_name(self, additional_config: Mapping[str, Any]) -> str | None:
        # Causes start with the stage id ("thinker: send path: ...", "thinker: payload build").
        stage = additional_config.get("omni_stage")
        return str(stage.get("stage_id")) if isinstance(stage, Mapping) else None

    def feature(self, materialization: str) -> Feature:
        feature = OmniRunnerProbes().payload_feature(
            include_hidden=True, full_prefix=False, materialization=materialization
        )
        # Requests may also end at the thinker (nothing of theirs goes downstream).
        return dataclasses.replace(feature, final_stages=(None, "thinker"))

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

    spec = StageInputSpec(
        "talker",
        STAGES,
        hidden_size=64,
        vocab_size=512,
        max_model_len=128,
        id_tensors=True,
        trace_headers=True,
        request_fields=True,
        names_types=True,
    )

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

    def additional_information(self, request: Any) -> Any:
        from omni_runtime.adapters.input import omni_state_of

        state = omni_state_of(request)
        return {} if state is None else state.additional_information


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
        if stage is None or op.plain:
            # A plain vLLM client's request reaches the stage's engine as upstream builds it
            # (``Request.from_engine_core_request``): no stage input, no omni slot.
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
                trace_headers=op.headers(),
                client_index=op.client_index,
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


# ---- a stage in its own process ------------------------------------------------------------

# The parent's decoder types every output of a stage's message as ``OmniEngineCoreOutput``.
WIRE_DIFFERENCE = Difference(
    id="OMNI-WIRE-001",
    fields=("outputs.*.__type__",),
    condition=(
        "the output crossed a stage process's boundary: the parent decodes every output of the "
        "step's message as OmniEngineCoreOutput (its decoder's element type), its omni fields "
        "at their defaults when the step sent nothing for the request"
    ),
    applies=lambda ctx: (
        ctx.get("upstream") is None and ctx.get("subject") == "OmniEngineCoreOutput"
    ),
    rationale=(
        "msgspec decodes a list into its declared element type, and the stage's outputs type "
        "(ShmEngineCoreOutputs) declares OmniEngineCoreOutput so the trailing omni fields "
        "survive; fields at their defaults are not sent, so nothing but the class differs."
    ),
    tests=("tests/test_process_stage_subject.py::test_outputs_arrive_as_the_parent_decodes_them",),
    clauses=("C-02", "C-46"),
)


def _flatten(value: Any, path: str, payload: Any, out: dict[str, Any], *, clone: bool) -> None:
    """``value`` as ``{path: scalar or tensor}``; containers leave a marker naming their kind."""
    if payload is not None and value is payload:
        out[path] = "<the chunk's payload>"
    elif isinstance(value, torch.Tensor):
        out[path] = value.detach().clone() if clone else value
    elif isinstance(value, Mapping):
        out[path] = f"<dict of {len(value)}>"
        for key, item in value.items():
            _flatten(item, f"{path}.{key}", payload, out, clone=clone)
    elif isinstance(value, list | tuple):
        out[path] = f"<{type(value).__name__} of {len(value)}>"
        for i, item in enumerate(value):
            _flatten(item, f"{path}[{i}]", payload, out, clone=clone)
    else:
        out[path] = value


def chunk_fields(chunk: Any, *, clone: bool = False) -> dict[str, Any]:
    """Everything a ``StageChunk`` carries, flattened for the gate's comparison (C-46)."""
    out: dict[str, Any] = {
        "request_id": chunk.request_id,
        "source_stage": chunk.source_stage,
        "seq": chunk.seq,
        "token_ids": tuple(chunk.token_ids),
        "is_final": chunk.is_final,
        # The reason's text is what a chunk carries (vLLM's enum prints as it).
        "finish_reason": None if chunk.finish_reason is None else str(chunk.finish_reason),
    }
    payload = chunk.payload
    if payload is None:
        out["payload"] = None
    else:
        out["payload"] = "<StagePayload>"
        out["payload.request_id"] = payload.request_id
        out["payload.start"] = payload.start
        out["payload.num_tokens"] = payload.num_tokens
        _flatten(payload.hidden, "payload.hidden", None, out, clone=clone)
        _flatten(payload.conditioning, "payload.conditioning", None, out, clone=clone)
        _flatten(dict(payload.multimodal), "payload.multimodal", None, out, clone=clone)
    _flatten(chunk.data, "data", payload, out, clone=clone)
    return out


def request_fields(request: Any) -> dict[str, Any]:
    """A request's stage-input slot, prompt and plugin arguments, flattened (C-46)."""
    from omni_runtime.adapters.input import omni_state_of

    out: dict[str, Any] = {}
    ids = request.prompt_token_ids
    out["prompt_token_ids"] = None if ids is None else tuple(ids)
    _flatten(request.prompt_embeds, "prompt_embeds", None, out, clone=False)
    params = request.sampling_params
    _flatten(
        params.extra_args if params is not None else None, "extra_args", None, out, clone=False
    )
    slot = omni_state_of(request)
    if slot is None:
        out["slot"] = None
        return out
    out["slot"] = "<OmniRequestState>"
    out["slot.stage_id"] = slot.stage_id
    out["slot.final_stage_id"] = slot.final_stage_id
    out["slot.downstream"] = tuple(slot.downstream)
    _flatten(dict(slot.additional_information), "slot.info", None, out, clone=False)
    _flatten(slot.conditioning, "slot.conditioning", None, out, clone=False)
    return out


class StageProcessWire:
    """One process-stage scheduler's crossing, as the subject sees it.

    The scheduler's ``ShmChunkWriter`` is watched, not replaced: its ``send``, ``discard`` and
    ``flush`` are wrapped on the instance to note what the stage sent (a copy of every field,
    before anything is written) and which chunks a flush put on the step's message. The
    transfer adapter still sends into the writer, and the writer still writes the segment.
    """

    def __init__(self, prefix: str, writer: Any) -> None:
        self.prefix = prefix
        self.sent: list[dict[str, Any]] = []  # sent since the last flush
        self.flushed: list[dict[str, Any]] = []  # on a message the parent has not read yet
        self.received: list[Any] = []  # read by the parent, waiting for ``drain_chunks``
        # Segments a message named outside the stage's prefix: the parent sweeps a dead stage's
        # segments by that prefix, so these would outlive it.
        self.unswept: list[str] = []
        self.sink: Any = None  # the harness's sink, once installed: read chunks go there
        self.chunks: list[Crossing] = []
        self.requests: list[Crossing] = []
        if writer is not None:
            self._watch(writer)

    def _watch(self, writer: Any) -> None:
        send, discard, flush = writer.send, writer.discard, writer.flush

        def sending(chunk: Any) -> None:
            self.sent.append(chunk_fields(chunk, clone=True))
            try:
                send(chunk)
            except BaseException:
                # Refused before anything was written (it fails its request, C-61).
                self.sent.pop()
                raise

        def discarding() -> None:
            self.sent.clear()
            discard()

        def flushing() -> Any:
            descriptors = flush()
            self.flushed.extend(self.sent)
            self.sent.clear()
            return descriptors

        writer.send, writer.discard, writer.flush = sending, discarding, flushing

    def read(self, chunks: list[Any]) -> None:
        """The parent read ``chunks`` off one step's message: pair them with what was flushed."""
        flushed, self.flushed = self.flushed, []
        for i in range(max(len(flushed), len(chunks))):
            sent = flushed[i] if i < len(flushed) else {}
            got = chunk_fields(chunks[i]) if i < len(chunks) else {}
            ref = sent or got
            label = f"chunk {ref.get('request_id')}#{ref.get('seq')}"
            self.chunks.append(Crossing(label, sent, got))
        if self.sink is not None:
            for chunk in chunks:
                self.sink.send(chunk)
        else:
            self.received.extend(chunks)


class ProcessStageBoundary:
    """``ProcessBoundary`` of ``ProcessStageSubject`` (see ``StageProcessWire``)."""

    def __init__(self, subject: ProcessStageSubject) -> None:
        self.subject = subject

    def _take(self, scheduler: Any, kind: str) -> list[Crossing]:
        """The crossings of ``kind`` noted since the last call, handed over once."""
        wire = self.subject.wire(scheduler)
        if wire is None:
            return []
        out: list[Crossing] = getattr(wire, kind)
        setattr(wire, kind, [])
        return out

    def chunk_crossings(self, scheduler: Any) -> list[Crossing]:
        return self._take(scheduler, "chunks")

    def request_crossings(self, scheduler: Any) -> list[Crossing]:
        return self._take(scheduler, "requests")

    def leftovers(self, scheduler: Any) -> dict[str, Any]:
        from omni_runtime.adapters.shm_wire import live_segments

        wire = self.subject.wire(scheduler)
        if wire is None:
            return {}
        # The rest is read as the parent reads it, through the stage's ``"audit"`` utility call
        # (``MPStageEngine`` checks its stages for leaks with the same answer).
        audit = scheduler("audit")
        live = set(audit["scheduler_requests"])
        return {
            # The parent sees a stage's leaks only through this answer: a field that
            # misreports what the stage holds makes its leak check blind there.
            "audit_fields_misreported": _misreported(scheduler, audit),
            "shm_segments": live_segments(wire.prefix),
            "segments_outside_the_stage_prefix": wire.unswept,
            "chunks_written_not_flushed": audit["outbox"],
            "chunks_flushed_not_read": len(wire.flushed),
            # Admitted by the parent but not released into upstream's queue.
            "staged_requests": audit["staged"],
            # Send-path state of requests the scheduler no longer holds (finished or aborted).
            "transfer_progress_of_gone_requests": sorted(set(audit["transfer_progress"]) - live),
            "processor_buffers_of_gone_requests": sorted(set(audit["processor_buffers"]) - live),
        }


def _misreported(scheduler: Any, audit: Mapping[str, Any]) -> list[str]:
    """The fields of a stage's ``"audit"`` answer that disagree with what it holds: upstream's
    queues and block pool read through the gate's vLLM accessors, and the send path's state
    read from the objects the answer summarises."""
    from conformance._core.vllm_compat.state import (
        block_pool,
        live_request_ids,
        num_free_blocks,
        scheduler_queues,
    )

    queues = scheduler_queues(scheduler)
    transfer = scheduler.transfer
    pending = getattr(
        transfer.processor if transfer is not None else None, "pending_request_ids", None
    )
    writer = scheduler.writer
    held = {
        "scheduler_requests": sorted(live_request_ids(scheduler)),
        "running": queues["running"],
        "waiting": len(queues["waiting"]),
        "finished_unsent": queues["finished_pending"],
        "free_blocks": num_free_blocks(block_pool(scheduler)),
        "transfer_progress": sorted(transfer.live_request_ids()) if transfer is not None else [],
        "processor_buffers": sorted(pending()) if pending is not None else [],
        "outbox": len(writer) if writer is not None else 0,
    }
    return sorted(k for k, v in held.items() if audit.get(k) != v)


class ProcessStageDelivery(OmniChunkDelivery):
    """Chunks as the parent reads them: the harness's sink gets what crossed."""

    # A client abort's EOF is the parent's to give; the stage drops it (``sched.process_stage``).
    abort_eof = False
    # The harness's sink gets the chunks the parent read off the stage's messages: past the
    # stage's own connector (its shared-memory writer), so a raise there is nobody's send fault.
    sink_is_connector = False

    def __init__(self, subject: ProcessStageSubject) -> None:
        self.subject = subject

    def install_sink(self, scheduler: Any, sink: Any) -> bool:
        wire = self.subject.wire(scheduler)
        if wire is None or getattr(scheduler, "transfer", None) is None:
            return False
        wire.sink = sink
        return True


class ProcessStageSubject(OmniSubject):
    """``omni`` with its schedulers as they run inside a stage process (module docstring)."""

    name = "omni-process-stage"
    # A stage process's engine has one client, its parent (``process_stage.PARENT_CLIENT``).
    single_engine_client = True
    sync_scheduler = "omni_runtime.sched.process_stage.ProcessStageScheduler"
    async_scheduler = "omni_runtime.sched.process_stage.ProcessStageAsyncScheduler"

    def __init__(self) -> None:
        self._wires: weakref.WeakKeyDictionary[Any, StageProcessWire] = weakref.WeakKeyDictionary()

    def wire(self, scheduler: Any) -> StageProcessWire | None:
        return self._wires.get(scheduler)

    def build_scheduler(self, cfg: HarnessConfig) -> Any:
        from omni_runtime.adapters.shm_wire import sweep_segments
        from omni_runtime.sched.process_stage import PROCESS_STAGE_KEY

        # One prefix per scheduler: sessions and examples never see each other's segments.
        prefix = f"omni-gate-{os.getpid()}-{uuid.uuid4().hex[:10]}"
        extra = dict(cfg.additional_config)
        extra[PROCESS_STAGE_KEY] = {"shm_prefix": prefix}
        scheduler = super().build_scheduler(cfg.with_(additional_config=extra))
        self._wires[scheduler] = StageProcessWire(prefix, scheduler.writer)
        # A failing example must not leave segments behind in /dev/shm.
        weakref.finalize(scheduler, sweep_segments, prefix)
        return scheduler

    def admit(self, scheduler: Any, request: Any) -> None:
        """The parent's ``MPStageEngine.add`` then its ``"release"`` before the next step."""
        from vllm.v1.engine import EngineCoreRequest
        from vllm.v1.request import Request
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        from omni_runtime.engine.mp_stage import MPStageEngine

        message = MPStageEngine._engine_core_request(request)
        # What the input socket carries are bytes; the engine's input thread decodes them with
        # its own decoder and rebuilds the request as ``EngineCore.preprocess_add_request`` does.
        frames = _as_sent(MsgpackEncoder().encode(message))
        decoded = MsgpackDecoder(EngineCoreRequest).decode(frames)
        hasher = block_hasher(scheduler.cache_config.block_size)
        arrived = Request.from_engine_core_request(decoded, hasher)
        scheduler.add_request(arrived)
        scheduler("release")
        wire = self.wire(scheduler)
        if wire is not None:
            label = f"request {request.request_id}"
            wire.requests.append(Crossing(label, request_fields(request), request_fields(arrived)))

    def receive_outputs(self, scheduler: Any, outputs: Any) -> Any:
        """The step's messages as vLLM's output socket encodes them and the parent decodes them
        (``ShmEngineCoreOutputs``), then the chunks they name, read as ``MPStageEngine`` reads
        them (``read_chunks``: tensors copied out, segments unlinked)."""
        if not outputs:
            return outputs
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        from omni_runtime.adapters.shm_wire import ShmEngineCoreOutputs, read_chunks
        from omni_runtime.sched.process_stage import PARENT_CLIENT

        encoder, decoder = MsgpackEncoder(), MsgpackDecoder(ShmEngineCoreOutputs)
        received: dict[int, Any] = {}
        chunks: list[Any] = []
        wire = self.wire(scheduler)
        for client, message in outputs.items():
            if client != PARENT_CLIENT:
                # vLLM's engine process sends each message to its client's socket, and a stage
                # process has one client, its parent: a message keyed to another never arrives.
                continue
            frames = _as_sent(encoder.encode(message))
            decoded = decoder.decode(frames)
            received[client] = decoded
            if getattr(decoded, "omni_chunks", None):
                if wire is not None:
                    segments = {d.segment for d in decoded.omni_chunks if d.segment is not None}
                    wire.unswept += sorted(n for n in segments if not n.startswith(wire.prefix))
                chunks.extend(read_chunks(decoded.omni_chunks))
        if wire is not None:
            wire.read(chunks)
        return received

    def drain_chunks(self, scheduler: Any) -> list[Any]:
        wire = self.wire(scheduler)
        if wire is None:
            return []
        if wire.sink is not None:
            drain = getattr(wire.sink, "drain", None)
            return list(drain()) if drain is not None else []
        out, wire.received = wire.received, []
        return out

    def live_omni_ids(self, scheduler: Any) -> set[str]:
        ids = super().live_omni_ids(scheduler)
        # A request staged and never released is per-request state the stage still holds.
        return ids | set(getattr(scheduler, "_staged", ()))

    def differences(self) -> Sequence[DifferenceEntry]:
        return (*super().differences(), WIRE_DIFFERENCE)

    def difference_witnesses(self) -> tuple[DifferenceWitness, ...]:
        witness = DifferenceWitness(
            "OMNI-WIRE-001",
            Feature("off"),
            (AddRequest("w-wire", tuple(range(10, 30)), max_tokens=3), Step(), Step(), Step()),
        )
        return (*super().difference_witnesses(), witness)

    def declared_attributes(self) -> DeclaredAttributes:
        from omni_runtime.adapters import DECLARED_REQUEST_ATTRIBUTES, OmniRequestState
        from omni_runtime.payload import StageChunk, StagePayload
        from omni_runtime.sched import DECLARED_SCHEDULER_ATTRIBUTES

        return DeclaredAttributes(
            request={name: OmniRequestState for name in DECLARED_REQUEST_ATTRIBUTES},
            # The process stage's own: its chunk writer, the update flag, the staged requests.
            scheduler=frozenset(DECLARED_SCHEDULER_ATTRIBUTES)
            | {"writer", "_in_step_update", "_staged"},
            send_path=frozenset({"transfer", "writer"}),
            modality_types=(StagePayload, StageChunk),
        )

    def chunk_delivery(self) -> ProcessStageDelivery:
        return ProcessStageDelivery(self)

    def process_boundary(self) -> ProcessStageBoundary:
        return ProcessStageBoundary(self)


def _as_sent(frames: Sequence[Any]) -> list[bytes]:
    """An encoded message as a socket delivers it: each frame copied into bytes of its own (the
    encoder may hand out views of tensors' memory, which the receiver never shares)."""
    return [bytes(memoryview(frame)) for frame in frames]


def _supported() -> None:
    """Refuse, as unsupported rather than broken, a vLLM release the runtime does not support."""
    from conformance._core.subjects import SubjectUnsupported
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


def process_stage_subject() -> ProcessStageSubject:
    _supported()
    return ProcessStageSubject()
