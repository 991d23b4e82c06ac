"""The subject's independent model reference, memoised for the suite (C-08, C-31, C-51..C-55).

A ``ModelReference`` (declared by the subject) recomputes greedy tokens and hidden rows without
paging or caching; both are pure functions of the weights and the tokens, so one process keeps
each answer: greedy continuations grow by prefix, and the rows of a causal model's prefix do not
depend on later tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from conformance._core.capabilities import CheckNotRun, ModelReference


class CachedReference:
    def __init__(self, reference: ModelReference) -> None:
        self.reference = reference
        self._greedy: dict[tuple[str, tuple[int, ...]], list[int]] = {}
        self._rows: dict[tuple[str, tuple[int, ...]], Any] = {}

    def greedy(self, model_path: str, prompt: Sequence[int], n: int) -> list[int]:
        key = (model_path, tuple(prompt))
        have = self._greedy.get(key, [])
        if len(have) < n:
            try:
                have = self.reference.greedy(model_path, prompt, n)
            except ImportError as exc:
                raise CheckNotRun(f"the model reference needs {exc.name or exc}") from exc
            self._greedy[key] = have
        return have[:n]

    def hidden_rows(self, model_path: str, tokens: Sequence[int]) -> Any:
        key = (model_path, tuple(tokens))
        if key not in self._rows:
            try:
                self._rows[key] = self.reference.hidden_rows(model_path, tokens)
            except ImportError as exc:
                raise CheckNotRun(f"the model reference needs {exc.name or exc}") from exc
        return self._rows[key]


_CACHES: dict[int, CachedReference] = {}


def cached(reference: ModelReference) -> CachedReference:
    """One cache per reference object (a subject hands out a fresh one per call: key by type)."""
    key = id(type(reference))
    if key not in _CACHES:
        _CACHES[key] = CachedReference(reference)
    return _CACHES[key]
