"""``omni-process-stage``: ``omni`` with the schedulers as they run inside a stage process
(``sched.process_stage``). Requests cross to them as vLLM's ``EngineCoreRequest`` through vLLM's
msgpack codec and are admitted by ``"release"``; each step's outputs cross back the same way,
and its chunks are read out of shared memory as the parent reads them. What crossed, and what
the crossing still holds, is the ``process_boundary`` capability (C-46); its registry adds
``OMNI-WIRE-001``.
"""

from __future__ import annotations

import os
import uuid
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from conformance.api import (
    AddRequest,
    Crossing,
    DeclaredAttributes,
    Difference,
    DifferenceEntry,
    DifferenceWitness,
    Feature,
    HarnessConfig,
    Step,
    block_hasher,
    scheduler_holdings,
)
from omni_runtime.conformance_subject.delivery import OmniChunkDelivery
from omni_runtime.conformance_subject.subjects import OmniSubject, require_supported_vllm

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
    holdings = scheduler_holdings(scheduler)
    transfer = scheduler.transfer
    pending = getattr(
        transfer.processor if transfer is not None else None, "pending_request_ids", None
    )
    writer = scheduler.writer
    held = {
        "scheduler_requests": list(holdings.request_ids),
        "running": list(holdings.running),
        "waiting": len(holdings.waiting),
        "finished_unsent": list(holdings.finished_unsent),
        "free_blocks": holdings.free_blocks,
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
        # EngineCore hashes at the scheduler's hash block size, which a hybrid KV layout sets
        # apart from the cache's block size (the attention page).
        hasher = block_hasher(
            getattr(scheduler, "hash_block_size", scheduler.block_size),
            scheduler.vllm_config.num_hash_lookahead_tokens,
        )
        arrived = Request.from_engine_core_request(decoded, hasher)
        if arrived.use_structured_output:
            # ``preprocess_add_request`` starts the grammar compiling before admission.
            scheduler.structured_output_manager.grammar_init(arrived)
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


def process_stage_subject() -> ProcessStageSubject:
    require_supported_vllm()
    return ProcessStageSubject()
