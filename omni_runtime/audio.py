"""Waveform files: float waveforms in [-1, 1] written as 16-bit PCM mono WAV (stdlib ``wave``)."""

from __future__ import annotations

import os
import wave
from pathlib import Path

import numpy as np
import torch


def to_pcm16(waveform: torch.Tensor | np.ndarray) -> bytes:
    """Little-endian signed 16-bit samples; values outside [-1, 1] are clipped."""
    data = waveform.detach().cpu().numpy() if isinstance(waveform, torch.Tensor) else waveform
    data = np.clip(np.asarray(data, dtype=np.float64).reshape(-1), -1.0, 1.0)
    # Scale by 32767 so +1.0 and -1.0 both fit without wrapping.
    return np.round(data * 32767.0).astype("<i2").tobytes()


def write_wav(
    path: str | os.PathLike[str], waveform: torch.Tensor | np.ndarray, sample_rate: int
) -> Path:
    out = Path(path)
    if out.parent != Path(""):
        out.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(out), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(int(sample_rate))
        f.writeframes(to_pcm16(waveform))
    return out


def read_wav(path: str | os.PathLike[str]) -> tuple[np.ndarray, int]:
    """Samples as float32 in [-1, 1] and the sample rate (mono 16-bit files only)."""
    with wave.open(str(path), "rb") as f:
        if f.getnchannels() != 1 or f.getsampwidth() != 2:
            raise ValueError(f"{path}: expected 16-bit mono PCM")
        raw = f.readframes(f.getnframes())
        rate = f.getframerate()
    return np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32767.0, rate
