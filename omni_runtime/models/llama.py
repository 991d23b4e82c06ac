"""Llama-style decoder-only LM used for the thinker and talker stages.

This module owns the network definition (parameter names identical to HF
``LlamaForCausalLM``), its deterministic weight initialisation, and a decomposition
(``embed`` / ``forward_layers`` / ``logits``) that lets a model runner supply its own
attention over a paged KV cache. ``forward`` and ``greedy_generate`` are cacheless full
recomputes meant as references for tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import LlamaLMConfig

__all__ = [
    "AttnFn",
    "LlamaLM",
    "apply_rotary",
    "init_llama_state_dict",
    "reference_attention",
    "rope_cos_sin",
]

# (layer_idx, q [T, n_heads, head_dim], k [T, n_kv, head_dim], v [T, n_kv, head_dim])
#   -> attention output [T, n_heads, head_dim]
AttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# Minimal layers instead of nn.Linear / nn.Embedding: those run their default random init at
# construction, which consumes the global RNG and, on the meta device, pulls in
# torch._dynamo (~1.5 s per process). Weights here always come from a state dict, so the
# parameters are created uninitialised.
class Linear(nn.Module):
    def __init__(
        self, in_features: int, out_features: int, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim, device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 and the weight applied after casting back mirrors HF Llama, which
        # keeps low-precision runs numerically aligned with the reference implementation.
        in_dtype = x.dtype
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(in_dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape ``[*positions.shape, head_dim]`` (halves duplicated)."""
    inv_freq = 1.0 / (
        theta
        ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    )
    freqs = positions[..., None].to(torch.float32) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, head_dim] with per-token cos/sin [T, head_dim]."""
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    return (x * cos) + (_rotate_half(x) * sin)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention without a cache.

    q: [T, n_heads, d]; k, v: [S, n_kv, d] with S >= T. The T queries are the *last* T
    positions of the S keys, so the same function serves full recompute (S == T) and
    incremental decoding over a contiguous cache (S > T).
    Returns [T, n_heads, d].
    """
    t, n_heads, d = q.shape
    s, n_kv, _ = k.shape
    if s < t:
        raise ValueError(f"need at least as many keys ({s}) as queries ({t})")
    if n_heads % n_kv != 0:
        raise ValueError(f"n_heads={n_heads} not a multiple of n_kv_heads={n_kv}")
    groups = n_heads // n_kv
    kh = k.repeat_interleave(groups, dim=1).transpose(0, 1)  # [H, S, d]
    vh = v.repeat_interleave(groups, dim=1).transpose(0, 1)
    qh = q.transpose(0, 1)  # [H, T, d]
    scores = torch.matmul(qh, kh.transpose(1, 2)) * (1.0 / math.sqrt(d))
    q_pos = torch.arange(s - t, s, device=q.device)[:, None]
    k_pos = torch.arange(s, device=q.device)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, vh).transpose(0, 1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaLMConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(h, cfg.num_attention_heads * d, device)
        self.k_proj = Linear(h, cfg.num_key_value_heads * d, device)
        self.v_proj = Linear(h, cfg.num_key_value_heads * d, device)
        self.o_proj = Linear(cfg.num_attention_heads * d, h, device)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaLMConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(h, i, device)
        self.up_proj = Linear(h, i, device)
        self.down_proj = Linear(i, h, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaLMConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, device)
        self.mlp = LlamaMLP(cfg, device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.config = cfg

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_idx: int,
        attn_fn: AttnFn,
    ) -> torch.Tensor:
        cfg = self.config
        t = hidden.shape[0]
        attn = self.self_attn
        x = self.input_layernorm(hidden)
        q = attn.q_proj(x).view(t, cfg.num_attention_heads, cfg.head_dim)
        k = attn.k_proj(x).view(t, cfg.num_key_value_heads, cfg.head_dim)
        v = attn.v_proj(x).view(t, cfg.num_key_value_heads, cfg.head_dim)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        out = attn_fn(layer_idx, q, k, v)
        if out.shape != q.shape:
            raise ValueError(
                f"attn_fn returned shape {tuple(out.shape)} for layer {layer_idx}, "
                f"expected {tuple(q.shape)}"
            )
        hidden = hidden + attn.o_proj(out.reshape(t, cfg.num_attention_heads * cfg.head_dim))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaBackbone(nn.Module):
    def __init__(self, cfg: LlamaLMConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, device) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)


class LlamaLM(nn.Module):
    """Decoder-only LM whose ``state_dict`` keys equal HF ``LlamaForCausalLM``'s."""

    def __init__(self, config: LlamaLMConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBackbone(config, device)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, device)
        # The model's postprocess of each payload an omni stage builds for it, as its config
        # names it (``payload_postprocess``); None: none. The runner applies it to every
        # request's payload of every step, one with nothing else to deliver included. A plain
        # attribute, so a caller may still install a hook of its own on an instance.
        self.omni_postprocess: Callable[[Any], Any] | None = (
            self.tag_positions if config.payload_postprocess == "positions" else None
        )

    # ---- shape facts a runner needs to size its KV cache -------------------------------
    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    # ---- paged-attention-friendly decomposition -----------------------------------------
    def get_input_embeddings(self) -> nn.Module:
        """The token embedding module (vLLM's model interface name for it)."""
        return self.model.embed_tokens

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: ``[T] -> [T, H]`` (any leading shape works)."""
        return self.model.embed_tokens(input_ids)

    def forward_layers(
        self, hidden: torch.Tensor, positions: torch.Tensor, attn_fn: AttnFn
    ) -> torch.Tensor:
        """Run all decoder layers on ``hidden`` [T, H] at ``positions`` [T].

        ``attn_fn(layer_idx, q, k, v)`` receives RoPE'd q [T, n_heads, d] and k/v
        [T, n_kv, d] for the T new tokens only; it owns any cache and must return
        [T, n_heads, d]. Returns the final-normed hidden states [T, H].
        """
        if hidden.dim() != 2:
            raise ValueError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
        if positions.shape != hidden.shape[:1]:
            raise ValueError(
                f"positions shape {tuple(positions.shape)} does not match T={hidden.shape[0]}"
            )
        cfg = self.config
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, hidden.dtype)
        for idx, layer in enumerate(self.model.layers):
            hidden = layer(hidden, cos, sin, idx, attn_fn)
        return self.model.norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, H] -> [T, vocab]``."""
        return self.lm_head(hidden)

    def hidden_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, H] -> [T, 1]``: each position's final hidden state's L2 norm (a per-token
        energy a downstream stage may condition on)."""
        return torch.linalg.vector_norm(hidden, dim=-1, keepdim=True)

    @property
    def omni_output_producers(self) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
        """Per-token outputs, beyond ``logits``, that an omni stage may name in
        ``multimodal_outputs``: each maps the step's final hidden rows [T, H] to [T, ...]."""
        return {"hidden_norm": self.hidden_norm}

    @staticmethod
    def tag_positions(payload: Any) -> Any:
        """Adds ``multimodal["positions"]``, the token positions ``[start, start +
        num_tokens)`` the payload covers, and keeps everything the payload already holds (the
        same object is returned)."""
        payload.multimodal["positions"] = torch.arange(
            payload.start, payload.start + payload.num_tokens
        )
        return payload

    # ---- cacheless reference path --------------------------------------------------------
    def forward_embeds(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Full causal recompute from embeddings [T, H] -> logits [T, vocab]."""
        if positions is None:
            positions = torch.arange(inputs_embeds.shape[0], device=inputs_embeds.device)

        def attn(_: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return reference_attention(q, k, v)

        return self.logits(self.forward_layers(inputs_embeds, positions, attn))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Full causal recompute: ids [T] -> [T, V], or [B, T] -> [B, T, V]."""
        if input_ids.dim() == 1:
            return self.forward_embeds(self.embed(input_ids), positions)
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [T] or [B, T], got {tuple(input_ids.shape)}")
        rows = []
        for b in range(input_ids.shape[0]):
            pos_b = (
                None if positions is None else positions[b] if positions.dim() == 2 else positions
            )
            rows.append(self.forward_embeds(self.embed(input_ids[b]), pos_b))
        return torch.stack(rows)

    @torch.no_grad()
    def greedy_generate(
        self,
        prompt_ids: torch.Tensor | Sequence[int],
        max_new_tokens: int,
        *,
        stop_at_eos: bool = True,
        eos_token_id: int | None = None,
    ) -> torch.Tensor:
        """Greedy decoding by full recompute. Returns only the new token ids (1-D).

        Like HF ``generate``, an emitted EOS is kept and ends generation when
        ``stop_at_eos`` is set.
        """
        device = self.lm_head.weight.device
        ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("prompt_ids must not be empty")
        return self.greedy_generate_from_embeds(
            self.embed(ids), max_new_tokens, stop_at_eos=stop_at_eos, eos_token_id=eos_token_id
        )

    @torch.no_grad()
    def greedy_generate_from_embeds(
        self,
        prompt_embeds: torch.Tensor,
        max_new_tokens: int,
        *,
        stop_at_eos: bool = True,
        eos_token_id: int | None = None,
    ) -> torch.Tensor:
        """Greedy decoding from a prompt given as embeddings [T, H] (the talker's input is
        projected thinker states, not ids); generated tokens are embedded as usual."""
        if prompt_embeds.dim() != 2 or prompt_embeds.shape[0] == 0:
            raise ValueError(f"prompt_embeds must be non-empty [T, H], got {prompt_embeds.shape}")
        eos = self.config.eos_token_id if eos_token_id is None else eos_token_id
        embeds = prompt_embeds
        new: list[int] = []
        for _ in range(max_new_tokens):
            nxt = int(self.forward_embeds(embeds)[-1].argmax())
            new.append(nxt)
            nxt_ids = torch.tensor([nxt], dtype=torch.long, device=embeds.device)
            embeds = torch.cat([embeds, self.embed(nxt_ids).to(embeds.dtype)])
            if stop_at_eos and nxt == eos:
                break
        return torch.tensor(new, dtype=torch.long, device=prompt_embeds.device)


# Init scales chosen for a *random* model that still behaves like an LM under greedy
# decoding: wide embeddings and lm_head make per-token logits spread out (no near-ties, so
# our kernels and HF pick the same argmax), and q/k larger than 1/sqrt(H) give attention
# enough contrast that the next token depends on context, not only on the last token.
_INIT_STD = {
    "embed_tokens": 0.5,
    "q_proj": 0.3,
    "k_proj": 0.3,
    "v_proj": 0.15,
    "o_proj": 0.15,
    "gate_proj": 0.15,
    "up_proj": 0.15,
    "down_proj": 0.1,
    "lm_head": 0.4,
    "norm": 0.1,  # RMSNorm weights are 1 + std * N(0, 1)
}


def init_llama_state_dict(cfg: LlamaLMConfig, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic fp32 weights for ``cfg`` (same bytes on every machine for one torch)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    # The skeleton lives on the meta device: it only provides the key order and shapes.
    skeleton = LlamaLM(cfg, device="meta")
    out: dict[str, torch.Tensor] = {}
    for name, p in skeleton.named_parameters():
        parts = name.split(".")
        kind = parts[-2]
        noise = torch.randn(tuple(p.shape), generator=gen, dtype=torch.float32)
        if kind in ("input_layernorm", "post_attention_layernorm", "norm"):
            out[name] = 1.0 + _INIT_STD["norm"] * noise
        else:
            out[name] = _INIT_STD[kind] * noise
    return out
