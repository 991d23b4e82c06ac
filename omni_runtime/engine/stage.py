"""AR stage engines: one vLLM ``EngineCore`` per autoregressive stage.

``StageEngine`` owns one in-process ``EngineCore`` (``vllm_compat.TrackedEngineCore``, vLLM's
uni executor) built from ``config.stage_vllm_config`` with the omni schedulers
(``OmniARScheduler`` for sync stepping, ``OmniARAsyncScheduler`` with the batch queue for async)
and ``OmniARWorker``. Requests enter only through the stage's ``InputAdapter``, built with the
engine's own block hasher; aborts and steps are the engine's own. Every read of a vLLM internal
goes through ``omni_runtime.engine.vllm_compat``.

Faults: the runner recovers from a step fault itself (``omni_runtime.worker.recovery``) and this
engine reads a failed request's cause from ``omni_error``; what still raises out of a step fails
only the requests of the steps in flight, with downstream EOF (C-61). See docs/design.md, "When
a step faults". The code2wav stage lives in ``omni_runtime.engine.code2wav_stage``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_runtime.adapters.input import InputAdapter, StageInput
from omni_runtime.config import OmniStageConfig
from omni_runtime.engine import vllm_compat as compat
from omni_runtime.engine.config import EngineOptions, resolve_model, stage_vllm_config
from omni_runtime.engine.graph import ARStageSpec
from omni_runtime.models import LlamaLM, load_model
from omni_runtime.platform import install_for_process
from omni_runtime.sched import OmniARScheduler
from omni_runtime.sched.transfer import ChunkSink, OutboxSink

__all__ = ["EngineOptions", "StageEngine", "StageOutput", "StageStep", "talker_start_embeddings"]

logger = logging.getLogger(__name__)


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
    # The tracing context the request's client sent (``StageInput.trace_headers``), as vLLM
    # returns it on each of the request's outputs.
    trace_headers: Mapping[str, str] | None = None

    @classmethod
    def of(cls, out: Any) -> StageOutput:
        """The stage's report of one of vLLM's ``EngineCoreOutput`` (plain or omni)."""
        return cls(
            out.request_id,
            list(out.new_token_ids),
            None if out.finish_reason is None else str(out.finish_reason),
            getattr(out, "omni_error", None),
            list(getattr(out, "omni_chunk_refs", None) or []),
            compat.cached_prompt_tokens(out),
            out.trace_headers,
        )


@dataclass
class StageStep:
    outputs: list[StageOutput] = field(default_factory=list)
    executed: bool = False
    fault: BaseException | None = None


class StageEngine:
    """One AR stage: an in-process vLLM ``EngineCore`` plus the stage's input adapter."""

    def __init__(self, spec: ARStageSpec, stages: tuple[str, ...], options: EngineOptions) -> None:
        install_for_process()
        self.spec = spec
        self.stage_id = spec.id
        self.options = options
        self.vllm_config = stage_vllm_config(spec, stages, options)
        # Knows the scheduler outputs handed out and not yet applied: the requests a step fault
        # touches (C-61).
        self.core = compat.TrackedEngineCore(self.vllm_config)
        self.scheduler: OmniARScheduler = compat.scheduler_of(self.core)
        hf = self.vllm_config.model_config.hf_config
        self.adapter = InputAdapter(
            self.scheduler.omni_stage or OmniStageConfig(spec.id, stages),
            max_model_len=spec.max_model_len,
            vocab_size=int(hf.vocab_size),
            hidden_size=spec.prompt_embeds_dim,
            block_hasher=compat.block_hasher(self.core),
            live_ids=compat.scheduler_requests(self.scheduler),
        )
        self.initial_free_blocks = self.num_free_blocks()
        self.steps = 0

    # ---- wiring ------------------------------------------------------------------------------

    def set_sink(self, sink: ChunkSink) -> None:
        """Where this stage's chunks go; only the orchestrator calls this (C-21)."""
        if self.scheduler.transfer is None:
            raise ValueError(f"stage {self.stage_id!r} has no downstream to send to")
        self.scheduler.transfer.sink = sink

    @property
    def worker(self) -> Any:
        """The engine's worker (``OmniARWorker``; fault-injection tests only)."""
        return compat.worker(self.core)

    @property
    def runner(self) -> Any:
        """The worker's model runner (audits and tests only)."""
        return compat.model_runner(self.core)

    # ---- requests ----------------------------------------------------------------------------

    def _is_live(self, request_id: str) -> bool:
        return request_id in compat.scheduler_requests(self.scheduler)

    def add(self, item: StageInput) -> None:
        """Validate and admit one request; raises ``RequestRejected`` before touching vLLM."""
        request = self.adapter.build(item)
        compat.add_request(self.core, request)

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        """Abort the given ids that are live here; unknown ids are a no-op (C-60)."""
        live = [rid for rid in request_ids if self._is_live(rid)]
        if live:
            self.core.abort_requests(live)
        return live

    def num_requests(self) -> int:
        return len(compat.scheduler_requests(self.scheduler))

    def has_work(self) -> bool:
        return self.scheduler.has_requests() or compat.has_queued_steps(self.core)

    # ---- stepping ----------------------------------------------------------------------------

    def step(self) -> StageStep:
        if not self.has_work():
            return StageStep()
        self.steps += 1
        try:
            outputs, executed = compat.step(self.core)
        except Exception as exc:  # a step fault fails only the requests it touched (C-61)
            return StageStep(self._fail_touched(exc), True, exc)
        result = StageStep(executed=bool(executed))
        result.outputs.extend(map(StageOutput.of, compat.step_outputs(outputs)))
        return result

    def _fail_touched(self, exc: BaseException) -> list[StageOutput]:
        failed_steps = self.core.take_failed_steps()
        touched: list[str] = []
        for so in failed_steps:
            touched.extend(rid for rid in so.num_scheduled_tokens if rid not in touched)
        live = [rid for rid in touched if self._is_live(rid)]
        logger.warning(
            "stage %s: step fault %r fails requests %s", self.stage_id, exc, sorted(live)
        )
        # The failed step may not have reached the worker at all; its finished ids are sent
        # again with the next step (dropping an unknown id is a no-op for the runner).
        compat.resend_finished_ids(self.scheduler, failed_steps)
        # The same path as a fault the worker pinned: finished with an error, and their blocks,
        # hashed when the step was scheduled but maybe never written, out of the prefix cache.
        cause = f"{self.stage_id}: {type(exc).__name__}: {exc}"
        finished = self.scheduler.fail_unwritten(dict.fromkeys(live, cause))
        return [StageOutput(r.request_id, [], "error", why) for r, why in finished]

    # ---- audits ------------------------------------------------------------------------------

    def num_free_blocks(self) -> int:
        return compat.num_free_blocks(self.scheduler)

    def call_worker(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(worker, *args)`` through vLLM's ``collective_rpc`` (``StageBackend``)."""
        return list(self.core.collective_rpc(fn, args=args))

    def leftovers(self) -> dict[str, Any]:
        """Everything that still holds a request; all empty/zero once every request is gone."""
        sched = self.scheduler
        transfer = sched.transfer
        processor = transfer.processor if transfer is not None else None
        pending = getattr(processor, "pending_request_ids", None)
        sink = transfer.sink if transfer is not None else None
        out: dict[str, Any] = {
            "scheduler_requests": sorted(compat.scheduler_requests(sched)),
            "running": compat.running_request_ids(sched),
            "waiting": compat.num_waiting(sched),
            "finished_unsent": sorted(compat.pending_finished_ids(sched)),
            "blocks_in_use": self.initial_free_blocks - self.num_free_blocks(),
            "transfer_progress": sorted(transfer.progress) if transfer is not None else [],
            "processor_buffers": sorted(pending()) if callable(pending) else [],
            "outbox": len(sink) if isinstance(sink, OutboxSink) else 0,
            "runner_requests": sorted(getattr(self.runner, "requests", {})),
            "queued_steps": compat.num_queued_steps(self.core),
            "in_flight": len(self.core.in_flight),
        }
        return out

    def is_clean(self) -> bool:
        return not any(self.leftovers().values())

    def shutdown(self) -> None:
        self.core.shutdown()


def talker_start_embeddings(spec: ARStageSpec) -> torch.Tensor | None:
    """Embeddings of the stage's ``start_token_ids``, taken from its own weights."""
    if not spec.start_token_ids:
        return None
    model = load_model(resolve_model(spec.model))
    if not isinstance(model, LlamaLM):
        raise TypeError(f"stage {spec.id!r}: {spec.model!r} is not a decoder LM")
    with torch.no_grad():
        return model.embed(torch.tensor(spec.start_token_ids, dtype=torch.long)).clone()
