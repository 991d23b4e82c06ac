"""Configuration dataclasses for the omni stage models (thinker, talker, code2wav).

This module owns the architecture hyper-parameters of the small stage models and their
round-trip to HF-style ``config.json`` dictionaries. The dictionaries are written so that
``transformers.LlamaConfig`` / vLLM's ``ModelConfig`` can read the Llama ones unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "CODEC_BOS_ID",
    "CODEC_EOS_ID",
    "CODEC_PAD_ID",
    "CODEC_VOCAB_SIZE",
    "PAYLOAD_POSTPROCESSES",
    "TALKER_VOCAB_SIZE",
    "Code2WavConfig",
    "LlamaLMConfig",
    "code2wav_config",
    "config_fingerprint",
    "talker_config",
    "thinker_config",
    "thinker_post_config",
]

# What a Llama stage model's payload postprocess (``LlamaLM.omni_postprocess``) may be:
# "positions" tags each payload with the token positions its rows cover. None: no hook.
PAYLOAD_POSTPROCESSES = ("positions",)

# Codec id layout shared by the talker (which emits them) and code2wav (which consumes them):
# ids [0, 256) are acoustic codes, the ones above are control tokens the talker may emit but
# that must never reach the waveform decoder.
CODEC_VOCAB_SIZE = 256
CODEC_BOS_ID = 256
CODEC_EOS_ID = 257
CODEC_PAD_ID = 258
TALKER_VOCAB_SIZE = 264  # 256 codes + 8 control slots (3 used, 5 reserved)


@dataclass(frozen=True)
class LlamaLMConfig:
    """Hyper-parameters of the Llama-style decoder used for the thinker and the talker."""

    model_type: ClassVar[str] = "llama"
    architecture: ClassVar[str] = "LlamaForCausalLM"

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 512
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0
    # The model's payload postprocess (one of ``PAYLOAD_POSTPROCESSES``), or None for none.
    payload_postprocess: str | None = None

    def __post_init__(self) -> None:
        if self.payload_postprocess not in (None, *PAYLOAD_POSTPROCESSES):
            raise ValueError(
                f"payload_postprocess={self.payload_postprocess!r}: expected None or one of "
                f"{', '.join(PAYLOAD_POSTPROCESSES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            tok = getattr(self, name)
            if not 0 <= tok < self.vocab_size:
                raise ValueError(f"{name}={tok} outside vocab of size {self.vocab_size}")

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def to_hf_dict(self) -> dict[str, Any]:
        """HF ``config.json`` content, readable by transformers 5 and vLLM (which keep the
        omni key of a payload postprocess as an extra attribute; it is written only when set,
        so a model without one has the same folder as before the key existed)."""
        extra = (
            {}
            if self.payload_postprocess is None
            else {"omni_payload_postprocess": self.payload_postprocess}
        )
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            # transformers 5 reads rope_parameters; the flat rope_theta is kept for older readers
            # (vLLM's patch_rope_parameters and transformers 4.x). Both say the same thing, and
            # rope_scaling is left out because transformers 5 would let it override
            # rope_parameters.
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "pretraining_tp": 1,
            "tie_word_embeddings": False,
            "use_cache": True,
            "initializer_range": 0.02,
            "torch_dtype": "float32",
            "dtype": "float32",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            **extra,
        }

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> LlamaLMConfig:
        if d.get("model_type") != cls.model_type:
            raise ValueError(f"expected model_type {cls.model_type!r}, got {d.get('model_type')!r}")
        if d.get("tie_word_embeddings", False):
            raise ValueError("tied word embeddings are not supported by LlamaLM")
        if d.get("attention_bias", False) or d.get("mlp_bias", False):
            raise ValueError("biased projections are not supported by LlamaLM")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"only default RoPE is supported, got rope_type={rope_type!r}")
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        n_heads = int(d["num_attention_heads"])
        head_dim = d.get("head_dim") or int(d["hidden_size"]) // n_heads
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=n_heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or n_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(d["max_position_embeddings"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            bos_token_id=_single_id(d.get("bos_token_id"), 1),
            eos_token_id=_single_id(d.get("eos_token_id"), 2),
            pad_token_id=_single_id(d.get("pad_token_id"), 0),
            payload_postprocess=d.get("omni_payload_postprocess"),
        )


@dataclass(frozen=True)
class Code2WavConfig:
    """Hyper-parameters of the causal codec-to-waveform decoder."""

    model_type: ClassVar[str] = "omni_code2wav"
    architecture: ClassVar[str] = "OmniCode2Wav"

    codebook_size: int = CODEC_VOCAB_SIZE
    embed_dim: int = 64
    num_pre_convs: int = 2
    # Product of the factors is the hop length; each stage halves (roughly) the channels so
    # the sample-rate convs stay cheap on CPU.
    upsample_factors: tuple[int, ...] = (4, 6, 10)
    upsample_channels: tuple[int, ...] = (32, 16, 8)
    kernel_size: int = 3
    sample_rate: int = 24000
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        if len(self.upsample_factors) != len(self.upsample_channels):
            raise ValueError("upsample_factors and upsample_channels must have equal length")
        if self.kernel_size < 1:
            raise ValueError("kernel_size must be >= 1")

    @property
    def hop_length(self) -> int:
        hop = 1
        for f in self.upsample_factors:
            hop *= f
        return hop

    def to_hf_dict(self) -> dict[str, Any]:
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "codebook_size": self.codebook_size,
            "embed_dim": self.embed_dim,
            "num_pre_convs": self.num_pre_convs,
            "upsample_factors": list(self.upsample_factors),
            "upsample_channels": list(self.upsample_channels),
            "kernel_size": self.kernel_size,
            "sample_rate": self.sample_rate,
            "hop_length": self.hop_length,
            # LLM-ish fields only so that generic config readers (vLLM ModelConfig) that get
            # pointed at this folder find what they look for instead of crashing.
            "vocab_size": self.codebook_size,
            "hidden_size": self.embed_dim,
            "num_hidden_layers": 1,
            "num_attention_heads": 1,
            "num_key_value_heads": 1,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "dtype": "float32",
        }

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Code2WavConfig:
        if d.get("model_type") != cls.model_type:
            raise ValueError(f"expected model_type {cls.model_type!r}, got {d.get('model_type')!r}")
        cfg = cls(
            codebook_size=int(d["codebook_size"]),
            embed_dim=int(d["embed_dim"]),
            num_pre_convs=int(d["num_pre_convs"]),
            upsample_factors=tuple(int(x) for x in d["upsample_factors"]),
            upsample_channels=tuple(int(x) for x in d["upsample_channels"]),
            kernel_size=int(d["kernel_size"]),
            sample_rate=int(d["sample_rate"]),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        )
        if "hop_length" in d and int(d["hop_length"]) != cfg.hop_length:
            raise ValueError(
                f"hop_length={d['hop_length']} disagrees with upsample_factors "
                f"{cfg.upsample_factors} (product {cfg.hop_length})"
            )
        return cfg


def _single_id(value: Any, default: int) -> int:
    # HF allows a list of eos ids; the stage models only ever use one.
    if value is None:
        return default
    if isinstance(value, list):
        return int(value[0])
    return int(value)


def thinker_config() -> LlamaLMConfig:
    return LlamaLMConfig(vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def thinker_post_config() -> LlamaLMConfig:
    """The thinker with a payload postprocess (same shapes, so the same weights for one seed)."""
    return dataclasses.replace(thinker_config(), payload_postprocess="positions")


def talker_config() -> LlamaLMConfig:
    return LlamaLMConfig(
        vocab_size=TALKER_VOCAB_SIZE,
        bos_token_id=CODEC_BOS_ID,
        eos_token_id=CODEC_EOS_ID,
        pad_token_id=CODEC_PAD_ID,
    )


def code2wav_config() -> Code2WavConfig:
    return Code2WavConfig()


def config_fingerprint(obj: Any) -> str:
    """Short stable hash of a JSON-serialisable description (used as the folder version)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = obj.to_hf_dict()  # type: ignore[attr-defined]
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:12]
