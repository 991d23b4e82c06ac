"""The input adapter: stage inputs become an upstream ``Request`` plus one declared omni slot.

Everything a stage receives from upstream stages or the client (prompt ids or prompt embeds,
additional information, the request's final stage) is validated here and nowhere else (C-13): a
malformed input raises ``RequestRejected`` naming the request and the field before anything
reaches a scheduler, so a rejected request can never leak blocks or disturb its neighbours.

The omni data rides on the request in exactly one attribute, ``omni`` (an ``OmniRequestState``),
declared in ``DECLARED_REQUEST_ATTRIBUTES`` (C-10, C-12); upstream fields keep upstream meaning
(prompt embeds use vLLM's own ``prompt_embeds`` field).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from omni_runtime.config import OmniStageConfig

# The attributes the omni runtime adds to upstream ``Request`` objects (C-12). Invariant checks
# compare a live request's attribute set against upstream's plus exactly these.
DECLARED_REQUEST_ATTRIBUTES: tuple[str, ...] = ("omni",)

_SCALARS = (bool, int, float, str, type(None))
# The integers a stage in its own process can receive: the slot crosses in vLLM's msgpack codec
# (``slot_to_extra_args``), which carries -2**63 .. 2**64-1 only. A larger one used to pass here
# and raise OverflowError in the multiprocess backend's ``add``, after validation, naming no field
# (found by the gate's C-46 property); every backend refuses it here instead, alike.
_WIRE_INTS = range(-(2**63), 2**64)


class RequestRejected(ValueError):
    """A stage input the adapter refused; the message names the request and the field."""

    def __init__(self, request_id: str, field_name: str, problem: str) -> None:
        self.request_id = request_id
        self.field = field_name
        self.problem = problem
        super().__init__(f"{request_id}: {field_name}: {problem}")


@dataclass(frozen=True, eq=False)
class OmniRequestState:
    """The declared omni slot of a request: immutable stage metadata, read by the scheduler.

    ``downstream`` is empty when this stage is the request's final stage, which is what makes
    a request "final here" for the transfer decision (C-42).
    """

    stage_id: str
    final_stage_id: str
    downstream: tuple[str, ...]
    additional_information: Mapping[str, Any] = field(default_factory=dict)
    conditioning: torch.Tensor | None = None

    @property
    def has_downstream(self) -> bool:
        return bool(self.downstream)


class OmniRequest(Request):
    """An upstream ``Request`` that carries the omni slot; every upstream field keeps its meaning."""

    omni: OmniRequestState

    def __init__(self, *args: Any, omni: OmniRequestState, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.omni = omni


def omni_state_of(request: Request) -> OmniRequestState | None:
    """The omni slot of any request; plain upstream requests have none."""
    return getattr(request, "omni", None)


@dataclass
class StageInput:
    """What a stage receives for one request, before validation."""

    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: Sequence[int] | None = None
    prompt_embeds: torch.Tensor | None = None
    additional_information: Mapping[str, Any] | None = None
    conditioning: torch.Tensor | None = None
    final_stage_id: str | None = None
    arrival_time: float | None = None
    cache_salt: str | None = None
    priority: int = 0
    client_index: int = 0
    # Tracing context from the client (e.g. W3C ``traceparent``): vLLM carries it on the request
    # and returns it on the request's outputs.
    trace_headers: Mapping[str, str] | None = None
    # A streaming input session (vLLM's ``Request.resumable``): the first input starts it, a
    # later one under the same id is its next input, and a final one that is not resumable
    # ends its stream. vLLM's scheduler folds those into the live request.
    resumable: bool = False
    # The prompt's multimodal items (vLLM's ``MultiModalFeatureSpec``), in prompt order: each
    # names its placeholder tokens in the prompt and the identifier its encoder output is cached
    # under. They key the encoder cache and the prefix cache's block hashes, so a stage must pass
    # them on as its client sent them.
    mm_features: Sequence[Any] | None = None
    # The LoRA adapter the request runs with (vLLM's ``LoRARequest``): its name keys the prefix
    # cache's block hashes, and the scheduler counts adapters against ``max_loras``.
    lora_request: Any = None


class InputAdapter:
    """Validates stage inputs and builds requests for one stage.

    ``live_ids`` answers whether a request id is already in use (a scheduler's ``requests``
    mapping, or the stage engine's set); duplicates are rejected rather than silently merged.
    The one exception is input for a live streaming session (``StageInput.resumable``), which
    ``live_ids`` must then map to its request to show.
    """

    def __init__(
        self,
        stage: OmniStageConfig,
        *,
        max_model_len: int,
        vocab_size: int | None = None,
        hidden_size: int | None = None,
        embeds_dtype: torch.dtype = torch.float32,
        block_hasher: Callable[[Request], list[Any]] | None = None,
        live_ids: Container[str] = (),
    ) -> None:
        self.stage = stage
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size if hidden_size is not None else stage.prompt_embeds_dim
        self.embeds_dtype = embeds_dtype
        self.block_hasher = block_hasher
        self.live_ids = live_ids

    def build(self, item: StageInput) -> OmniRequest:
        rid = item.request_id
        if not isinstance(rid, str) or not rid:
            raise RequestRejected(repr(rid), "request_id", "must be a non-empty string")
        if rid in self.live_ids and not self._session_input(rid):
            raise RequestRejected(rid, "request_id", "duplicate: a request with this id is live")
        if not isinstance(item.sampling_params, SamplingParams):
            raise RequestRejected(rid, "sampling_params", "must be vllm.SamplingParams")
        if item.sampling_params.max_tokens is None or item.sampling_params.max_tokens < 1:
            raise RequestRejected(rid, "sampling_params.max_tokens", "must be >= 1")

        prompt_ids, embeds, n = self._prompt(rid, item)
        # Upstream's input processor refuses a prompt that fills the whole context as well: a
        # generating stage must have room for at least one output token.
        if n >= self.max_model_len:
            raise RequestRejected(
                rid,
                "prompt",
                f"{n} tokens exceed max_model_len {self.max_model_len} less the one output "
                "token a generating stage needs room for",
            )
        final = self._final_stage(rid, item.final_stage_id)
        mm_features = self._mm_features(rid, item.mm_features, n)
        # One slot object per request, built once: a discarded first draft would leave a hole
        # between the request's own allocations, and the scheduler's per-request passes run
        # measurably slower over requests spread out in memory (benchmarks/test_bench_scheduler).
        state = OmniRequestState(
            stage_id=self.stage.stage_id,
            final_stage_id=final,
            downstream=self.stage.downstream if final != self.stage.stage_id else (),
            additional_information=self._additional(rid, item.additional_information),
            conditioning=None
            if item.conditioning is None
            else self._tensor(rid, "conditioning", item.conditioning),
        )
        return OmniRequest(
            request_id=rid,
            prompt_token_ids=prompt_ids,
            prompt_embeds=embeds,
            sampling_params=item.sampling_params,
            pooling_params=None,
            client_index=item.client_index,
            arrival_time=item.arrival_time if item.arrival_time is not None else time.time(),
            cache_salt=item.cache_salt,
            priority=item.priority,
            trace_headers=self._trace_headers(rid, item.trace_headers),
            block_hasher=self.block_hasher,
            resumable=item.resumable,
            mm_features=mm_features,
            lora_request=item.lora_request,
            omni=state,
        )

    @staticmethod
    def _mm_features(rid: str, features: Sequence[Any] | None, n: int) -> list[Any] | None:
        """The multimodal items, checked as vLLM's scheduler relies on them: placeholders inside
        the prompt, in prompt order, not overlapping, each with an identifier."""
        if not features:
            return None
        end = 0
        for i, f in enumerate(features):
            where = f"mm_features[{i}]"
            pos = getattr(f, "mm_position", None)
            if pos is None or not getattr(f, "identifier", None):
                raise RequestRejected(rid, where, "needs an identifier and an mm_position")
            if pos.offset < end or pos.length < 1 or pos.offset + pos.length > n:
                raise RequestRejected(
                    rid,
                    f"{where}.mm_position",
                    f"placeholder [{pos.offset}, {pos.offset + pos.length}) must lie in the "
                    f"{n}-token prompt after the previous item's (which ends at {end})",
                )
            end = pos.offset + pos.length
        return list(features)

    def _session_input(self, rid: str) -> bool:
        """Whether the live request ``rid`` is a streaming session, which takes further input
        (and the end of its stream) under its id."""
        live = self.live_ids.get(rid) if isinstance(self.live_ids, Mapping) else None
        # vLLM gives a resumable request its queue of pending inputs when it admits it.
        return getattr(live, "streaming_queue", None) is not None

    def _prompt(
        self, rid: str, item: StageInput
    ) -> tuple[list[int] | None, torch.Tensor | None, int]:
        ids, embeds = item.prompt_token_ids, item.prompt_embeds
        if (ids is None) == (embeds is None):
            raise RequestRejected(
                rid, "prompt", "give exactly one of prompt_token_ids and prompt_embeds"
            )
        if ids is not None:
            if isinstance(ids, torch.Tensor):
                if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 1:
                    raise RequestRejected(
                        rid,
                        "prompt_token_ids",
                        f"tensor must be 1-D int32/int64, got {tuple(ids.shape)} {ids.dtype}",
                    )
                ids = ids.tolist()
            out = list(ids)
            if not out:
                raise RequestRejected(rid, "prompt_token_ids", "empty prompt")
            for i, t in enumerate(out):
                if isinstance(t, bool) or not isinstance(t, int):
                    raise RequestRejected(
                        rid, f"prompt_token_ids[{i}]", f"expected int, got {type(t).__name__}"
                    )
                if t < 0 or (self.vocab_size is not None and t >= self.vocab_size):
                    raise RequestRejected(
                        rid,
                        f"prompt_token_ids[{i}]",
                        f"{t} outside vocabulary [0, {self.vocab_size})",
                    )
            return out, None, len(out)
        assert embeds is not None
        if not isinstance(embeds, torch.Tensor):
            raise RequestRejected(
                rid, "prompt_embeds", f"expected a tensor, got {type(embeds).__name__}"
            )
        if embeds.dim() != 2:
            raise RequestRejected(
                rid, "prompt_embeds", f"expected shape [tokens, hidden], got {tuple(embeds.shape)}"
            )
        if embeds.shape[0] == 0:
            raise RequestRejected(rid, "prompt_embeds", "empty prompt")
        if self.hidden_size is not None and embeds.shape[1] != self.hidden_size:
            raise RequestRejected(
                rid,
                "prompt_embeds",
                f"hidden size {embeds.shape[1]} does not match the model's {self.hidden_size}",
            )
        if embeds.dtype != self.embeds_dtype:
            raise RequestRejected(
                rid, "prompt_embeds", f"dtype {embeds.dtype}, expected {self.embeds_dtype}"
            )
        if embeds.is_meta:
            raise RequestRejected(rid, "prompt_embeds", "tensor has no data (meta device)")
        if not bool(torch.isfinite(embeds).all()):
            raise RequestRejected(rid, "prompt_embeds", "contains NaN or infinite values")
        # A private, contiguous CPU copy: the caller may reuse its buffer after we return.
        return None, embeds.detach().to("cpu").contiguous().clone(), int(embeds.shape[0])

    def _final_stage(self, rid: str, final: str | None) -> str:
        stages = self.stage.stages
        if final is None:
            return stages[-1]
        if final not in stages:
            raise RequestRejected(
                rid, "final_stage_id", f"unknown stage {final!r}; known {list(stages)}"
            )
        if stages.index(final) < stages.index(self.stage.stage_id):
            raise RequestRejected(
                rid, "final_stage_id", f"{final!r} comes before this stage {self.stage.stage_id!r}"
            )
        return final

    def _tensor(self, rid: str, name: str, value: Any) -> torch.Tensor:
        if not isinstance(value, torch.Tensor):
            raise RequestRejected(rid, name, f"expected a tensor, got {type(value).__name__}")
        if value.is_meta:
            raise RequestRejected(rid, name, "tensor has no data (meta device)")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise RequestRejected(rid, name, "contains NaN or infinite values")
        return value.detach().to("cpu").clone()

    def _trace_headers(self, rid: str, headers: Mapping[str, str] | None) -> dict[str, str] | None:
        if headers is None:
            return None
        if not isinstance(headers, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
        ):
            raise RequestRejected(rid, "trace_headers", "expected a mapping of str to str")
        return dict(headers)

    def _additional(self, rid: str, info: Mapping[str, Any] | None) -> Mapping[str, Any]:
        if info is None:
            return _NO_INFORMATION
        if not isinstance(info, Mapping):
            raise RequestRejected(rid, "additional_information", "expected a mapping")
        out: dict[str, Any] = {}
        for key, value in info.items():
            name = f"additional_information[{key!r}]"
            if not isinstance(key, str):
                raise RequestRejected(rid, name, "keys must be strings")
            if isinstance(value, torch.Tensor):
                out[key] = self._tensor(rid, name, value)
            elif isinstance(value, float) and not math.isfinite(value):
                raise RequestRejected(rid, name, "NaN or infinite value")
            elif any(
                isinstance(v, int) and v not in _WIRE_INTS
                for v in (value if isinstance(value, list | tuple) else (value,))
            ):
                raise RequestRejected(rid, name, "integer outside the 64-bit range")
            elif isinstance(value, _SCALARS):
                out[key] = value
            elif isinstance(value, list | tuple) and all(isinstance(v, _SCALARS) for v in value):
                out[key] = tuple(value)
            else:
                raise RequestRejected(
                    rid, name, f"unsupported type {type(value).__name__} (tensor, scalar or list)"
                )
        return MappingProxyType(out)


# The additional information of every request that has none: read-only, so one object serves
# all of them (a fresh empty mapping per request is two more allocations among its own).
_NO_INFORMATION: Mapping[str, Any] = MappingProxyType({})


# ---- the slot across a process boundary ------------------------------------------------------
# A stage that runs in its own process receives vLLM's ``EngineCoreRequest``, which has no room
# for the slot. The parent validates with ``InputAdapter.build`` as usual and puts the slot's
# fields in ``SamplingParams.extra_args`` (vLLM's public dict for plugins) under
# ``EXTRA_ARGS_KEY``; inside the stage process the scheduler's ``add_request`` hands the request
# to ``attach_slot_from_extra_args``, which takes the entry out again (the request then looks
# exactly as it would in process) and sets the one declared slot (C-10, C-12).

EXTRA_ARGS_KEY = "omni_slot"


def _tensor_to_wire(t: torch.Tensor) -> dict[str, Any]:
    t = t.detach().to("cpu").contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": raw}


def _tensor_from_wire(wire: Mapping[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, str(wire["dtype"]))
    if not wire["data"]:
        return torch.empty(list(wire["shape"]), dtype=dtype)
    raw = bytearray(wire["data"])
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(list(wire["shape"]))


def slot_to_extra_args(state: OmniRequestState) -> dict[str, Any]:
    """The slot of a validated request as plain msgpack-able data (tensors as raw bytes)."""
    info: dict[str, Any] = {}
    for key, value in state.additional_information.items():
        if isinstance(value, torch.Tensor):
            info[key] = {"tensor": _tensor_to_wire(value)}
        elif isinstance(value, tuple):
            info[key] = {"tuple": list(value)}
        else:
            info[key] = {"value": value}
    return {
        "stage_id": state.stage_id,
        "final_stage_id": state.final_stage_id,
        "downstream": list(state.downstream),
        "additional_information": info,
        "conditioning": None if state.conditioning is None else _tensor_to_wire(state.conditioning),
    }


def attach_slot_from_extra_args(request: Request) -> OmniRequestState | None:
    """Move the slot that ``slot_to_extra_args`` put in the request's ``extra_args`` onto the
    request's declared attribute; a request without one is left as it is (upstream's)."""
    params = request.sampling_params
    extra = params.extra_args if params is not None else None
    if not extra or EXTRA_ARGS_KEY not in extra:
        return None
    assert params is not None
    wire = extra.pop(EXTRA_ARGS_KEY)
    if not extra:
        params.extra_args = None
    info: dict[str, Any] = {}
    for key, entry in dict(wire.get("additional_information") or {}).items():
        if "tensor" in entry:
            info[key] = _tensor_from_wire(entry["tensor"])
        elif "tuple" in entry:
            info[key] = tuple(entry["tuple"])
        else:
            info[key] = entry["value"]
    cond = wire.get("conditioning")
    state = OmniRequestState(
        stage_id=str(wire["stage_id"]),
        final_stage_id=str(wire["final_stage_id"]),
        downstream=tuple(wire["downstream"]),
        additional_information=MappingProxyType(info),
        conditioning=None if cond is None else _tensor_from_wire(cond),
    )
    request.omni = state  # type: ignore[attr-defined]
    return state
