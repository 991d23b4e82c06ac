"""Log-probabilities: what the token source returns beside its tokens, and how an output's
share reads in a snapshot.

A request asking for ``k`` logprobs (``SamplingParams.logprobs``) gets, per sampled token, a row of
``k + 1`` candidates (the sampled token first), their log-probabilities and the token's rank: a
pure function of (request id, position), so both schedulers get the same rows. As vLLM's runner
does, rows cover every request of a step once any asks: one per request without speculative
decoding (a partial prefill's is padding), one per sampled token with it, each request's start
in ``cu_num_generated_tokens``. Prompt logprobs (``SamplingParams.prompt_logprobs``) come
once, in the step that computes the last prompt token, a row per position after the first
(``prompt_logprobs_dict``). The scheduler must hand each output exactly its own request's rows.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

# Ranks and log-probabilities are drawn from small ranges: enough to tell rows apart.
_RANKS = 5
_SCALE = 1000


def _hash(request_id: str, position: int, column: int) -> int:
    return zlib.crc32(f"lp:{request_id}:{position}:{column}".encode())


def row(
    request_id: str, position: int, token: int, k: int, vocab: int
) -> tuple[list[int], list[float], int]:
    """The candidates, log-probabilities and rank of ``token`` sampled at ``position``."""
    ids = [token] + [3 + _hash(request_id, position, j) % (vocab - 3) for j in range(1, k + 1)]
    values = [-(_hash(request_id, position, -1 - j) % _SCALE) / 100.0 for j in range(k + 1)]
    return ids, values, 1 + _hash(request_id, position, 0) % _RANKS


def runner_logprobs(
    steps: Sequence[tuple[str, int, list[int]]], k: int, vocab: int, per_token: bool
) -> Any:
    """A ``LogprobsLists`` for one step: ``steps`` is each request the step ran, in order, with
    the position its first sampled token takes and the tokens it sampled (none for a partial
    prefill). ``per_token``: rows per sampled token, with their start offsets (speculative
    decoding); else one row per request."""
    from vllm.v1.outputs import LogprobsLists

    ids: list[list[int]] = []
    values: list[list[float]] = []
    ranks: list[int] = []
    starts: list[int] = []
    for rid, position, tokens in steps:
        starts.append(len(ids))
        # A request that sampled nothing still has its padding row without drafts.
        for i, token in enumerate(tokens if per_token else tokens[:1] or [0]):
            r_ids, r_values, rank = row(rid, position + i, token, k, vocab)
            ids.append(r_ids)
            values.append(r_values)
            ranks.append(rank)
    shape = (len(ids), k + 1)
    arrays = (
        np.array(ids, dtype=np.int32).reshape(shape),
        np.array(values, dtype=np.float32).reshape(shape),
        np.array(ranks, dtype=np.int32),
    )
    if per_token:
        return LogprobsLists(*arrays, cu_num_generated_tokens=[*starts, len(ids)])
    return LogprobsLists(*arrays)


def runner_prompt_logprobs(request_id: str, prompt: Sequence[int], k: int, vocab: int) -> Any:
    """The ``LogprobsTensors`` of a request's prompt: a row of ``k + 1`` candidates for each
    prompt token after the first (the token itself first), keyed by its position."""
    import torch
    from vllm.v1.outputs import LogprobsTensors

    rows = [row(request_id, -1 - p, prompt[p], k, vocab) for p in range(1, len(prompt))]
    return LogprobsTensors(
        torch.tensor([r[0] for r in rows], dtype=torch.int32).reshape(len(rows), k + 1),
        torch.tensor([r[1] for r in rows], dtype=torch.float32).reshape(len(rows), k + 1),
        torch.tensor([r[2] for r in rows], dtype=torch.int32),
    )


def output_prompt_logprobs(out: Any) -> tuple[Any, ...] | None:
    """An output's prompt logprobs as plain values, None when it has none."""
    tensors = getattr(out, "new_prompt_logprobs_tensors", None)
    if tensors is None:
        return None
    return (
        tensors.logprob_token_ids.tolist(),
        np.round(tensors.logprobs.double().numpy(), 4).tolist(),
        tensors.selected_token_ranks.tolist(),
    )


def output_logprobs(out: Any) -> tuple[Any, ...] | None:
    """An output's sampled-token logprobs as plain values (candidates, rounded
    log-probabilities and ranks per token), None when it has none."""
    lists = out.new_logprobs
    if lists is None:
        return None
    return (
        np.asarray(lists.logprob_token_ids).tolist(),
        np.round(np.asarray(lists.logprobs, dtype=np.float64), 4).tolist(),
        np.asarray(lists.sampled_token_ranks).tolist(),
    )
