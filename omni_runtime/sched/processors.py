"""Chunk processors shipped with the runtime, used by the embedded thinker -> talker -> code2wav graph.

A processor is a plain callable ``(request_id, payload, is_final[, new_token_ids])`` returning the
data to deliver downstream, or None for "nothing this step"; the transfer adapter decides when to
call it (``sched.transfer``). Processors may keep per-request buffers; they must release them on
the ``is_final`` call, which every request with a downstream consumer gets exactly once, and
offer ``release(request_id)`` for the case where that call itself raised. A processor that
declares ``requires_token_updates`` may also offer ``on_token_batch(request_ids, token_ids,
counts)``, which the adapter calls once for a run of requests whose calls would all have carried
only ids; ``sched.transfer`` describes it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch

from omni_runtime.payload import StagePayload


class HiddenRowsForwarder:
    """Thinker -> talker: forwards each step's hidden rows and the prefill conditioning.

    Triggered by tensor payloads only (no ``requires_token_updates``): the talker is conditioned on
    hidden states, not on sampled ids.
    """

    def __call__(self, request_id: str, payload: StagePayload | None, is_final: bool) -> Any:
        if payload is None:
            return None
        return {
            "hidden": payload.hidden,
            "conditioning": payload.conditioning,
            "start": payload.start,
        }


class CodecTokenStreamer:
    """Talker -> code2wav: streams codec ids in fixed-size groups while the talker generates.

    The talker runs token-only (no hidden rows cross), so this processor declares
    ``requires_token_updates = True`` to be called with every nonempty list of sampled ids. It
    emits a ``LongTensor`` of ``chunk_size`` codec ids whenever that many are buffered, and the
    remainder (possibly empty) on the final call. Ids outside ``[0, codec_vocab)`` (the talker's
    special tokens such as its EOS) are not audio and are dropped.

    The adapter hands it a step's ids-only calls as one ``on_token_batch``. Those steps are kept
    whole, in arrival order, until a request could have a full chunk: with one id per request per
    step and every request in phase (steady decode), that is one step in ``chunk_size``, and the
    steps in between cost one list append each instead of one buffer update per request. Every
    other entry point (the per-request call, ``release``, ``pending_request_ids``) first spreads
    the kept steps into the per-request buffers, so what it sees is what per-request calls would
    have left.
    """

    requires_token_updates = True

    def __init__(self, chunk_size: int = 8, codec_vocab: int = 256) -> None:
        self.chunk_size = chunk_size
        self.codec_vocab = codec_vocab
        self._buffers: dict[str, list[int]] = {}
        # Batched steps not spread into ``_buffers`` yet, oldest first: (request ids, their ids
        # concatenated, ids per request or None for one each).
        self._steps: list[tuple[Sequence[str], list[int], Sequence[int] | None]] = []
        # At least the length of the longest buffer once ``_steps`` is spread. While it stays
        # below ``chunk_size`` no request can have a chunk to emit, which is what lets a batched
        # step be kept whole (and returns nothing, as each of its per-request calls would have).
        self._fill = 0

    def __call__(
        self,
        request_id: str,
        payload: StagePayload | None,
        is_final: bool,
        new_token_ids: list[int] | None = None,
    ) -> torch.Tensor | None:
        if self._steps:
            self._spread()
        buf = self._buffers.get(request_id)
        if buf is None:
            buf = self._buffers[request_id] = []
        vocab = self.codec_vocab
        if new_token_ids:
            for t in new_token_ids:
                if 0 <= t < vocab:
                    buf.append(t)
        if is_final:
            self._buffers.pop(request_id, None)
            return torch.tensor(buf, dtype=torch.long)
        if len(buf) < self.chunk_size:
            if len(buf) > self._fill:
                self._fill = len(buf)
            return None
        n = len(buf) - len(buf) % self.chunk_size
        out, self._buffers[request_id] = buf[:n], buf[n:]
        # What stays is shorter than a chunk; it still bounds the next batched steps.
        self._fill = max(self._fill, len(buf) - n)
        return torch.tensor(out, dtype=torch.long)

    def on_token_batch(
        self, request_ids: Sequence[str], token_ids: list[int], counts: Sequence[int] | None
    ) -> Mapping[str, torch.Tensor] | None:
        """The calls ``self(rid, None, False, new_token_ids=ids)`` of one run of requests, at
        once: the chunks they would have returned, by request id, in ``request_ids`` order."""
        self._steps.append((request_ids, token_ids, counts))
        self._fill += 1 if counts is None else max(counts)
        if self._fill < self.chunk_size:
            return None
        self._spread()
        bufs = self._buffers
        size = self.chunk_size
        out: dict[str, torch.Tensor] = {}
        # Only the requests of this step can have reached a chunk: before it, the bound showed
        # that none had.
        for rid in request_ids:
            buf = bufs[rid]
            if len(buf) >= size:
                n = len(buf) - len(buf) % size
                out[rid] = torch.tensor(buf[:n], dtype=torch.long)
                bufs[rid] = buf[n:]
        self._fill = max(map(len, bufs.values()), default=0)
        return out

    def _spread(self) -> None:
        """Append the kept steps' ids to the per-request buffers, in arrival order, exactly as
        their per-request calls would have."""
        bufs = self._buffers
        get = bufs.get
        vocab = self.codec_vocab
        for request_ids, token_ids, counts in self._steps:
            if counts is None and token_ids and min(token_ids) >= 0 and max(token_ids) < vocab:
                # One id per request, all of them audio: appended without a bytecode loop.
                found = list(map(get, request_ids))
                if None in found:
                    for i, rid in enumerate(request_ids):
                        if found[i] is None:
                            found[i] = bufs[rid] = []
                targets = cast(list[list[int]], found)
                deque(map(list.append, targets, token_ids), maxlen=0)
                continue
            pos = 0
            for i, rid in enumerate(request_ids):
                end = pos + (1 if counts is None else counts[i])
                buf = get(rid)
                if buf is None:
                    buf = bufs[rid] = []
                for t in token_ids[pos:end]:
                    if 0 <= t < vocab:
                        buf.append(t)
                pos = end
        self._steps.clear()

    def release(self, request_id: str) -> None:
        if self._steps:
            self._spread()
        self._buffers.pop(request_id, None)

    def pending_request_ids(self) -> set[str]:
        if self._steps:
            self._spread()
        return set(self._buffers)
