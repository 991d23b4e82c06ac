"""Chunk transfer: deciding, after each step's update, what goes to the downstream stage.

The transfer adapter belongs to the scheduler, never to a worker (C-21). Once
``update_from_output`` has applied a step as upstream does, the scheduler hands it the whole
step (``on_steps``, or ``on_aligned_steps`` for a steady decode step): per request, the
stop-trimmed accepted ids, the payload and the finish reason. It decides (C-40..C-45): a request
final at this stage never sends (C-42); otherwise a step sends for a tensor payload, for
nonempty ids when the processor declares ``requires_token_updates`` exactly ``True``, or at the
end (C-40, C-41); every request with a downstream gets exactly one EOF (C-43); rows already
delivered are trimmed (C-45). It owns each such request's delivery progress until its EOF.

The chunk-processor protocol (``new_token_ids``, ``release``, ``on_token_batch``,
``set_processor``): docs/contracts.md, "Chunk processors". The adapter's bookkeeping:
docs/design.md, "Inside the layers".
"""

from __future__ import annotations

import inspect
import logging
import types
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Any, Protocol

from vllm.utils.import_utils import resolve_obj_by_qualname

from omni_runtime.adapters.input import OmniRequestState
from omni_runtime.payload import StageChunk, StagePayload

ChunkProcessor = Callable[..., Any]

logger = logging.getLogger(__name__)


_new_token_ids = attrgetter("new_token_ids")
_finish_reason = attrgetter("finish_reason")


class StepOutput(Protocol):
    """What the adapter reads of upstream's output for one request's step."""

    @property
    def new_token_ids(self) -> list[int]: ...

    @property
    def finish_reason(self) -> Any: ...


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


def resolve_processor(spec: str, field: str = "omni_stage.chunk_processor") -> Any:
    """What the dotted path ``spec`` names (a processor class, or a callable), without
    instantiating it. A path that names nothing importable, or nothing callable, is refused with
    an error that names ``field``: a mistyped path in a stage's configuration must say where it
    is, not surface as an import error from inside the engine's start-up."""
    module, _, name = spec.rpartition(".")
    if not module or not name:
        raise ValueError(f"{field}: {spec!r} is not a dotted path (package.module.Name)")
    try:
        obj = resolve_obj_by_qualname(spec)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{field}: {spec!r} names nothing importable ({exc})") from exc
    if not callable(obj):
        raise TypeError(f"{field}: {spec!r} is not callable")
    return obj


def load_processor(spec: str | ChunkProcessor | None) -> ChunkProcessor | None:
    """A processor from a dotted path; a class named there is instantiated with no arguments."""
    if spec is None or callable(spec) and not isinstance(spec, type):
        return spec
    obj = resolve_processor(spec) if isinstance(spec, str) else spec
    if isinstance(obj, type):
        obj = obj()
    if not callable(obj):
        raise TypeError(f"omni_stage.chunk_processor: {spec!r} is not callable")
    return obj


def _direct_call(processor: ChunkProcessor | None) -> ChunkProcessor | None:
    """What ``processor(...)`` runs, as a callable: for an instance whose class defines
    ``__call__`` as a Python function, that function bound to the instance (calling the
    instance itself goes through its type's call slot, which costs about as much again, once
    per request per step); anything else, the processor itself. Looked up the way the call
    slot looks it up: the first ``__call__`` along the class's MRO."""
    if processor is None:
        return None
    for klass in type(processor).__mro__:
        raw = klass.__dict__.get("__call__")
        if isinstance(raw, types.FunctionType):
            return types.MethodType(raw, processor)
        if raw is not None:
            break
    return processor


def _batch_method(processor: ChunkProcessor | None) -> Callable[..., Any] | None:
    """The processor's ``on_token_batch``, bound, when its class defines one at or below the
    ``__call__`` it runs (looked up along the MRO, as the call slot is); else None. Only the
    class counts: a wrapper that forwards attribute reads to an inner processor must not route
    the inner one's batch past its own per-request call."""
    if processor is None:
        return None
    batch_at = call_at = None
    for i, klass in enumerate(type(processor).__mro__):
        found = klass.__dict__
        if batch_at is None and "on_token_batch" in found:
            batch_at = i
        if call_at is None and "__call__" in found:
            call_at = i
    if batch_at is None or call_at is None or batch_at > call_at:
        return None
    method = getattr(processor, "on_token_batch", None)
    return method if callable(method) else None


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
        self._batch_owner: ChunkProcessor | None = processor
        self._batches = _batch_method(processor) is not None

    def _batch_of(self, processor: ChunkProcessor | None) -> Callable[..., Any] | None:
        # ``self.processor`` may be replaced without ``set_processor`` (tests wrap it for one
        # call): whether it batches is decided again when it changes. The method itself is
        # read on every step, as a per-request call reads ``__call__``.
        if processor is not self._batch_owner:
            self._batch_owner = processor
            self._batches = _batch_method(processor) is not None
        return getattr(processor, "on_token_batch", None) if self._batches else None

    def on_steps(
        self,
        steps: Iterable[tuple[str, StepOutput | None]],
        payloads: Mapping[str, StagePayload],
        freed: Mapping[str, tuple[OmniRequestState, str]],
        dropped: AbstractSet[str],
        live_slot: Callable[[str], OmniRequestState | None],
    ) -> dict[str, StageChunk]:
        """Apply the transfer decision to every request of one step; returns the chunks sent by
        request id.

        ``steps``: the step's request ids in scheduler order, each with upstream's output of the
        step (None for a request that emitted nothing). ``payloads``: the step's payloads by
        request id. ``freed``: requests upstream freed during this update, with their omni slot
        and finish reason; those without a step here get their EOF after the others.
        ``dropped``: steps upstream discarded as stale (their payload goes too, and without an
        output they are skipped). ``live_slot(request_id)``: the omni slot of a request still
        live after the update, None for one that is gone or finished.
        """
        sent: dict[str, StageChunk] = {}
        progress = self.progress
        get_prog = progress.get
        get_payload = payloads.get if payloads else None
        # Freed and stale-dropped requests are rare: one membership test per request covers both,
        # and none at all on a step that has neither.
        special = freed.keys() | dropped if freed or dropped else None
        consumed: set[str] = set()
        decide = self._decide
        # What the decision reduces to on a common step (below), fixed for the whole step.
        token_updates = self.token_updates
        call = _direct_call(self.processor)
        pass_ids = self._pass_ids
        batch = self._batch_of(self.processor) if token_updates else None
        # The current run of requests whose call is ids only, for one batch call; it is run
        # before anything else that calls the processor or sends, so both keep scheduler order.
        run: list[str] = []
        run_ids: list[list[int]] = []
        add_run, add_run_ids = run.append, run_ids.append
        for rid, out in steps:
            if out is None or out.finish_reason is not None or special and rid in special:
                if run:
                    self._run_batch(batch, run, run_ids, sent)
                chunk = self._edge_step(rid, out, payloads, freed, dropped, live_slot, consumed)
                if chunk is not None:
                    sent[rid] = chunk
                continue
            prog = get_prog(rid)
            if prog is None:
                # Upstream emitted for it, so it was live before the update; one with a
                # downstream that upstream did not free still is. The slot is read on the
                # request's first step only: from then on its progress record stands for it.
                state = live_slot(rid)
                if state is None or not state.has_downstream:
                    continue
                prog = progress[rid] = TransferProgress()
            # Upstream's own list; copied before anything can keep it (C-44).
            new_ids = out.new_token_ids
            payload = None if get_payload is None else get_payload(rid)
            if payload is not None:
                if run:
                    self._run_batch(batch, run, run_ids, sent)
                chunk = decide(rid, prog, new_ids, payload, None)
            # A common step: live, not the last, no payload. ``_decide`` reduces to this: only
            # the ids can trigger a delivery, and then the processor's data decides whether
            # anything is sent. Written out because it runs for every request of every step.
            elif not (new_ids and token_updates):
                continue
            elif batch is not None:
                add_run(rid)
                add_run_ids(new_ids)
                continue
            else:
                assert call is not None  # token_updates implies a processor
                try:
                    if pass_ids:
                        data = call(rid, None, False, new_token_ids=new_ids[:])  # C-44
                    else:
                        data = call(rid, None, False)
                except Exception as exc:  # a processor fault fails only its own request (C-61)
                    # Its progress stays: the EOF the failure leads to continues its numbering.
                    self.failures[rid] = exc
                    continue
                if data is None:
                    continue
                chunk = self._send(rid, prog, new_ids, None, data, None)
            if chunk is not None:
                sent[rid] = chunk
        if run:
            self._run_batch(batch, run, run_ids, sent)
        # Requests freed in this update without a step of their own (errors).
        for rid, (state, reason) in freed.items():
            if rid not in consumed:
                self.on_terminated(rid, state, reason)
        return sent

    def on_aligned_steps(
        self,
        request_ids: list[str],
        outputs: Sequence[StepOutput],
        payloads: Mapping[str, StagePayload],
        freed: Mapping[str, tuple[OmniRequestState, str]],
        dropped: AbstractSet[str],
        live_slot: Callable[[str], OmniRequestState | None],
    ) -> dict[str, StageChunk]:
        """``on_steps`` for a step in which request ``request_ids[i]`` emitted ``outputs[i]``
        and nothing else was emitted: the steady decode step, taken whole when it can be.

        When no request was freed or dropped, none carries a payload, none finished, every one
        has nonempty ids and a progress record, and the processor batches, the per-request loop
        of ``on_steps`` would put every request into one run: that run is built here in C-level
        passes instead (one batch call, chunks in scheduler order). Anything else goes through
        ``on_steps`` unchanged."""
        if not (freed or dropped or payloads) and self.token_updates:
            batch = self._batch_of(self.processor)
            if batch is not None:
                new_ids = list(map(_new_token_ids, outputs))
                if (
                    all(new_ids)
                    and list(map(_finish_reason, outputs)).count(None) == len(new_ids)
                    and all(map(self.progress.__contains__, request_ids))
                ):
                    sent: dict[str, StageChunk] = {}
                    if new_ids:
                        # ``_run_batch`` empties the lists it is given: not the caller's.
                        self._run_batch(batch, list(request_ids), new_ids, sent)
                    return sent
        return self.on_steps(
            zip(request_ids, outputs, strict=True), payloads, freed, dropped, live_slot
        )

    def _run_batch(
        self,
        batch: Callable[..., Any] | None,
        request_ids: list[str],
        new_ids: list[list[int]],
        sent: dict[str, StageChunk],
    ) -> None:
        """One ``on_token_batch`` call for a run of ids-only requests, then their chunks, in
        run order (module docstring). ``new_ids`` are upstream's own lists: the processor gets
        a fresh list of their contents (C-44) and the chunks a tuple each."""
        assert batch is not None  # a run is only built with a batch method
        token_ids = list(chain.from_iterable(new_ids))
        # Every list is nonempty, so as many ids as requests means one each.
        counts = None if len(token_ids) == len(request_ids) else list(map(len, new_ids))
        try:
            data = batch(tuple(request_ids), token_ids, counts)
        except Exception as exc:  # fails the run's requests alone, each as its own call would
            for rid in request_ids:
                self.failures[rid] = exc
            data = None
        if data:
            progress = self.progress
            for rid, ids in zip(request_ids, new_ids, strict=True):
                out = data.get(rid)
                if out is None:
                    continue
                chunk = self._send(rid, progress[rid], ids, None, out, None)
                if chunk is not None:
                    sent[rid] = chunk
        # The caller keeps appending to the same two lists (it bound their ``append``); nothing
        # else holds them: the processor got copies.
        request_ids.clear()
        new_ids.clear()

    def _edge_step(
        self,
        request_id: str,
        out: StepOutput | None,
        payloads: Mapping[str, StagePayload],
        freed: Mapping[str, tuple[OmniRequestState, str]],
        dropped: AbstractSet[str],
        live_slot: Callable[[str], OmniRequestState | None],
        consumed: set[str],
    ) -> StageChunk | None:
        """The decision for a step that ends the request, emitted nothing, was freed or was
        dropped as stale. Nothing is decided for a request final here, one that was gone
        before the update, or a dropped step without output."""
        in_freed = request_id in freed
        if out is None and request_id in dropped:
            return None
        if in_freed:
            # Freed during this update, so live before it; its slot was read at the free.
            downstream = freed[request_id][0].has_downstream
        elif out is not None and request_id in self.progress:
            # Emitted, so live before the update; progress is only kept for a downstream.
            downstream = True
        else:
            # Not freed here: live before the update if and only if it still is.
            state = live_slot(request_id)
            downstream = state is not None and state.has_downstream
        if not downstream:
            return None
        if out is None:
            new_ids: list[int] = []
            reason = None
        else:
            new_ids = out.new_token_ids
            reason = None if out.finish_reason is None else str(out.finish_reason)
            if reason is not None and not in_freed and live_slot(request_id) is not None:
                # A streaming session's turn ended (vLLM keeps the request for its next input):
                # its end, and the EOF, come when the session finishes.
                reason = None
        if in_freed:
            if reason is None:
                reason = freed[request_id][1]
            consumed.add(request_id)
        prog = self.progress.get(request_id)
        if prog is None:
            prog = self.progress[request_id] = TransferProgress()
        payload = None if request_id in dropped else payloads.get(request_id)
        return self._decide(request_id, prog, new_ids, payload, reason)

    def _decide(
        self,
        request_id: str,
        prog: TransferProgress,
        new_token_ids: list[int],
        payload: StagePayload | None,
        finish_reason: str | None,
    ) -> StageChunk | None:
        """The transfer decision for one request's step (C-40 to C-45); the chunk sent, if any."""
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
                    # The request is failed next (C-61); its progress stays for the EOF that
                    # follows, so the chunks downstream sees stay numbered 0..n-1 (C-43).
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
        return self._send(request_id, prog, new_token_ids, payload, data, finish_reason)

    def _send(
        self,
        request_id: str,
        prog: TransferProgress,
        new_token_ids: list[int],
        payload: StagePayload | None,
        data: Any,
        finish_reason: str | None,
    ) -> StageChunk | None:
        """Build the request's next chunk, advance its progress and hand the chunk to the sink."""
        is_final = finish_reason is not None
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
        if is_final:
            self.progress.pop(request_id, None)
        try:
            self.sink.send(chunk)
        except Exception as exc:  # a connector fault fails only its own request (C-61)
            # Nothing was delivered: the sequence number and positions do not advance, so the
            # EOF the failure leads to takes this number (C-43).
            self.failures[request_id] = exc
            return None
        prog.next_seq += 1
        if payload is not None and payload.hidden is not None:
            prog.delivered_positions = max(
                prog.delivered_positions, payload.start + payload.num_tokens
            )
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
        """Requests this adapter holds anything of: a delivery in progress, or a send-path
        failure the scheduler has not taken yet (it takes each in the call that recorded it, so
        one still here after that call is a leak, C-04)."""
        return self.progress.keys() | self.failures.keys()
