"""Paged KV cache storage and the attention function the runner hands to the model.

``PagedKVCache`` owns one K and one V tensor per layer,
``[num_blocks, block_size, num_kv_heads, head_dim]`` (sized from vLLM's ``KVCacheConfig``), and
optionally the hidden-row cache for prefix-cache merges (C-55), indexed by the same slots and
valid exactly as long as their K/V. ``StepAttention`` is built per step from the scheduler's
block tables and called per layer by ``LlamaLM.forward_layers``: it writes the step's K/V into
their slots and reads each request's whole context back through its block table. Why the row
cache needs no bookkeeping of its own, and how decodes and prefills are gathered:
docs/design.md, "Inside the layers".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


class PagedKVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        hidden_size: int | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.key = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.value = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        # Flat [slots, kv_heads, head_dim] views share storage with the blocked tensors.
        self.key_slots = [k.view(self.num_slots, num_kv_heads, head_dim) for k in self.key]
        self.value_slots = [v.view(self.num_slots, num_kv_heads, head_dim) for v in self.value]
        self.hidden: torch.Tensor | None = (
            torch.zeros((self.num_slots, hidden_size), dtype=dtype)
            if hidden_size is not None
            else None
        )

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    def zero_blocks(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        idx = torch.tensor(block_ids, dtype=torch.long)
        for t in (*self.key, *self.value):
            t.index_fill_(0, idx, 0.0)
        if self.hidden is not None:
            self.hidden.view(self.num_blocks, self.block_size, -1).index_fill_(0, idx, 0.0)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:
            for t in (*self.key, *self.value):
                t[dst].copy_(t[src])
            if self.hidden is not None:
                h = self.hidden.view(self.num_blocks, self.block_size, -1)
                h[dst].copy_(h[src])

    def write_hidden(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        if self.hidden is not None:
            self.hidden.index_copy_(0, slots, rows)

    def read_hidden(self, slots: torch.Tensor) -> torch.Tensor:
        assert self.hidden is not None
        return self.hidden.index_select(0, slots)


def slots_for(block_ids: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Cache slots of ``positions`` for a request whose block table is ``block_ids``."""
    return block_ids[positions // block_size] * block_size + positions % block_size


@dataclass
class DecodeGroup:
    """Single-token requests, attended together over a padded gather."""

    token_index: torch.Tensor  # [R] row of each request's token in the step
    context_slots: torch.Tensor  # [R, Lmax] slots (padding points at slot 0)
    valid: torch.Tensor  # [R, Lmax] bool, key position < context length


@dataclass
class PrefillItem:
    """One multi-token request: its rows, the slots of its whole context and the causal mask."""

    start: int
    end: int
    context_slots: torch.Tensor  # [L]
    allowed: torch.Tensor  # [n, L] bool: query i (position c + i) may see key j iff j <= c + i


class StepAttention:
    """The ``attn_fn`` for one step: paged write, then paged read of each request's context."""

    def __init__(
        self,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor,
        decode: DecodeGroup | None,
        prefills: list[PrefillItem],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> None:
        self.cache = cache
        self.slot_mapping = slot_mapping
        self.decode = decode
        self.prefills = prefills
        self.num_kv_heads = num_kv_heads
        self.groups = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = 1.0 / math.sqrt(head_dim)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        k_cache = self.cache.key_slots[layer]
        v_cache = self.cache.value_slots[layer]
        k_cache.index_copy_(0, self.slot_mapping, k)
        v_cache.index_copy_(0, self.slot_mapping, v)
        out = torch.empty_like(q)
        nkv, g, d = self.num_kv_heads, self.groups, self.head_dim
        # GQA without repeating K/V: query head h reads kv head h // groups, so queries are
        # viewed as [.., kv_heads, groups, d] and each kv head is one batched matmul.
        if self.decode is not None:
            dec = self.decode
            r, length = dec.context_slots.shape
            qd = q.index_select(0, dec.token_index).view(r * nkv, g, d)
            keys = k_cache[dec.context_slots].permute(0, 2, 1, 3).reshape(r * nkv, length, d)
            values = v_cache[dec.context_slots].permute(0, 2, 1, 3).reshape(r * nkv, length, d)
            scores = torch.bmm(qd, keys.transpose(1, 2)).mul_(self.scale).view(r, nkv, g, length)
            scores.masked_fill_(~dec.valid[:, None, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            od = torch.bmm(probs.view(r * nkv, g, length), values).view(r, nkv * g, d)
            out.index_copy_(0, dec.token_index, od)
        for item in self.prefills:
            n = item.end - item.start
            length = item.context_slots.shape[0]
            qp = q[item.start : item.end].view(n, nkv, g, d).permute(1, 2, 0, 3)
            qp = qp.reshape(nkv, g * n, d)
            keys = k_cache[item.context_slots].permute(1, 0, 2)  # [nkv, L, d]
            values = v_cache[item.context_slots].permute(1, 0, 2)
            scores = torch.bmm(qp, keys.transpose(1, 2)).mul_(self.scale).view(nkv, g, n, length)
            scores.masked_fill_(~item.allowed, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            op = torch.bmm(probs.view(nkv, g * n, length), values).view(nkv, g, n, d)
            out[item.start : item.end] = op.permute(2, 0, 1, 3).reshape(n, nkv * g, d)
        return out
