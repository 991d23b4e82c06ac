"""Causal codec-id -> waveform decoder (the code2wav stage).

This module owns ``Code2Wav``: every codec id becomes exactly ``hop_length`` samples, and
every convolution is left-padded only, so the decoder can run in arbitrary chunks while
carrying the convolutions' left context (``Code2WavState``). Chunked decoding equals
whole-sequence decoding; ``StreamingDecoder`` wraps that for the serving path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from .config import Code2WavConfig
from .llama import Embedding

__all__ = [
    "Code2Wav",
    "Code2WavState",
    "StreamingDecoder",
    "init_code2wav_state_dict",
]


class CausalConv1d(nn.Module):
    """Conv1d that sees only the past: left context comes from the previous chunk."""

    def __init__(
        self, cin: int, cout: int, kernel_size: int, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        # Uninitialised on purpose: weights always come from a state dict (see llama.Linear).
        self.weight = nn.Parameter(torch.empty(cout, cin, kernel_size, device=device))
        self.bias = nn.Parameter(torch.empty(cout, device=device))
        self.context = kernel_size - 1

    def step(self, x: torch.Tensor, ctx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, C, L]; ctx: [B, C, kernel-1] or None (= zeros, the sequence start)."""
        if ctx is None:
            ctx = x.new_zeros(x.shape[0], x.shape[1], self.context)
        xx = torch.cat([ctx, x], dim=-1)
        new_ctx = xx[..., xx.shape[-1] - self.context :]
        return F.conv1d(xx, self.weight, self.bias), new_ctx


class FrameUpsample(nn.Module):
    """Transposed conv with kernel == stride: every input frame owns exactly ``factor``
    output samples and no two frames overlap, which keeps upsampling trivially chunkable."""

    def __init__(
        self, cin: int, cout: int, factor: int, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        # Same layout as nn.ConvTranspose1d ([in, out, kernel]) so the weights read naturally.
        self.weight = nn.Parameter(torch.empty(cin, cout, factor, device=device))
        self.bias = nn.Parameter(torch.empty(cout, device=device))
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv_transpose1d(x, self.weight, self.bias, stride=self.factor)


@dataclass
class Code2WavState:
    """Left contexts of every causal conv, in call order; empty list = sequence start."""

    contexts: list[torch.Tensor] = field(default_factory=list)
    frames_seen: int = 0


class Code2Wav(nn.Module):
    def __init__(self, config: Code2WavConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        k = config.kernel_size
        e = config.embed_dim
        self.embed_codes = Embedding(config.codebook_size, e, device)
        self.pre_convs = nn.ModuleList(
            CausalConv1d(e, e, k, device) for _ in range(config.num_pre_convs)
        )
        ups: list[nn.Module] = []
        up_convs: list[nn.Module] = []
        cin = e
        for factor, cout in zip(config.upsample_factors, config.upsample_channels, strict=True):
            ups.append(FrameUpsample(cin, cout, factor, device))
            up_convs.append(CausalConv1d(cout, cout, k, device))
            cin = cout
        self.upsamples = nn.ModuleList(ups)
        self.up_convs = nn.ModuleList(up_convs)
        self.out_conv = CausalConv1d(cin, 1, k, device)

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate

    @property
    def hop_length(self) -> int:
        return self.config.hop_length

    def _check_codes(self, codes: torch.Tensor) -> None:
        if codes.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"codes must be an integer tensor, got {codes.dtype}")
        if codes.numel() and (
            int(codes.min()) < 0 or int(codes.max()) >= self.config.codebook_size
        ):
            raise ValueError(
                f"codec ids must be in [0, {self.config.codebook_size}); got range "
                f"[{int(codes.min())}, {int(codes.max())}] (talker control tokens must be "
                "stripped before code2wav)"
            )

    def forward(
        self, codes: torch.Tensor, state: Code2WavState | None = None
    ) -> tuple[torch.Tensor, Code2WavState]:
        """codes [B, N] -> (waveform [B, N * hop], new state). Pass the returned state back
        in with the next chunk to continue the same sequence."""
        if codes.dim() != 2:
            raise ValueError(f"codes must be [B, N], got shape {tuple(codes.shape)}")
        self._check_codes(codes)
        old = state.contexts if state is not None else []
        new_ctx: list[torch.Tensor] = []

        def conv(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
            i = len(new_ctx)
            y, c = cast(CausalConv1d, layer).step(x, old[i] if i < len(old) else None)
            new_ctx.append(c)
            return y

        x = self.embed_codes(codes.long()).transpose(1, 2)  # [B, E, N]
        for layer in self.pre_convs:
            x = x + conv(layer, F.silu(x))
        for up, layer in zip(self.upsamples, self.up_convs, strict=True):
            x = up(F.silu(x))
            x = x + conv(layer, F.silu(x))
        wav = torch.tanh(conv(self.out_conv, F.silu(x))).squeeze(1)
        frames = (state.frames_seen if state is not None else 0) + codes.shape[1]
        return wav, Code2WavState(new_ctx, frames)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Whole-sequence decode: codes [N] -> waveform [N * hop] in [-1, 1]."""
        device = self.embed_codes.weight.device
        c = torch.as_tensor(codes, dtype=torch.long, device=device).reshape(1, -1)
        wav, _ = self.forward(c)
        return wav[0]


class StreamingDecoder:
    """Incremental ``Code2Wav`` driver: concatenated ``push`` outputs == ``decode(all)``."""

    def __init__(self, model: Code2Wav) -> None:
        self.model = model
        self._state: Code2WavState | None = None

    @property
    def frames_seen(self) -> int:
        return 0 if self._state is None else self._state.frames_seen

    @torch.no_grad()
    def push(self, codes: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Decode the next codes [n]; returns exactly n * hop new samples."""
        device = self.model.embed_codes.weight.device
        c = torch.as_tensor(codes, dtype=torch.long, device=device).reshape(1, -1)
        if c.shape[1] == 0:
            return torch.zeros(0, dtype=self.model.embed_codes.weight.dtype, device=device)
        wav, self._state = self.model(c, self._state)
        return wav[0]

    def flush(self) -> torch.Tensor:
        """End the sequence. The decoder has no lookahead, so nothing is pending: returns an
        empty tensor and resets to a fresh sequence."""
        w = self.model.embed_codes.weight
        self._state = None
        return torch.zeros(0, dtype=w.dtype, device=w.device)

    def reset(self) -> None:
        self._state = None


_EMBED_STD = 1.0
_BIAS_STD = 0.02
# Gain over 1/sqrt(fan_in): keeps activations O(1) through the residual stack so the tanh
# output spans a useful range instead of collapsing to ~0 or saturating at +-1.
_CONV_GAIN = 1.0
_OUT_GAIN = 0.6


def init_code2wav_state_dict(cfg: Code2WavConfig, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    skeleton = Code2Wav(cfg, device="meta")
    out: dict[str, torch.Tensor] = {}
    for name, p in skeleton.named_parameters():
        noise = torch.randn(tuple(p.shape), generator=gen, dtype=torch.float32)
        if name.startswith("embed_codes"):
            out[name] = _EMBED_STD * noise
        elif name.endswith(".bias"):
            out[name] = _BIAS_STD * noise
        else:
            # Conv1d weight [out, in, k]: fan_in = in*k. ConvTranspose1d weight [in, out, f]:
            # each output sample sees `in` inputs.
            is_up = name.startswith("upsamples")
            fan_in = p.shape[0] if is_up else p.shape[1] * p.shape[2]
            gain = _OUT_GAIN if name.startswith("out_conv") else _CONV_GAIN
            out[name] = (gain / fan_in**0.5) * noise
    return out
