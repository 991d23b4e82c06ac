"""The code2wav stage: streamed codec chunks in, audio samples out, one decoder per request.

``Code2WavStage`` is not an LM and has no vLLM engine: the orchestrator calls ``push`` directly
with each codec chunk the talker's connector delivers, and each request gets its own causal
``StreamingDecoder``, so audio is produced while the talker is still generating. A final chunk
flushes and drops the request's decoder; the concatenated samples equal ``decode`` of the
whole code sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omni_runtime.engine.config import resolve_model
from omni_runtime.engine.graph import Code2WavStageSpec
from omni_runtime.models import Code2Wav, StreamingDecoder, load_model
from omni_runtime.payload import StageChunk

__all__ = ["AudioChunk", "Code2WavStage"]


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
