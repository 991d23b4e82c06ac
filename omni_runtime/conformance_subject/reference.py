"""An independent implementation of the runtime's model (C-08): Hugging Face's
``LlamaForCausalLM`` for greedy tokens, the runtime's own layers with unpaged attention for
hidden rows by full recompute; and the one read-only model per process the runners share.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_MODELS: dict[str, Any] = {}


def shared_model(path: str) -> Any:
    """One read-only model per process; runners never write to their model."""
    if path not in _MODELS:
        from omni_runtime.models import load_model

        _MODELS[path] = load_model(path, device="cpu", dtype=torch.float32)
    return _MODELS[path]


class OmniModelReference:
    """Hugging Face ``LlamaForCausalLM`` (eager attention, full recompute) for greedy tokens;
    the runtime's own layers with unpaged attention for hidden rows."""

    features = ("hidden-inline", "token-only-background")

    def __init__(self) -> None:
        self._hf: dict[str, Any] = {}

    def greedy(self, model_path: str, prompt: Sequence[int], n: int) -> list[int]:
        if model_path not in self._hf:
            from transformers import LlamaForCausalLM

            self._hf[model_path] = LlamaForCausalLM.from_pretrained(
                model_path, attn_implementation="eager", dtype=torch.float32
            ).eval()
        hf = self._hf[model_path]
        ids = list(prompt)
        with torch.no_grad():
            while len(ids) - len(prompt) < n:
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt) :]

    def hidden_rows(self, model_path: str, tokens: Sequence[int]) -> torch.Tensor:
        from omni_runtime.models import reference_attention

        model = shared_model(model_path)
        with torch.inference_mode():
            ids = torch.tensor(list(tokens), dtype=torch.long)
            return model.forward_layers(
                model.embed(ids),
                torch.arange(len(ids)),
                lambda _i, q, k, v: reference_attention(q, k, v),
            )
