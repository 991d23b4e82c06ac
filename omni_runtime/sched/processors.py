"""Chunk processors shipped with the runtime, used by the embedded thinker -> talker -> code2wav graph.

A processor is a plain callable ``(request_id, payload, is_final[, new_token_ids])`` returning the
data to deliver downstream, or None for "nothing this step"; the transfer adapter decides when to
call it (``sched.transfer``). Processors may keep per-request buffers; they must release them on
the ``is_final`` call, which every request with a downstream consumer gets exactly once, and
offer ``release(request_id)`` for the case where that call itself raised.
"""

from __future__ import annotations

from typing import Any

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
    """

    requires_token_updates = True

    def __init__(self, chunk_size: int = 8, codec_vocab: int = 256) -> None:
        self.chunk_size = chunk_size
        self.codec_vocab = codec_vocab
        self._buffers: dict[str, list[int]] = {}

    def __call__(
        self,
        request_id: str,
        payload: StagePayload | None,
        is_final: bool,
        new_token_ids: list[int] | None = None,
    ) -> torch.Tensor | None:
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
            return None
        n = len(buf) - len(buf) % self.chunk_size
        out, self._buffers[request_id] = buf[:n], buf[n:]
        return torch.tensor(out, dtype=torch.long)

    def release(self, request_id: str) -> None:
        self._buffers.pop(request_id, None)

    def pending_request_ids(self) -> set[str]:
        return set(self._buffers)
