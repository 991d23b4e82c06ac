"""Stage engines: one vLLM ``EngineCore`` per AR stage, and the code2wav stage object.

``StageEngine`` owns one in-process ``EngineCore`` built with vLLM's ``UniProcExecutor``, our
omni scheduler (``OmniARScheduler`` for sync stepping, ``OmniARAsyncScheduler`` with the engine's
batch queue, ``step_with_batch_queue``, for async) and ``OmniARWorker``. Requests enter only
through the stage's ``InputAdapter`` and are handed to ``EngineCore.add_request(request,
request_wave=0)`` as ready ``Request`` objects: the engine's ``preprocess_add_request`` path
starts from an ``EngineCoreRequest``, which has no room for the omni slot, so the adapter
builds the request (with the engine's own block hasher) instead. Aborts go to
``EngineCore.abort_requests``; steps to the engine's own step function.

A fault raised out of a step (worker, background builder) fails only the requests of the steps
that were in flight and not yet applied: they are finished with ``FINISHED_ERROR`` through the
scheduler, which frees their blocks and gives each one downstream EOF (C-61); the engine keeps
serving everyone else.

``Code2WavStage`` is not an LM: the orchestrator calls it directly with streamed codec chunks,
one ``StreamingDecoder`` per request.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine.core import EngineCore
from vllm.v1.executor.uniproc_executor import UniProcExecutor
from vllm.v1.request import RequestStatus

from omni_runtime.adapters.input import InputAdapter, StageInput
from omni_runtime.config import Materialization, OmniStageConfig, stage_additional_config
from omni_runtime.engine.graph import ARStageSpec, Code2WavStageSpec
from omni_runtime.models import Code2Wav, LlamaLM, StreamingDecoder, load_model, model_dir
from omni_runtime.payload import StageChunk
from omni_runtime.platform import install_for_process
from omni_runtime.sched import OmniARAsyncScheduler, OmniARScheduler
from omni_runtime.sched.transfer import ChunkSink, OutboxSink

logger = logging.getLogger(__name__)

WORKER_CLS = "omni_runtime.worker.OmniARWorker"
SYNC_SCHEDULER = f"{OmniARScheduler.__module__}.{OmniARScheduler.__qualname__}"
ASYNC_SCHEDULER = f"{OmniARAsyncScheduler.__module__}.{OmniARAsyncScheduler.__qualname__}"


@dataclass(frozen=True)
class EngineOptions:
    """Run-time switches that must not change any output (C-22, C-52)."""

    async_scheduling: bool = True
    materialization: Materialization = "inline"
    prefix_caching: bool = True
    seed: int = 0


@dataclass
class StageOutput:
    """What one step of a stage reports for one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    # Refs of the chunks this step sent downstream for the request (``OmniEngineCoreOutput``).
    chunk_refs: list[str] = field(default_factory=list)
    # Prompt tokens served by the prefix cache (on the request's first output only).
    num_cached_tokens: int | None = None


@dataclass
class StageStep:
    outputs: list[StageOutput] = field(default_factory=list)
    executed: bool = False
    fault: BaseException | None = None


def resolve_model(model: str) -> str:
    """A built-in model name ("thinker", "talker", "code2wav") or a folder path."""
    if model in ("thinker", "talker", "code2wav"):
        return str(model_dir(model))
    return model


def build_vllm_config(
    spec: ARStageSpec, stages: tuple[str, ...], options: EngineOptions
) -> VllmConfig:
    stage = OmniStageConfig(
        stage_id=spec.id,
        stages=stages,
        downstream=spec.downstream,
        chunk_processor=spec.chunk_processor,
        omni_pooler_payload_include_hidden=spec.include_hidden,
        materialization=options.materialization,
        downstream_needs_full_prefix=spec.downstream_needs_full_prefix,
        prompt_embeds_dim=spec.prompt_embeds_dim,
    )
    return VllmConfig(
        model_config=ModelConfig(
            model=resolve_model(spec.model),
            skip_tokenizer_init=True,
            max_model_len=spec.max_model_len,
            dtype="float32",
            seed=options.seed,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=spec.max_num_seqs,
            max_num_batched_tokens=spec.max_num_batched_tokens,
            max_model_len=spec.max_model_len,
            enable_chunked_prefill=True,
            async_scheduling=options.async_scheduling,
            is_encoder_decoder=False,
            scheduler_cls=ASYNC_SCHEDULER if options.async_scheduling else SYNC_SCHEDULER,
        ),
        cache_config=CacheConfig(
            block_size=spec.block_size,
            enable_prefix_caching=options.prefix_caching,
            prefix_caching_hash_algo="sha256",
            num_gpu_blocks_override=spec.num_blocks,
        ),
        parallel_config=ParallelConfig(distributed_executor_backend="uni", worker_cls=WORKER_CLS),
        device_config=DeviceConfig(device="cpu"),
        additional_config=stage_additional_config(stage),
    )


class StageEngine:
    """One AR stage: an in-process vLLM ``EngineCore`` plus the stage's input adapter."""

    def __init__(self, spec: ARStageSpec, stages: tuple[str, ...], options: EngineOptions) -> None:
        install_for_process()
        self.spec = spec
        self.stage_id = spec.id
        self.options = options
        self.vllm_config = build_vllm_config(spec, stages, options)
        self.core = EngineCore(self.vllm_config, executor_class=UniProcExecutor, log_stats=False)
        self.scheduler: OmniARScheduler = self.core.scheduler  # type: ignore[assignment]
        hf = self.vllm_config.model_config.hf_config
        self.adapter = InputAdapter(
            self.scheduler.omni_stage or OmniStageConfig(spec.id, stages),
            max_model_len=spec.max_model_len,
            vocab_size=int(hf.vocab_size),
            hidden_size=spec.prompt_embeds_dim,
            block_hasher=self.core.request_block_hasher,
            live_ids=self.scheduler.requests,
        )
        self.initial_free_blocks = self.num_free_blocks()
        # Scheduler outputs handed out by schedule() and not yet applied by update_from_output:
        # the requests a step fault touches (C-61). Recorded by wrapping the two calls on this
        # engine's own scheduler instance, so the scheduler class stays the shared one.
        self._in_flight: deque[SchedulerOutput] = deque()
        self._wrap_scheduler()
        self.steps = 0

    # ---- wiring ------------------------------------------------------------------------------

    def _wrap_scheduler(self) -> None:
        sched = self.scheduler
        schedule, update = sched.schedule, sched.update_from_output
        in_flight = self._in_flight

        def tracked_schedule(*args: Any, **kwargs: Any) -> SchedulerOutput:
            so = schedule(*args, **kwargs)
            in_flight.append(so)
            return so

        def tracked_update(so: SchedulerOutput, output: Any) -> Any:
            try:
                return update(so, output)
            finally:
                for i, x in enumerate(in_flight):
                    if x is so:
                        del in_flight[i]
                        break

        sched.schedule = tracked_schedule  # type: ignore[method-assign]
        sched.update_from_output = tracked_update  # type: ignore[method-assign,assignment]

    def set_sink(self, sink: ChunkSink) -> None:
        """Where this stage's chunks go; only the orchestrator calls this (C-21)."""
        if self.scheduler.transfer is None:
            raise ValueError(f"stage {self.stage_id!r} has no downstream to send to")
        self.scheduler.transfer.sink = sink

    @property
    def runner(self) -> Any:
        """The worker's model runner (audits and tests only)."""
        return self.core.model_executor.driver_worker.worker.model_runner  # type: ignore[attr-defined]

    # ---- requests ----------------------------------------------------------------------------

    def add(self, item: StageInput) -> None:
        """Validate and admit one request; raises ``RequestRejected`` before touching vLLM."""
        request = self.adapter.build(item)
        self.core.add_request(request, request_wave=0)

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        """Abort the given ids that are live here; unknown ids are a no-op (C-60)."""
        live = [rid for rid in request_ids if rid in self.scheduler.requests]
        if live:
            self.core.abort_requests(live)
        return live

    def has_work(self) -> bool:
        return self.scheduler.has_requests() or bool(self.core.batch_queue)

    # ---- stepping ----------------------------------------------------------------------------

    def step(self) -> StageStep:
        if not self.has_work():
            return StageStep()
        self.steps += 1
        try:
            outputs, executed = self.core.step_fn()
        except Exception as exc:  # a step fault fails only the requests it touched (C-61)
            return StageStep(self._fail_touched(exc), True, exc)
        result = StageStep(executed=bool(executed))
        for eco in (outputs or {}).values():
            for out in eco.outputs:
                reason = None if out.finish_reason is None else str(out.finish_reason)
                refs = getattr(out, "omni_chunk_refs", None) or []
                stats = getattr(out, "prefill_stats", None)
                result.outputs.append(
                    StageOutput(
                        out.request_id,
                        list(out.new_token_ids),
                        reason,
                        None,
                        list(refs),
                        None if stats is None else int(stats.num_cached_tokens),
                    )
                )
        return result

    def _fail_touched(self, exc: BaseException) -> list[StageOutput]:
        queued = {id(entry[1]) for entry in (self.core.batch_queue or ())}
        failed_steps = [so for so in self._in_flight if id(so) not in queued]
        for so in failed_steps:
            self._in_flight.remove(so)
        touched: list[str] = []
        for so in failed_steps:
            touched.extend(rid for rid in so.num_scheduled_tokens if rid not in touched)
        live = [rid for rid in touched if rid in self.scheduler.requests]
        logger.warning(
            "stage %s: step fault %r fails requests %s", self.stage_id, exc, sorted(live)
        )
        kv = self.scheduler.kv_cache_manager
        # The scheduler registered block hashes for this step's positions when it scheduled
        # them, but the worker may never have written their KV: those blocks must not serve
        # prefix hits (a retry of the same prompt would read garbage). Evicting every block of
        # the failed requests is conservative; blocks other requests hold stay allocated.
        suspect: set[int] = set()
        for rid in live:
            for group in kv.get_block_ids(rid):
                suspect.update(group)
        # The failed step may not have reached the worker at all; its finished ids are sent
        # again with the next step (dropping an unknown id is a no-op for the runner).
        for so in failed_steps:
            self.scheduler.finished_req_ids.update(so.finished_req_ids)
        finished = self.scheduler.finish_requests(live, RequestStatus.FINISHED_ERROR)
        if suspect:
            kv.evict_blocks(suspect)
        return [
            StageOutput(r.request_id, [], "error", f"{self.stage_id}: {type(exc).__name__}: {exc}")
            for r in finished
        ]

    # ---- audits ------------------------------------------------------------------------------

    def num_free_blocks(self) -> int:
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def leftovers(self) -> dict[str, Any]:
        """Everything that still holds a request; all empty/zero once every request is gone."""
        sched = self.scheduler
        transfer = sched.transfer
        processor = transfer.processor if transfer is not None else None
        pending = getattr(processor, "pending_request_ids", None)
        sink = transfer.sink if transfer is not None else None
        out: dict[str, Any] = {
            "scheduler_requests": sorted(sched.requests),
            "running": [r.request_id for r in sched.running],
            "waiting": len(sched.waiting),
            "finished_req_ids": sorted(sched.finished_req_ids),
            "blocks_in_use": self.initial_free_blocks - self.num_free_blocks(),
            "transfer_progress": sorted(transfer.progress) if transfer is not None else [],
            "processor_buffers": sorted(pending()) if callable(pending) else [],
            "outbox": len(sink) if isinstance(sink, OutboxSink) else 0,
            "runner_requests": sorted(getattr(self.runner, "requests", {})),
            "batch_queue": len(self.core.batch_queue or ()),
            "in_flight": len(self._in_flight),
        }
        return out

    def is_clean(self) -> bool:
        return not any(self.leftovers().values())

    def shutdown(self) -> None:
        self.core.shutdown()


@dataclass
class AudioChunk:
    """Samples code2wav produced for one request from one codec chunk."""

    request_id: str
    seq: int
    codes: torch.Tensor
    samples: torch.Tensor
    is_final: bool


class Code2WavStage:
    """Decodes streamed codec chunks per request with the causal streaming decoder."""

    def __init__(self, spec: Code2WavStageSpec) -> None:
        self.spec = spec
        self.stage_id = spec.id
        model = load_model(resolve_model(spec.model))
        if not isinstance(model, Code2Wav):
            raise TypeError(f"stage {spec.id!r}: {spec.model!r} is not a code2wav model")
        self.model = model
        self._decoders: dict[str, StreamingDecoder] = {}
        self._seq: dict[str, int] = {}

    @property
    def sample_rate(self) -> int:
        return self.model.sample_rate

    @property
    def hop_length(self) -> int:
        return self.model.hop_length

    def push(self, chunk: StageChunk) -> AudioChunk:
        """Decode one delivered chunk; a final chunk ends the request's sequence."""
        rid = chunk.request_id
        codes = chunk.data
        if codes is None:
            codes = torch.zeros(0, dtype=torch.long)
        codes = torch.as_tensor(codes, dtype=torch.long).reshape(-1)
        decoder = self._decoders.get(rid)
        if decoder is None:
            decoder = self._decoders[rid] = StreamingDecoder(self.model)
        try:
            samples = decoder.push(codes)
            if chunk.is_final:
                tail = decoder.flush()
                if tail.numel():
                    samples = torch.cat((samples, tail))
        except Exception:
            self.drop(rid)
            raise
        seq = self._seq.get(rid, 0)
        self._seq[rid] = seq + 1
        if chunk.is_final:
            self.drop(rid)
        return AudioChunk(rid, seq, codes, samples, chunk.is_final)

    def decode(self, codes: torch.Tensor | list[int]) -> torch.Tensor:
        """Whole-sequence decode (the reference the streamed chunks must equal)."""
        return self.model.decode(torch.as_tensor(codes, dtype=torch.long))

    def drop(self, request_id: str) -> None:
        self._decoders.pop(request_id, None)
        self._seq.pop(request_id, None)

    def live_request_ids(self) -> set[str]:
        return set(self._decoders)


def talker_start_embeddings(spec: ARStageSpec) -> torch.Tensor | None:
    """Embeddings of the stage's ``start_token_ids``, taken from its own weights."""
    if not spec.start_token_ids:
        return None
    model = load_model(resolve_model(spec.model))
    if not isinstance(model, LlamaLM):
        raise TypeError(f"stage {spec.id!r}: {spec.model!r} is not a decoder LM")
    with torch.no_grad():
        return model.embed(torch.tensor(spec.start_token_ids, dtype=torch.long)).clone()
