"""Token sampling for the omni runner: greedy, and seeded temperature / top-k / top-p / min-p.

Batch independence is the design goal: a request's tokens must not depend on which other
requests share its step. Greedy rows are an argmax. Every random row uses the request's own
``torch.Generator``, re-seeded before each draw from (request seed, output index), so the draw
for output ``k`` is a pure function of the request's seed, ``k`` and its logits row — not of
the batch, of earlier draws that a preemption threw away, or of the step layout.

The request seed is ``SamplingParams.seed`` when given, else a stable digest of the runner's
base seed (``ModelConfig.seed``) and the request id.

Supported: ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``min_tokens`` (masks EOS and
stop ids), ``logit_bias``, ``presence_penalty`` / ``frequency_penalty`` /
``repetition_penalty``. Stop handling and ``max_tokens`` belong to the scheduler.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from vllm.sampling_params import SamplingParams

from omni_runtime.worker.vllm_compat import stop_token_ids

_EPS = 1e-5
_MASK = 2**63 - 1


def request_seed(params: SamplingParams | None, base_seed: int, request_id: str) -> int:
    if params is not None and params.seed is not None:
        return int(params.seed) & _MASK
    digest = hashlib.sha256(f"{base_seed}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & _MASK


def _draw_seed(seed: int, index: int) -> int:
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & _MASK


@dataclass
class SamplingState:
    """What the sampler needs of one request; owned by the runner's request state."""

    params: SamplingParams | None
    seed: int
    generator: torch.Generator = field(default_factory=lambda: torch.Generator(device="cpu"))
    stop_ids: frozenset[int] = frozenset()

    @classmethod
    def create(cls, params: SamplingParams | None, seed: int) -> SamplingState:
        stops = frozenset(stop_token_ids(params)) if params is not None else frozenset()
        return cls(params=params, seed=seed, stop_ids=stops)

    @property
    def greedy(self) -> bool:
        return self.params is None or self.params.temperature < _EPS

    @property
    def needs_logit_processing(self) -> bool:
        p = self.params
        if p is None:
            return False
        return bool(
            p.min_tokens
            or p.logit_bias
            or p.presence_penalty
            or p.frequency_penalty
            or abs(p.repetition_penalty - 1.0) > _EPS
        )


class Sampler:
    """Samples one token per row of ``logits`` for the requests given in row order."""

    def sample(
        self,
        logits: torch.Tensor,
        states: Sequence[SamplingState],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
    ) -> list[int]:
        if logits.shape[0] != len(states):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(states)} requests")
        if not states:
            return []
        logits = logits.float()
        if any(s.needs_logit_processing for s in states):
            logits = logits.clone()
            for i, s in enumerate(states):
                if s.needs_logit_processing:
                    self._process(logits[i], s, prompt_ids[i], output_ids[i])
        # One argmax for the whole batch; random rows are overwritten below.
        out = logits.argmax(dim=-1).tolist()
        for i, s in enumerate(states):
            if not s.greedy:
                out[i] = self._sample_row(logits[i], s, len(output_ids[i]))
        return [int(t) for t in out]

    @staticmethod
    def _process(
        row: torch.Tensor, s: SamplingState, prompt: Sequence[int], outputs: Sequence[int]
    ) -> None:
        p = s.params
        assert p is not None
        vocab = row.shape[0]
        if p.presence_penalty or p.frequency_penalty or abs(p.repetition_penalty - 1.0) > _EPS:
            out_t = torch.tensor([t for t in outputs if 0 <= t < vocab], dtype=torch.long)
            counts = torch.bincount(out_t, minlength=vocab).to(row.dtype)
            if abs(p.repetition_penalty - 1.0) > _EPS:
                seen = counts > 0
                prm = torch.tensor([t for t in prompt if 0 <= t < vocab], dtype=torch.long)
                if prm.numel():
                    seen[prm] = True
                pen = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                row.copy_(torch.where(seen, pen, row))
            row.sub_(p.frequency_penalty * counts)
            row.sub_(p.presence_penalty * (counts > 0).to(row.dtype))
        if p.logit_bias:
            for tok, bias in p.logit_bias.items():
                if 0 <= int(tok) < vocab:
                    row[int(tok)] += float(bias)
        if p.min_tokens and len(outputs) < p.min_tokens and s.stop_ids:
            ids = [t for t in s.stop_ids if 0 <= t < vocab]
            if ids:
                row[torch.tensor(ids, dtype=torch.long)] = float("-inf")

    @staticmethod
    def _sample_row(row: torch.Tensor, s: SamplingState, output_index: int) -> int:
        p = s.params
        assert p is not None
        row = row / p.temperature
        vocab = row.shape[0]
        if 0 < p.top_k < vocab:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0 - _EPS:
            sorted_p, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, dim=-1)
            # Drop a token when the mass before it already reaches top_p; the top one stays.
            drop_sorted = (cum - sorted_p) >= p.top_p
            drop_sorted[0] = False
            drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        if p.min_p > _EPS:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        s.generator.manual_seed(_draw_seed(s.seed, output_index))
        return int(torch.multinomial(probs, 1, generator=s.generator).item())
