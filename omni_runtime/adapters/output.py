"""The output adapter: runner tensors leave a stage only as typed, per-request payloads (C-11).

Scheduler side: ``payloads_by_request`` maps the payload list of an ``OmniModelRunnerOutput``,
aligned with the runner's ``req_ids`` (C-51), to request ids.

Runner side: ``PayloadBuilder.build(plan, inputs)`` turns one step's tensors into that list, one
slot per scheduled request in scheduler order, an empty slot where there is nothing to deliver
(C-51). It is a pure function of its arguments; the runner decides when it runs, inline or on a
builder thread (``omni_runtime.worker.materialize``), and keeps its inputs unchanged until it
returns (C-52, C-53). What a payload holds (hidden rows, multimodal outputs, the prefill
conditioning; C-30, C-31, C-55): docs/design.md, "Inside the layers"; docs/contracts.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from vllm.v1.outputs import ModelRunnerOutput

from omni_runtime.payload import StagePayload

_EMPTY: Mapping[str, StagePayload] = {}


def payloads_by_request(output: ModelRunnerOutput) -> Mapping[str, StagePayload]:
    payloads = getattr(output, "omni_payloads", None)
    if not payloads:
        return _EMPTY
    if len(payloads) != len(output.req_ids):
        raise ValueError(
            f"omni_payloads has {len(payloads)} slots for {len(output.req_ids)} requests (C-51)"
        )
    return {rid: p for rid, p in zip(output.req_ids, payloads, strict=True) if p is not None}


def synthetic_payloads(
    req_ids: Sequence[str], rows: Sequence[tuple[int, torch.Tensor] | None]
) -> list[StagePayload | None] | None:
    """Payload slots for ``req_ids`` from given hidden rows ``(start, rows)`` per request, for a
    stage fed by something other than this runner (the conformance gate's payload source).
    None when no request has rows, as the runner does on a step without payloads (C-50)."""
    if all(r is None for r in rows):
        return None
    return [
        None if r is None else StagePayload(rid, r[0], int(r[1].shape[0]), hidden=r[1])
        for rid, r in zip(req_ids, rows, strict=True)
    ]


# ---- runner side ----------------------------------------------------------------------------

# name -> f(hidden rows [n, H]) -> tensor [n, ...]: a multimodal output computed from hidden rows.
OutputProducer = Callable[[torch.Tensor], torch.Tensor]
# A model's postprocess of one built payload (may return a replacement, or None to drop it).
Postprocess = Callable[[StagePayload], StagePayload | None]


@dataclass(frozen=True, eq=False)
class PayloadPlan:
    """The scheduler metadata of one step that a payload build consumes (all length R or R+1).

    ``req_ids`` is the list upstream bookkeeping already built for ``ModelRunnerOutput``; it is
    reused, never copied (C-53). ``query_start[i]:query_start[i+1]`` are request i's rows in the
    step's hidden buffer; ``num_computed[i]`` is the position of its first row.
    ``conditioning_index[i]`` indexes ``PayloadInputs.conditioning_rows`` or is -1.
    """

    req_ids: Sequence[str]
    query_start: np.ndarray
    num_scheduled: np.ndarray
    num_computed: np.ndarray
    conditioning_index: np.ndarray

    def only(self, i: int) -> PayloadPlan:
        """The plan of request ``i`` alone (its rows keep their step row numbers)."""
        return PayloadPlan(
            [self.req_ids[i]],
            self.query_start[i : i + 2],
            self.num_scheduled[i : i + 1],
            self.num_computed[i : i + 1],
            self.conditioning_index[i : i + 1],
        )

    def snapshot(self) -> PayloadPlan:
        """A private copy of the arrays (the request ids list is immutable by contract)."""
        return PayloadPlan(
            self.req_ids,
            self.query_start.copy(),
            self.num_scheduled.copy(),
            self.num_computed.copy(),
            self.conditioning_index.copy(),
        )


@dataclass(eq=False)
class PayloadInputs:
    """The tensors of one step a payload build reads.

    ``hidden`` [T, H] is set only when hidden rows are delivered (include-hidden mode); the
    builder then also computes ``producers`` from it. In token-only mode the runner computes
    multimodal outputs itself and hands them per token in ``multimodal_rows`` ([T, ...] each).
    ``prefix_rows[i]`` are the cached-prefix rows of request i (prefix-cache merge, C-55).
    """

    hidden: torch.Tensor | None = None
    conditioning_rows: torch.Tensor | None = None
    prefix_rows: Mapping[int, torch.Tensor] = field(default_factory=dict)
    multimodal_rows: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def only(self, i: int) -> PayloadInputs:
        """The inputs as ``PayloadPlan.only(i)`` reads them: request ``i``'s prefix rows become
        request 0's; the row-indexed tensors are shared as they are."""
        prefix = self.prefix_rows.get(i)
        return PayloadInputs(
            hidden=self.hidden,
            conditioning_rows=self.conditioning_rows,
            prefix_rows={} if prefix is None else {0: prefix},
            multimodal_rows=self.multimodal_rows,
        )

    def snapshot(self) -> PayloadInputs:
        """Private copies of every tensor, so the runner may reuse its buffers at once."""
        return PayloadInputs(
            hidden=None if self.hidden is None else self.hidden.clone(),
            conditioning_rows=(
                None if self.conditioning_rows is None else self.conditioning_rows.clone()
            ),
            prefix_rows={i: t.clone() for i, t in self.prefix_rows.items()},
            multimodal_rows={k: t.clone() for k, t in self.multimodal_rows.items()},
        )


class PayloadBuilder:
    """Builds the per-request payload list of a step; see the module docstring for contents."""

    def __init__(
        self,
        *,
        include_hidden: bool,
        producers: Mapping[str, OutputProducer] | None = None,
        postprocess: Postprocess | None = None,
    ) -> None:
        self.include_hidden = include_hidden
        self.producers = dict(producers or {})
        self.postprocess = postprocess

    def build(self, plan: PayloadPlan, inputs: PayloadInputs) -> list[StagePayload | None]:
        num_reqs = len(plan.req_ids)
        if not (len(plan.num_scheduled) == len(plan.num_computed) == num_reqs):
            raise ValueError(
                f"payload plan of {num_reqs} requests has {len(plan.num_scheduled)} scheduled "
                f"counts and {len(plan.num_computed)} positions (C-51)"
            )
        if self.include_hidden and inputs.hidden is None:
            raise ValueError("include-hidden build without hidden rows")
        qs = plan.query_start.tolist()
        computed = plan.num_computed.tolist()
        cond_idx = plan.conditioning_index.tolist()
        out: list[StagePayload | None] = []
        for i, req_id in enumerate(plan.req_ids):
            lo, hi = qs[i], qs[i + 1]
            start = computed[i]
            hidden: torch.Tensor | None = None
            multimodal: dict[str, torch.Tensor] = {}
            if self.include_hidden:
                assert inputs.hidden is not None
                rows = inputs.hidden[lo:hi]
                for name, fn in self.producers.items():
                    multimodal[name] = fn(rows)
                prefix = inputs.prefix_rows.get(i)
                if prefix is not None and prefix.shape[0] > 0:
                    # Prefix-cache merge: cached prompt rows first, so rows cover [0, end).
                    hidden = torch.cat((prefix, rows), dim=0)
                    start -= prefix.shape[0]
                else:
                    hidden = rows.clone()
            for name, per_token in inputs.multimodal_rows.items():
                multimodal[name] = per_token[lo:hi].clone()
            conditioning = None
            if cond_idx[i] >= 0:
                assert inputs.conditioning_rows is not None
                conditioning = inputs.conditioning_rows[cond_idx[i]].clone()
            payload: StagePayload | None = None
            if hidden is not None or multimodal or conditioning is not None:
                payload = StagePayload(
                    request_id=req_id,
                    start=start,
                    num_tokens=(hi - lo) if hidden is None else int(hidden.shape[0]),
                    hidden=hidden,
                    multimodal=multimodal,
                    conditioning=conditioning,
                )
            elif self.postprocess is not None:
                payload = StagePayload(request_id=req_id, start=start, num_tokens=hi - lo)
            if payload is not None and self.postprocess is not None:
                payload = self.postprocess(payload)
            out.append(payload)
        return out
