"""Small real stage models (thinker, talker, code2wav) and their on-disk weight folders.

This package owns materialising each stage model as an HF-style folder (``config.json`` +
``model.safetensors``, weights drawn deterministically from a fixed seed) and loading such
a folder back into the matching ``nn.Module``. Folders are created lazily and atomically
under ``$OMNI_RUNTIME_MODEL_DIR`` (or ``~/.cache/omni_runtime/models``) as
``<name>-<version>``, where the version fingerprints the architecture, seed and init scheme.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .code2wav import Code2Wav, Code2WavState, StreamingDecoder, init_code2wav_state_dict
from .config import (
    CODEC_BOS_ID,
    CODEC_EOS_ID,
    CODEC_PAD_ID,
    CODEC_VOCAB_SIZE,
    TALKER_VOCAB_SIZE,
    Code2WavConfig,
    LlamaLMConfig,
    code2wav_config,
    config_fingerprint,
    talker_config,
    thinker_config,
    thinker_post_config,
)
from .llama import AttnFn, LlamaLM, init_llama_state_dict, reference_attention

__all__ = [
    "CODEC_BOS_ID",
    "CODEC_EOS_ID",
    "CODEC_PAD_ID",
    "CODEC_VOCAB_SIZE",
    "MODEL_DIR_ENV",
    "MODEL_NAMES",
    "TALKER_VOCAB_SIZE",
    "AttnFn",
    "Code2Wav",
    "Code2WavConfig",
    "Code2WavState",
    "LlamaLM",
    "LlamaLMConfig",
    "StreamingDecoder",
    "default_config",
    "load_config",
    "load_model",
    "model_dir",
    "model_version",
    "reference_attention",
]

MODEL_DIR_ENV = "OMNI_RUNTIME_MODEL_DIR"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# Bump when the on-disk layout or the init code changes in a way the config hash can't see.
_FORMAT_VERSION = 1

StageConfig = LlamaLMConfig | Code2WavConfig
StageModel = LlamaLM | Code2Wav


@dataclass(frozen=True)
class _Spec:
    make_config: Callable[[], StageConfig]
    seed: int
    init: Callable[[Any, int], dict[str, torch.Tensor]]


_SPECS: dict[str, _Spec] = {
    "thinker": _Spec(thinker_config, 20240601, init_llama_state_dict),
    # The thinker (same shapes and seed, so the same weights) with a payload postprocess.
    "thinker-post": _Spec(thinker_post_config, 20240601, init_llama_state_dict),
    "talker": _Spec(talker_config, 20240602, init_llama_state_dict),
    "code2wav": _Spec(code2wav_config, 20240603, init_code2wav_state_dict),
}
MODEL_NAMES: tuple[str, ...] = tuple(_SPECS)


def _spec(name: str) -> _Spec:
    try:
        return _SPECS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown model name {name!r}; known models: {', '.join(MODEL_NAMES)}"
        ) from None


def default_config(name: str) -> StageConfig:
    """The built-in config of stage model ``name``."""
    return _spec(name).make_config()


def model_version(name: str) -> str:
    """Short fingerprint of everything that determines the bytes of ``name``'s folder."""
    spec = _spec(name)
    from . import code2wav as _c2w
    from . import llama as _llama

    init_scales: dict[str, Any] = (
        dict(_llama._INIT_STD)
        if spec.init is init_llama_state_dict
        else {
            "embed": _c2w._EMBED_STD,
            "bias": _c2w._BIAS_STD,
            "conv": _c2w._CONV_GAIN,
            "out": _c2w._OUT_GAIN,
        }
    )
    return config_fingerprint(
        {
            "format": _FORMAT_VERSION,
            "config": spec.make_config().to_hf_dict(),
            "seed": spec.seed,
            "init": init_scales,
        }
    )


def _models_root() -> Path:
    env = os.environ.get(MODEL_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "omni_runtime" / "models"


def _is_complete(folder: Path) -> bool:
    return (folder / CONFIG_FILE).is_file() and (folder / WEIGHTS_FILE).is_file()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_folder(name: str, folder: Path) -> None:
    spec = _spec(name)
    cfg = spec.make_config()
    state = {k: v.contiguous() for k, v in spec.init(cfg, spec.seed).items()}
    cfg_path = folder / CONFIG_FILE
    cfg_path.write_text(json.dumps(cfg.to_hf_dict(), indent=2, sort_keys=True) + "\n")
    # "format": "pt" is what transformers checks before trusting a safetensors file.
    save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    # The rename below is only a commit point if the contents reached the disk first.
    _fsync(cfg_path)
    _fsync(folder / WEIGHTS_FILE)


def model_dir(name: str) -> Path:
    """Local folder of stage model ``name`` ("thinker", "talker", "code2wav", or
    "thinker-post", the thinker with a payload postprocess).

    Created on first use; safe to call concurrently from several processes: each builds
    the folder privately and publishes it with an atomic rename, and losers of the race
    just use the winner's (byte-identical) folder.
    """
    version = model_version(name)
    root = _models_root()
    target = root / f"{name}-{version}"
    if _is_complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-{version}.tmp-", dir=root))
    try:
        _write_folder(name, tmp)
        try:
            # Directory rename fails if the target is a non-empty directory (another
            # process won) and atomically replaces an empty one.
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if not _is_complete(target):
        raise RuntimeError(f"model folder {target} exists but is incomplete; delete it")
    return target


def _resolve(path_or_name: str | os.PathLike[str]) -> Path:
    if isinstance(path_or_name, str) and path_or_name in _SPECS:
        return model_dir(path_or_name)
    path = Path(path_or_name)
    if not path.is_dir():
        raise ValueError(
            f"{str(path_or_name)!r} is neither a model folder nor a known model name "
            f"({', '.join(MODEL_NAMES)})"
        )
    return path


def load_config(path_or_name: str | os.PathLike[str]) -> StageConfig:
    """Parse ``config.json`` of a stage-model folder (or built-in name) into its dataclass."""
    folder = _resolve(path_or_name)
    raw = json.loads((folder / CONFIG_FILE).read_text())
    model_type = raw.get("model_type")
    if model_type == LlamaLMConfig.model_type:
        return LlamaLMConfig.from_hf_dict(raw)
    if model_type == Code2WavConfig.model_type:
        return Code2WavConfig.from_hf_dict(raw)
    raise ValueError(f"{folder / CONFIG_FILE}: unsupported model_type {model_type!r}")


def load_model(
    path_or_name: str | os.PathLike[str],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> StageModel:
    """Build the module described by a folder's ``config.json`` and load its safetensors
    weights (strict). Returns an eval-mode, grad-free ``LlamaLM`` or ``Code2Wav``."""
    folder = _resolve(path_or_name)
    cfg = load_config(folder)
    # Built on the meta device so construction costs nothing and leaves the global RNG alone;
    # assign=True then adopts the loaded tensors as the parameters.
    module: StageModel = (
        LlamaLM(cfg, device="meta") if isinstance(cfg, LlamaLMConfig) else Code2Wav(cfg, "meta")
    )
    state = load_file(str(folder / WEIGHTS_FILE), device="cpu")
    module.load_state_dict(state, strict=True, assign=True)
    module.to(device=device, dtype=dtype)
    module.requires_grad_(False)
    return module.eval()
