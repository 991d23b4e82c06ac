"""Connectors: how a stage's chunks reach the orchestrator for the next stage.

A connector is the sink the stage's transfer adapter sends into (``send``, on the engine's
thread during ``update_from_output``) and the source the orchestrator drains after the step
(``recv``). Only the orchestrator creates connectors and decides who reads them (C-21).

* ``InProcessConnector`` — a queue of chunk objects: no copy, no serialisation.
* ``PipeConnector`` — chunks serialised (raw tensor bytes, no pickles) through a relay child
  process and back; ``recv`` returns every chunk sent so far, so results do not depend on the
  connector. A relay that dies or stalls past ``recv_timeout`` is replaced, and the next
  ``recv`` raises ``ConnectorLost`` naming the requests whose chunks were lost (C-61).

Details: docs/design.md, "Inside the layers" (connectors) and "Faults and signals".
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import signal
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import fields
from typing import Any, Protocol

import numpy as np
import torch

from omni_runtime.engine._relay import relay_main
from omni_runtime.payload import StageChunk, StagePayload


class ConnectorLost(Exception):
    """Chunks sent into a connector will never come out: ``lost`` names their requests (in
    send order, without repeats), ``delivered`` holds the chunks received before the loss."""

    def __init__(
        self, name: str, lost: list[str], reason: str, delivered: list[StageChunk]
    ) -> None:
        super().__init__(f"connector {name}: chunks of {lost} lost ({reason})")
        self.name = name
        self.lost = lost
        self.reason = reason
        self.delivered = delivered


class Connector(Protocol):
    name: str

    def send(self, chunk: StageChunk) -> None: ...

    def recv(self) -> list[StageChunk]: ...

    def pending(self) -> int: ...

    def close(self) -> None: ...


class InProcessConnector:
    """Chunks stay Python objects in this process."""

    def __init__(self, name: str = "inprocess") -> None:
        self.name = name
        self._queue: deque[StageChunk] = deque()
        self.sent = 0

    def send(self, chunk: StageChunk) -> None:
        self._queue.append(chunk)
        self.sent += 1

    def recv(self) -> list[StageChunk]:
        out = list(self._queue)
        self._queue.clear()
        return out

    def pending(self) -> int:
        return len(self._queue)

    def close(self) -> None:
        self._queue.clear()


# ---- serialisation -------------------------------------------------------------------------

_TENSOR = "__tensor__"
_PAYLOAD = "__payload__"


def _pack(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        # numpy has no bfloat16: ship its bits as int16 and restore the dtype on the far side.
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        return (_TENSOR, str(t.dtype).removeprefix("torch."), tuple(t.shape), raw.numpy().tobytes())
    if isinstance(obj, StagePayload):
        return (_PAYLOAD, {f.name: _pack(getattr(obj, f.name)) for f in fields(StagePayload)})
    if isinstance(obj, dict):
        return {k: _pack(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_pack(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_pack(v) for v in obj)
    if obj is None or isinstance(obj, bool | int | float | str | bytes):
        return obj
    if hasattr(obj, "items"):  # read-only mappings (multimodal outputs)
        return {k: _pack(v) for k, v in obj.items()}
    raise TypeError(f"PipeConnector cannot serialise {type(obj).__name__}")


def _unpack(obj: Any) -> Any:
    if isinstance(obj, tuple) and obj and obj[0] == _TENSOR:
        _, dtype_name, shape, raw = obj
        dtype = getattr(torch, dtype_name)
        np_dtype = (
            np.int16 if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype
        )
        arr = np.frombuffer(raw, dtype=np_dtype).copy()
        t = torch.from_numpy(arr).reshape(shape)
        return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t
    if isinstance(obj, tuple) and len(obj) == 2 and obj[0] == _PAYLOAD:
        return StagePayload(**{k: _unpack(v) for k, v in obj[1].items()})
    if isinstance(obj, dict):
        return {k: _unpack(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unpack(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_unpack(v) for v in obj)
    return obj


def encode_chunk(chunk: StageChunk) -> bytes:
    body = {f.name: _pack(getattr(chunk, f.name)) for f in fields(StageChunk)}
    # The structure holds only builtins and bytes: pickle carries no code or tensor storage.
    return pickle.dumps(body, protocol=pickle.HIGHEST_PROTOCOL)


def decode_chunk(blob: bytes) -> StageChunk:
    body = pickle.loads(blob)
    return StageChunk(**{k: _unpack(v) for k, v in body.items()})


# ---- the cross-process connector ------------------------------------------------------------


class PipeConnector:
    """Chunks cross into a child process and back, serialised; see the module docstring."""

    def __init__(
        self,
        name: str = "pipe",
        *,
        encode: Callable[[StageChunk], bytes] = encode_chunk,
        decode: Callable[[bytes], StageChunk] = decode_chunk,
    ) -> None:
        self.name = name
        self._encode, self._decode = encode, decode
        # How long ``recv`` waits for a chunk before it declares the relay stuck.
        self.recv_timeout = 30.0
        self.bytes_sent = 0
        self.restarts = 0
        # Request ids of chunks a retired relay took with it, reported by the next ``recv``.
        self._lost: list[str] = []
        self._lost_reasons: list[str] = []
        self._spawn()

    def _spawn(self) -> None:
        # spawn, not fork: the parent holds vLLM/torch threads that a forked child would inherit
        # in an undefined state.
        ctx = mp.get_context("spawn")
        to_child_r, self._to_child = ctx.Pipe(duplex=False)
        self._from_child, from_child_w = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=relay_main,
            args=(to_child_r, from_child_w),
            name=f"omni-{self.name}",
            daemon=True,
        )
        # The relay ignores SIGINT (a terminal's Ctrl-C reaches the whole foreground process
        # group): it must not die with a traceback mid-chunk; it ends in order when this side
        # closes its pipe, or is killed by ``close``. An ignored disposition survives the
        # spawn's exec, so it is set around the start (in the main thread, where it can be).
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            self.process.start()
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        # The child owns these ends now; closing ours lets EOF propagate on shutdown.
        to_child_r.close()
        from_child_w.close()
        self.sent = 0
        self.received = 0
        # Request id of every chunk sent and not yet received, in order: what a lost relay lost.
        self._in_flight: deque[str] = deque()

    def send(self, chunk: StageChunk) -> None:
        blob = self._encode(chunk)
        if not self.process.is_alive():
            self._retire(f"relay process {self.process.pid} ended (exit {self.process.exitcode})")
        try:
            self._to_child.send_bytes(blob)
        except OSError as exc:  # it died after the check: the pipe has no reader
            self._retire(f"relay process {self.process.pid} ended ({exc!r})")
            self._to_child.send_bytes(blob)
        self.sent += 1
        self.bytes_sent += len(blob)
        self._in_flight.append(chunk.request_id)

    def recv(self) -> list[StageChunk]:
        out: list[StageChunk] = []
        while self.received < self.sent:
            try:
                if not self._from_child.poll(self.recv_timeout):
                    self._retire(
                        f"relay process {self.process.pid} stalled: nothing came back within "
                        f"{self.recv_timeout:g} s"
                    )
                    break
                blob = self._from_child.recv_bytes()
            except (EOFError, OSError) as exc:  # the relay died: its end of the pipe closed
                self._retire(f"relay process {self.process.pid} ended ({exc!r})")
                break
            out.append(self._decode(blob))
            self.received += 1
            self._in_flight.popleft()
        if self._lost:
            lost, reason = list(dict.fromkeys(self._lost)), "; ".join(self._lost_reasons)
            self._lost.clear()
            self._lost_reasons.clear()
            raise ConnectorLost(self.name, lost, reason, out)
        return out

    def _retire(self, reason: str) -> None:
        """The relay is gone or stuck: what it holds is lost. Reap it and start a fresh one;
        the next ``recv`` reports the loss."""
        self._lost.extend(self._in_flight)
        self._lost_reasons.append(reason)
        for end in (self._to_child, self._from_child):
            end.close()
        if self.process.is_alive():
            self.process.kill()  # also ends a stopped process
        self.process.join(timeout=10)
        self.restarts += 1
        self._spawn()

    def pending(self) -> int:
        return self.sent - self.received + len(self._lost)

    @property
    def child_pid(self) -> int | None:
        return self.process.pid

    def close(self) -> None:
        if self.process is None:
            return
        try:
            self._to_child.close()
            self.process.join(timeout=5)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(timeout=5)
        finally:
            self._from_child.close()


def make_connector(kind: str, name: str) -> Connector:
    if kind == "inprocess":
        return InProcessConnector(name)
    if kind == "pipe":
        return PipeConnector(name)
    raise ValueError(f"unknown connector kind {kind!r}; known: inprocess, pipe")
