"""Chunks across a process boundary through shared memory: the wire form and its two ends.

A stage in its own process (``omni_runtime.engine.mp_stage``) returns its chunks on vLLM's own
output messages. This module owns what travels:

* ``ChunkDescriptor`` / ``TensorRef`` — a ``StageChunk`` without its tensor bytes, each tensor
  named by segment, offset, byte count, dtype and shape;
* ``ShmEngineCoreOutputs`` — ``OmniEngineCoreOutputs`` plus a trailing field, ``omni_chunks``;
* ``ShmChunkWriter`` — the child's sink: ``send`` encodes at once (a bad data type fails only its
  request, C-61), ``flush`` writes the step's tensors into one new segment, nothing pickled;
* ``read_chunks`` — the parent's end: one copy out, the chunk rebuilt (payloads only through
  ``adapters/``, C-10/C-11), the segment unlinked; ``sweep_segments`` removes a dead child's.

Segment ownership and naming: docs/design.md, "A stage in its own process"; C-46 in
docs/contracts.md.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import msgspec
import torch

from omni_runtime.payload import OmniEngineCoreOutputs, StageChunk, StagePayload

__all__ = [
    "ChunkDescriptor",
    "PayloadRef",
    "ShmChunkWriter",
    "ShmEngineCoreOutputs",
    "TensorRef",
    "live_segments",
    "read_chunks",
    "sweep_segments",
]

# Where POSIX shared memory shows up as files on Linux (for sweeping by prefix).
_SHM_DIR = "/dev/shm"
# Tensors start on cache-line boundaries inside a segment.
_ALIGN = 64


class TensorRef(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    """Where one tensor's bytes sit in the chunk's segment."""

    offset: int
    nbytes: int
    dtype: str
    shape: list[int]


class PayloadRef(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    """A ``StagePayload``'s fields, tensors given as indexes into the chunk's ``tensors``."""

    request_id: str
    start: int
    num_tokens: int
    hidden: int = -1
    conditioning: int = -1
    multimodal: dict[str, int] = {}


class ChunkDescriptor(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    """One ``StageChunk`` on the wire; ``segment`` is None when it carries no tensor bytes."""

    request_id: str
    source_stage: str
    seq: int
    token_ids: list[int]
    is_final: bool
    finish_reason: str | None = None
    segment: str | None = None
    tensors: list[TensorRef] = []
    payload: PayloadRef | None = None
    # The processor's data as a tagged tree (see ``_encode``).
    data: Any = None


class ShmEngineCoreOutputs(
    OmniEngineCoreOutputs,
    array_like=True,  # type: ignore[call-arg]
    omit_defaults=True,  # type: ignore[call-arg]
    gc=False,  # type: ignore[call-arg]
):
    """The omni outputs of one step plus the descriptors of the chunks that step sent."""

    omni_chunks: list[ChunkDescriptor] | None = None


# ---- the data tree ---------------------------------------------------------------------------
# Scalars travel as themselves; every container is tagged so a user dict can never be taken for
# a tag: {"t": i} tensor i, {"p": 0} the chunk's own payload object (identity is kept),
# {"d": {...}} dict, {"l": [...]} list, {"u": [...]} tuple.

_SCALARS = (bool, int, float, str, type(None))


class _Pending:
    """A chunk waiting for the step's flush: its descriptor, and the tensors to write."""

    __slots__ = ("descriptor", "tensors")

    def __init__(self, descriptor: ChunkDescriptor, tensors: list[torch.Tensor]) -> None:
        self.descriptor = descriptor
        self.tensors = tensors


def _encode(value: Any, payload: StagePayload | None, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"t": len(tensors) - 1}
    if payload is not None and value is payload:
        return {"p": 0}
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"chunk data: dict key {k!r} is not a string")
            out[k] = _encode(v, payload, tensors)
        return {"d": out}
    if isinstance(value, list):
        return {"l": [_encode(v, payload, tensors) for v in value]}
    if isinstance(value, tuple):
        return {"u": [_encode(v, payload, tensors) for v in value]}
    raise TypeError(
        f"chunk data of type {type(value).__name__} cannot cross a process boundary "
        "(tensors, scalars, dicts, lists, tuples and the chunk's payload can)"
    )


def _decode(value: Any, payload: StagePayload | None, tensors: list[torch.Tensor]) -> Any:
    if not isinstance(value, dict):
        return value
    ((tag, inner),) = value.items()
    if tag == "t":
        return tensors[inner]
    if tag == "p":
        return payload
    if tag == "d":
        return {k: _decode(v, payload, tensors) for k, v in inner.items()}
    if tag == "l":
        return [_decode(v, payload, tensors) for v in inner]
    if tag == "u":
        return tuple(_decode(v, payload, tensors) for v in inner)
    raise ValueError(f"chunk data: unknown tag {tag!r}")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"chunk tensor: unknown dtype {name!r}")
    return dtype


# ---- the sending side (stage process) --------------------------------------------------------


class ShmChunkWriter:
    """The transfer adapter's sink inside a stage process; see the module docstring."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._pending: list[_Pending] = []
        self._names = itertools.count()

    def __len__(self) -> int:
        return len(self._pending)

    def send(self, chunk: StageChunk) -> None:
        tensors: list[torch.Tensor] = []
        payload_ref = None
        payload = chunk.payload
        if payload is not None:

            def index(t: torch.Tensor | None) -> int:
                if t is None:
                    return -1
                tensors.append(t)
                return len(tensors) - 1

            payload_ref = PayloadRef(
                payload.request_id,
                payload.start,
                payload.num_tokens,
                index(payload.hidden),
                index(payload.conditioning),
                {k: index(v) for k, v in payload.multimodal.items()},
            )
        data = _encode(chunk.data, payload, tensors)
        descriptor = ChunkDescriptor(
            chunk.request_id,
            chunk.source_stage,
            chunk.seq,
            list(chunk.token_ids),
            chunk.is_final,
            None if chunk.finish_reason is None else str(chunk.finish_reason),
            payload=payload_ref,
            data=data,
        )
        self._pending.append(_Pending(descriptor, tensors))

    def discard(self) -> None:
        """Drop pending chunks unsent (nothing was written for them yet)."""
        self._pending.clear()

    def flush(self) -> list[ChunkDescriptor]:
        """Write the pending chunks' tensors into one new segment; their descriptors, in order."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        layout: list[tuple[_Pending, list[tuple[torch.Tensor, int, int]]]] = []
        size = 0
        for item in pending:
            placed = []
            for t in item.tensors:
                t = t.detach().to("cpu").contiguous()
                nbytes = t.numel() * t.element_size()
                placed.append((t, size, nbytes))
                size += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
            layout.append((item, placed))
        name = None
        shm = None
        if size:
            name = f"{self.prefix}-{next(self._names)}"
            shm = SharedMemory(name=name, create=True, size=size)
            # The parent owns the segment from the moment the message names it: the stdlib
            # tracker must not unlink it when this process exits (or dies).
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        try:
            out = []
            for item, placed in layout:
                refs = []
                for t, offset, nbytes in placed:
                    refs.append(TensorRef(offset, nbytes, str(t.dtype), list(t.shape)))
                    if nbytes:
                        assert shm is not None
                        dst = torch.frombuffer(
                            shm.buf,  # type: ignore[arg-type]
                            dtype=torch.uint8,
                            count=nbytes,
                            offset=offset,
                        )
                        dst.copy_(t.reshape(-1).view(torch.uint8))
                        del dst
                item.descriptor.segment = name if refs and size else None
                item.descriptor.tensors = refs
                out.append(item.descriptor)
        finally:
            if shm is not None:
                shm.close()
        return out


# ---- the receiving side (orchestrator process) -----------------------------------------------


def _open_segment(name: str) -> SharedMemory:
    return SharedMemory(name=name, create=False)


def read_chunks(descriptors: Iterable[ChunkDescriptor]) -> list[StageChunk]:
    """Rebuild the chunks, copying every tensor out once, and release their segments."""
    descriptors = list(descriptors)
    segments: dict[str, SharedMemory] = {}
    chunks: list[StageChunk] = []
    try:
        for d in descriptors:
            tensors: list[torch.Tensor] = []
            for ref in d.tensors:
                dtype = _dtype(ref.dtype)
                if ref.nbytes == 0 or d.segment is None:
                    tensors.append(torch.empty(ref.shape, dtype=dtype))
                    continue
                shm = segments.get(d.segment)
                if shm is None:
                    shm = segments[d.segment] = _open_segment(d.segment)
                buf = shm.buf
                assert buf is not None
                with buf[ref.offset : ref.offset + ref.nbytes] as view:
                    raw = bytearray(view)
                tensors.append(
                    torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(ref.shape)
                )
            payload = None
            p = d.payload
            if p is not None:
                payload = StagePayload(
                    p.request_id,
                    p.start,
                    p.num_tokens,
                    tensors[p.hidden] if p.hidden >= 0 else None,
                    {k: tensors[i] for k, i in p.multimodal.items()},
                    tensors[p.conditioning] if p.conditioning >= 0 else None,
                )
            chunks.append(
                StageChunk(
                    request_id=d.request_id,
                    source_stage=d.source_stage,
                    seq=d.seq,
                    token_ids=tuple(d.token_ids),
                    payload=payload,
                    data=_decode(d.data, payload, tensors),
                    is_final=d.is_final,
                    finish_reason=d.finish_reason,
                )
            )
    finally:
        release_segments({d.segment for d in descriptors if d.segment is not None}, opened=segments)
    return chunks


def release_segments(
    names: Iterable[str], *, opened: Mapping[str, SharedMemory] | None = None
) -> None:
    """Unlink the named segments (already gone is fine); close the ones given open."""
    opened = opened or {}
    for name in names:
        shm = opened.get(name)
        if shm is not None:
            shm.close()
            shm.unlink()  # also takes it off the tracker that attaching registered it with
            continue
        try:
            os.unlink(os.path.join(_SHM_DIR, name))
        except FileNotFoundError:
            pass


def release_descriptors(descriptors: Iterable[ChunkDescriptor]) -> None:
    """Release the segments of chunks that will never be read (a dropped message)."""
    release_segments({d.segment for d in descriptors if d.segment is not None})


def live_segments(prefix: str) -> list[str]:
    """Names of the segments under ``prefix`` that still exist."""
    try:
        names = os.listdir(_SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(prefix))


def sweep_segments(prefix: str) -> list[str]:
    """Unlink every segment left under ``prefix`` (a dead child's unread ones); their names."""
    names = live_segments(prefix)
    release_segments(names)
    return names
