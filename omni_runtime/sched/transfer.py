"""Chunk transfer: deciding, after each request's update, what goes to the downstream stage.

The transfer adapter is owned by the scheduler (never by a worker, C-21). After
``update_from_output`` has applied a request's step exactly as upstream does, the adapter gets
the step's accepted token ids (after stop trimming), the request's payload for that step and its
finish reason, and decides (C-40 to C-45):

* a request whose final stage is this stage never causes a send (C-42);
* otherwise send when the step carries a tensor payload, or when it has nonempty accepted ids and
  the processor declares ``requires_token_updates`` as exactly ``True`` (C-40, C-41), or when the
  request terminates;
* every request with a downstream consumer gets exactly one terminal (EOF) delivery, even when
  the processor returns nothing for it (C-43);
* hidden rows for positions already delivered are trimmed, so preemption and recompute never
  deliver a position twice (C-45).

Chunk processors are plain callables ``processor(request_id, payload, is_final)`` with an optional
``requires_token_updates`` attribute; a processor whose signature accepts ``new_token_ids`` (by
name, or through ``**kwargs``) also receives the step's ids as a fresh list. A processor that
keeps per-request state may also have ``release(request_id)``: it is called when the processor
raised on a request's final call, the one where it would have let go of that state itself.
"""

from __future__ import annotations

import inspect
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from vllm.utils.import_utils import resolve_obj_by_qualname

from omni_runtime.adapters.input import OmniRequestState
from omni_runtime.payload import StageChunk, StagePayload

ChunkProcessor = Callable[..., Any]

logger = logging.getLogger(__name__)


class ChunkSink(Protocol):
    """Where the transfer adapter hands chunks: the orchestrator's connector, or an outbox."""

    def send(self, chunk: StageChunk) -> None: ...


class OutboxSink:
    """The default sink: chunks wait here until the orchestrator drains them."""

    def __init__(self) -> None:
        self._chunks: deque[StageChunk] = deque()

    def send(self, chunk: StageChunk) -> None:
        self._chunks.append(chunk)

    def drain(self) -> list[StageChunk]:
        out = list(self._chunks)
        self._chunks.clear()
        return out

    def __len__(self) -> int:
        return len(self._chunks)


def requires_token_updates(processor: ChunkProcessor | None) -> bool:
    # Exactly True: a truthy non-bool (1, "yes", a Mock attribute) is not a declaration (C-40).
    return processor is not None and getattr(processor, "requires_token_updates", False) is True


def accepts_new_token_ids(processor: ChunkProcessor) -> bool:
    try:
        params = inspect.signature(processor).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.name == "new_token_ids"
        and p.kind is not inspect.Parameter.POSITIONAL_ONLY
        or p.kind is inspect.Parameter.VAR_KEYWORD
        for p in params
    )


def load_processor(spec: str | ChunkProcessor | None) -> ChunkProcessor | None:
    """A processor from a dotted path; a class named there is instantiated with no arguments."""
    if spec is None or callable(spec) and not isinstance(spec, type):
        return spec
    obj = resolve_obj_by_qualname(spec) if isinstance(spec, str) else spec
    if isinstance(obj, type):
        obj = obj()
    if not callable(obj):
        raise TypeError(f"omni_stage.chunk_processor: {spec!r} is not callable")
    return obj


@dataclass
class TransferProgress:
    """Per-request delivery state; dropped on the terminal delivery (C-04)."""

    next_seq: int = 0
    delivered_positions: int = 0


class ChunkTransferAdapter:
    """The scheduler-side send path of one stage."""

    def __init__(
        self,
        stage_id: str,
        processor: ChunkProcessor | None = None,
        sink: ChunkSink | None = None,
    ) -> None:
        self.stage_id = stage_id
        self.sink: ChunkSink = sink if sink is not None else OutboxSink()
        self.set_processor(processor)
        self.progress: dict[str, TransferProgress] = {}
        # Processor failures of the current update, by request id (C-61).
        self.failures: dict[str, BaseException] = {}

    def set_processor(self, processor: ChunkProcessor | None) -> None:
        self.processor = processor
        self.token_updates = requires_token_updates(processor)
        self._pass_ids = processor is not None and accepts_new_token_ids(processor)

    def on_step(
        self,
        request_id: str,
        state: OmniRequestState,
        new_token_ids: list[int],
        payload: StagePayload | None,
        finish_reason: str | None,
    ) -> StageChunk | None:
        """Apply the transfer decision for one request's step; returns the chunk sent, if any."""
        if not state.has_downstream:
            return None
        prog = self.progress.get(request_id)
        if prog is None:
            prog = self.progress[request_id] = TransferProgress()
        if payload is not None:
            payload = payload.trimmed_before(prog.delivered_positions)
        has_tensor = payload is not None and payload.has_tensors
        terminal = finish_reason is not None
        if not (has_tensor or terminal or (new_token_ids and self.token_updates)):
            return None
        return self._deliver(request_id, prog, new_token_ids, payload, finish_reason)

    def on_terminated(
        self, request_id: str, state: OmniRequestState, finish_reason: str
    ) -> StageChunk | None:
        """A request left the scheduler outside a model step (abort, error): its EOF delivery."""
        if not state.has_downstream:
            return None
        prog = self.progress.get(request_id) or TransferProgress()
        return self._deliver(request_id, prog, [], None, finish_reason)

    def _deliver(
        self,
        request_id: str,
        prog: TransferProgress,
        new_token_ids: list[int],
        payload: StagePayload | None,
        finish_reason: str | None,
    ) -> StageChunk | None:
        is_final = finish_reason is not None
        data: Any = payload
        processor = self.processor
        if processor is not None:
            try:
                if self._pass_ids:
                    # A fresh list: the processor may keep or mutate it (C-44).
                    data = processor(request_id, payload, is_final, new_token_ids=new_token_ids[:])
                else:
                    data = processor(request_id, payload, is_final)
            except Exception as exc:  # a processor fault fails only its own request (C-61)
                self.failures[request_id] = exc
                if not is_final:
                    self.progress.pop(request_id, None)
                    return None
                # The terminal delivery still happens, bare: downstream must see the end (C-43).
                # The processor never got to let go of the request: ask it to.
                self._release(request_id)
                data = None
                if finish_reason != "abort":
                    finish_reason = "error"
            # "Nothing to send" only holds for the processor's own data: tensors the payload
            # carries (prefill conditioning, multimodal outputs) still cross (C-31).
            if data is None and not is_final and not (payload is not None and payload.has_tensors):
                return None
        token_ids = tuple(new_token_ids)
        chunk = StageChunk(
            request_id=request_id,
            source_stage=self.stage_id,
            seq=prog.next_seq,
            token_ids=token_ids,
            payload=payload,
            data=data,
            is_final=is_final,
            finish_reason=finish_reason,
        )
        prog.next_seq += 1
        if payload is not None and payload.hidden is not None:
            prog.delivered_positions = max(
                prog.delivered_positions, payload.start + payload.num_tokens
            )
        if is_final:
            self.progress.pop(request_id, None)
        try:
            self.sink.send(chunk)
        except Exception as exc:  # a connector fault fails only its own request (C-61)
            self.failures[request_id] = exc
            self.progress.pop(request_id, None)
            return None
        return chunk

    def _release(self, request_id: str) -> None:
        release = getattr(self.processor, "release", None)
        if not callable(release):
            return
        try:
            release(request_id)
        except Exception:  # the request already failed; this only costs the processor memory
            logger.exception("stage %s: processor release(%r) raised", self.stage_id, request_id)

    def take_failures(self) -> dict[str, BaseException]:
        out, self.failures = self.failures, {}
        return out

    def live_request_ids(self) -> set[str]:
        return set(self.progress)
