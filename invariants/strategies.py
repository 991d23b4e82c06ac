"""Shared vocabulary of the invariant suite: generated chunk processors, payload-carrying
executors, malformed stage inputs and runner-level batches.

Everything here is data or a pure function of its arguments, so verdicts do not depend on
``PYTHONHASHSEED``, and nothing here knows a runtime: configurations, payload objects and input
shapes come from the subject.

* ``RecordingProcessor`` — a generated chunk processor (declaration, signature, return policy,
  whether it mutates its ids) that logs every call; ``processor_specs_of`` draws them by
  ``PROCESSOR_SHAPES``;
* ``PayloadTokenSource`` — the harness's token source plus one synthetic hidden row per
  scheduled position encoding (request, position) (C-45, C-51);
* ``malformed_inputs`` — stage inputs with exactly one defect, and the field to name (C-13).

See docs/design.md, "How the suite checks".
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

from conformance._core import vllm_compat as vc
from conformance._core.capabilities import ChunkDelivery, StageInputSpec
from conformance._core.harness_faults import harness_code
from conformance._core.machine import PREFIXES
from conformance._core.tokens import DeterministicTokenSource


def stable_hash(*parts: Any) -> int:
    """A process-independent hash (``hash(str)`` changes with PYTHONHASHSEED)."""
    return zlib.crc32(":".join(map(str, parts)).encode())


# ---- generated chunk processors -----------------------------------------------------------

# Values of ``requires_token_updates``: only the first is a declaration (C-40); the others are
# truthy or falsy non-True values that must leave the processor payload/EOF-triggered (C-41).
TOKEN_UPDATE_DECLARATIONS: tuple[Any, ...] = (True, "absent", False, 1, "yes", [1], 1.0)
RETURN_POLICIES = ("payload", "none_at_eof", "none_always", "tokens", "nested")


@dataclass
class ProcessorCall:
    request_id: str
    payload: Any
    is_final: bool
    ids: tuple[int, ...] | None  # a copy taken at call time
    ids_ref: list[int] | None  # the list object itself, to detect later mutation (C-44)
    batched: bool = False  # made through ``on_token_batch``, not a call of the processor
    returned: Any = None  # what the processor returned (None: nothing to send)


class RecordingProcessor:
    """A generated chunk processor that logs every call (see the module docstring)."""

    def __init__(self, declaration: Any, policy: str, mutate_ids: bool) -> None:
        if declaration != "absent":
            self.requires_token_updates = declaration
        self.declaration = declaration
        self.policy = policy
        self.mutate_ids = mutate_ids
        self.calls: list[ProcessorCall] = []
        self.released: list[str] = []

    @harness_code
    def release(self, request_id: str) -> None:
        """Logged: a subject may ask a processor to let go of a request (C-61)."""
        self.released.append(request_id)

    @harness_code
    def record(
        self,
        request_id: str,
        payload: Any,
        is_final: bool,
        ids: list[int] | None,
        batched: bool = False,
    ) -> Any:
        call = ProcessorCall(
            request_id, payload, is_final, None if ids is None else tuple(ids), ids, batched
        )
        self.calls.append(call)
        if ids is not None and self.mutate_ids:
            # A processor may keep or mutate what it was given; nobody else may see that (C-44).
            ids.append(-1)
        call.returned = self._answer(request_id, payload, is_final, ids)
        return call.returned

    def _answer(self, request_id: str, payload: Any, is_final: bool, ids: list[int] | None) -> Any:
        if self.policy == "none_always" or (self.policy == "none_at_eof" and is_final):
            return None
        if self.policy == "tokens":
            return tuple(ids or ())
        if self.policy == "nested":
            # Data of every shape a processor may hand over, each container holding the rest
            # (the step's payload inside each kind of container too): what a stage process must
            # carry across unchanged (C-46). A list at the top, not a dict: a dict is read as
            # rows for the next stage.
            # A one-byte tensor first: the wire pads every tensor to its alignment, and a
            # one-byte one is where padding that rounds down loses a whole slot.
            ids_tensor = torch.tensor(list(ids or ()), dtype=torch.long)
            return [
                request_id,
                (is_final, torch.tensor([is_final]), ids_tensor, payload),
                {"payload": payload, "ids": list(ids or ())},
                [payload],
            ]
        return payload if payload is not None else ("eof" if is_final else "ids")

    def calls_for(self, request_id: str) -> list[ProcessorCall]:
        return [c for c in self.calls if c.request_id == request_id]


class RecordingIdsProcessor(RecordingProcessor):
    """The same, with a signature that accepts ``new_token_ids`` (so it receives the ids)."""

    def __call__(
        self, request_id: str, payload: Any, is_final: bool, new_token_ids: list[int] | None = None
    ) -> Any:
        return self.record(request_id, payload, is_final, new_token_ids)


class RecordingBatchProcessor(RecordingIdsProcessor):
    """The ids-taking processor with ``on_token_batch`` (C-40's batching form): a batch is its
    per-request calls at once, each logged as the call it stands for."""

    def on_token_batch(
        self, request_ids: Sequence[str], token_ids: list[int], counts: list[int] | None
    ) -> dict[str, Any]:
        counts = [1] * len(request_ids) if counts is None else counts
        data: dict[str, Any] = {}
        start = 0
        for rid, n in zip(request_ids, counts, strict=True):
            out = self.record(rid, None, False, token_ids[start : start + n], batched=True)
            start += n
            if out is not None:
                data[rid] = out
        return data


class RecordingPlainProcessor(RecordingProcessor):
    def __call__(self, request_id: str, payload: Any, is_final: bool) -> Any:
        return self.record(request_id, payload, is_final, None)


class RecordingOverridingProcessor(RecordingBatchProcessor):
    """A subclass of the batching processor that redefines ``__call__`` (here to do the same):
    its batch method is inherited from a class whose ``__call__`` it no longer runs, so it
    stands for nothing this class does; every call must reach this ``__call__``."""

    def __call__(
        self, request_id: str, payload: Any, is_final: bool, new_token_ids: list[int] | None = None
    ) -> Any:
        return self.record(request_id, payload, is_final, new_token_ids)


class RecordingBatchOffProcessor(RecordingIdsProcessor):
    """An ids-taking processor whose class sets ``on_token_batch`` to False: no batch method."""

    on_token_batch = False


class ForwardingProcessor:
    """A wrapper that calls an inner batching processor and forwards every other attribute
    read to it (its declaration, its log, its ``release``, and its ``on_token_batch``): a batch
    through the forwarded method would pass the wrapper's own ``__call__`` by, so every call
    must come through the wrapper."""

    def __init__(self, inner: RecordingBatchProcessor) -> None:
        self.inner = inner

    def __call__(
        self, request_id: str, payload: Any, is_final: bool, new_token_ids: list[int] | None = None
    ) -> Any:
        return self.inner(request_id, payload, is_final, new_token_ids)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["inner"], name)


@dataclass(frozen=True)
class ProcessorSpec:
    declaration: Any
    policy: str
    takes_ids: bool
    mutate_ids: bool
    batches: bool = False  # with ``takes_ids``: defines ``on_token_batch`` too
    # With ``batches``, how the batch method relates to the ``__call__`` that runs
    # (``BATCH_FORMS``): only the first may be batched.
    form: str = "own"

    def build(self) -> Any:
        cls: type[RecordingProcessor] = RecordingPlainProcessor
        if self.takes_ids:
            cls = RecordingBatchProcessor if self.batches else RecordingIdsProcessor
            if self.batches and self.form == "overriding":
                cls = RecordingOverridingProcessor
            elif self.batches and self.form == "off":
                cls = RecordingBatchOffProcessor
        made = cls(self.declaration, self.policy, self.mutate_ids and self.takes_ids)
        if self.takes_ids and self.batches and self.form == "forwarding":
            assert isinstance(made, RecordingBatchProcessor)
            return ForwardingProcessor(made)
        return made

    @property
    def may_batch(self) -> bool:
        """Whether a subject may call ``on_token_batch`` instead of this processor (C-40)."""
        return self.takes_ids and self.batches and self.form == "own"

    def describe(self) -> str:
        batch = (
            f", on_token_batch={'yes' if self.form == 'own' else self.form}"
            if self.takes_ids and self.batches
            else ""
        )
        return (
            f"processor(requires_token_updates={self.declaration!r}, returns={self.policy}, "
            f"new_token_ids={'yes' if self.takes_ids else 'no'}, mutates={self.mutate_ids}"
            f"{batch})"
        )


# The paths a processor's declaration and signature send a subject down (``processor_specs_of``): called on payloads
# and EOFs only; on every step's new ids without being handed them; with them, one call per
# request; with them, in batches (C-40, C-41).
PROCESSOR_SHAPES: tuple[str, ...] = (
    "payload-driven",
    "token-updates",
    "token-updates-with-ids",
    "token-updates-batched",
    "token-updates-batch-foreign",
)
# How a batching processor's ``on_token_batch`` relates to the ``__call__`` it would run: its own
# class defines both (the batched shape); a subclass redefines ``__call__``; a wrapper forwards
# attribute reads to a batching processor; the class sets the method to False (the
# batch-foreign shape). C-40: only the first may be batched.
BATCH_FORMS: tuple[str, ...] = ("own", "overriding", "forwarding", "off")


def processor_specs_of(
    shapes: Sequence[str] = PROCESSOR_SHAPES,
) -> st.SearchStrategy[ProcessorSpec]:
    """Generated processors whose ``shape`` is one of ``shapes``, each shape as likely."""

    def of_shape(shape: str) -> st.SearchStrategy[ProcessorSpec]:
        if shape == "payload-driven":
            declaration: st.SearchStrategy[Any] = st.sampled_from(
                [d for d in TOKEN_UPDATE_DECLARATIONS if d is not True]
            )
            takes_ids: st.SearchStrategy[bool] = st.booleans()
        else:
            declaration = st.just(True)
            takes_ids = st.just(shape != "token-updates")
        return st.builds(
            ProcessorSpec,
            declaration=declaration,
            policy=st.sampled_from(RETURN_POLICIES),
            takes_ids=takes_ids,
            mutate_ids=st.booleans(),
            batches=st.just(shape.startswith("token-updates-batch"))
            if shape != "payload-driven"
            else st.booleans(),
            form=st.sampled_from(BATCH_FORMS[1:])
            if shape == "token-updates-batch-foreign"
            else st.just("own"),
        )

    return st.one_of([of_shape(shape) for shape in shapes])


processor_specs = processor_specs_of()


def delivery_shapes(subject: Any) -> tuple[str, ...]:
    """The processor shapes the subject's delivery takes (``processor_shapes``, optional: every
    shape); shapes it does not take are not drawn, since its runtime has no such processor."""
    delivery = subject.chunk_delivery()
    shapes = tuple(getattr(delivery, "processor_shapes", PROCESSOR_SHAPES))
    unknown = sorted(set(shapes) - set(PROCESSOR_SHAPES))
    if unknown or not shapes:
        raise ValueError(f"chunk delivery declares unknown processor shapes {unknown or shapes}")
    return shapes


# ---- an executor whose outputs carry synthetic payloads ------------------------------------

PAYLOAD_PATTERNS = ("always", "never", "prefill", "every_other")


def synthetic_row(request_id: str, position: int, width: int = 2) -> torch.Tensor:
    """The hidden row of (request, position): recognisable after any trimming or shift."""
    return torch.tensor([float(stable_hash(request_id) % 100003), float(position)][:width])


class PayloadTokenSource(DeterministicTokenSource):
    """Deterministic tokens plus payload slots aligned with ``req_ids`` (C-51), in the subject's
    payload type (``ChunkDelivery.with_payloads``).

    Which steps of a request carry a payload depends on the request's pattern (chosen by a
    stable hash of its id), so one batch mixes requests with and without payloads.
    """

    def __init__(
        self,
        delivery: ChunkDelivery,
        vocab: int = 512,
        patterns: tuple[str, ...] = PAYLOAD_PATTERNS,
    ) -> None:
        super().__init__(vocab=vocab)
        self.delivery = delivery
        self.patterns = patterns
        self._prompt_len: dict[str, int] = {}
        # Every position a row was attached for, per request (less those of steps a resumed
        # request did not keep, ``execute``).
        self.produced: dict[str, set[int]] = {}
        # The positions C-45's trimming owes downstream: every position with a row, except one
        # whose row first came in the recompute of a resumed request and lies below a row
        # handed over before the preemption, from a step whose tokens the request kept. Its own
        # step carried no row (a pattern skipped it, ``every_other``); sending it now would
        # break C-45's order, so a runtime that trims by what it delivered rightly drops it.
        # Rows of steps upstream dropped as stale excuse nothing: their tokens were not kept
        # (the resumed request's tokens end before them), a runtime must not send them, and
        # they are owed no more once the request resumes (``execute``).
        self.owed: dict[str, set[int]] = {}
        # Per request resumed after a preemption: the last row handed over before it, from a
        # step whose tokens it kept (what ``owed`` excuses below).
        self._resume_top: dict[str, int] = {}
        # Per request, the (start, count) of every step that carried rows since it last resumed.
        self._carried: dict[str, list[tuple[int, int]]] = {}
        # The positions whose rows the processor has been handed so far, per request; set on the
        # subject's source only (``attach_processor``), and ``owed`` is kept only where it is.
        self.handed: Callable[[str], Iterable[int]] | None = None

    def pattern_of(self, request_id: str) -> str:
        return self.patterns[stable_hash("pattern", request_id) % len(self.patterns)]

    @harness_code
    def execute(self, so: Any) -> Any:
        for new in so.scheduled_new_reqs:
            self._prompt_len[new.req_id] = vc.prompt_length(new)
        computed = vc.computed_before(so)
        # Per resumed request, the positions it computed, with its tokens kept, before its
        # preemption: all but its last token's.
        resumed = (
            {
                rid: len(tokens) - 1
                for rid in vc.resumed_ids(so)
                if (tokens := vc.resumed_all_token_ids(so, rid)) is not None
            }
            if self.handed is not None
            else {}
        )
        for rid, kept in resumed.items():
            # Positions from ``kept`` on were computed only in steps the request did not keep
            # (steps in flight that upstream dropped as stale), and so were all the positions of
            # a step whose sampled token it did not keep: the step that ended a chunked prefill
            # computed prompt positions below ``kept``, but upstream dropped its output whole.
            # Their rows are owed no more, and a row the recompute brings for one of them is
            # owed afresh.
            stale = {
                p
                for start, n in self._carried.pop(rid, ())
                if start + n - 1 >= kept
                for p in range(start, start + n)
            }
            for positions in (self.owed.get(rid), self.produced.get(rid)):
                if positions:
                    positions.difference_update([p for p in positions if p >= kept or p in stale])
            # The last row handed over from a step whose tokens the request kept: the runtime
            # rightly drops what first comes in below it, in every step of the recompute (a
            # long recompute is scheduled in chunks, over several steps).
            self._resume_top[rid] = max((q for q in self.handed(rid) if q < kept), default=-1)
        base = super().execute(so)
        rows: list[tuple[int, torch.Tensor] | None] = []
        for rid in base.req_ids:
            start = computed.get(rid, 0)
            n = so.num_scheduled_tokens[rid]
            pattern = self.pattern_of(rid)
            prefill = start < self._prompt_len.get(rid, 0)
            carry = (
                pattern == "always"
                or (pattern == "prefill" and prefill)
                or (pattern == "every_other" and (start // max(1, n)) % 2 == 0)
            )
            if not carry:
                rows.append(None)
                continue
            rows.append(
                (start, torch.stack([synthetic_row(rid, p) for p in range(start, start + n)]))
            )
            before = self.produced.setdefault(rid, set())
            if self.handed is not None:
                self._carried.setdefault(rid, []).append((start, n))
                top = self._resume_top.get(rid, -1)
                self.owed.setdefault(rid, set()).update(
                    p for p in range(start, start + n) if p > top and p not in before
                )
            before.update(range(start, start + n))
        for rid in so.finished_req_ids:
            self._prompt_len.pop(rid, None)
            self._resume_top.pop(rid, None)
            self._carried.pop(rid, None)
        return self.delivery.with_payloads(base, rows)


# ---- malformed stage inputs ---------------------------------------------------------------


@dataclass(frozen=True)
class Malformed:
    """One defect: how to build the input, and the field the rejection must name."""

    defect: str
    field: str
    kwargs: dict[str, Any]
    # The type of the value that is wrong, for a defect that is a value of the wrong type (what
    # a subject whose rejections name the type, ``StageInputSpec.names_types``, must name).
    wrong_type: str | None = None

    def describe(self) -> str:
        return f"{self.defect} -> {self.field}"


def _embeds(n: int, *, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.linspace(-1, 1, n * dim, dtype=torch.float64).reshape(n, dim).to(dtype)


# Every defect ``malformed_inputs`` plants, one per input.
MALFORMED_KINDS: tuple[str, ...] = (
    "nan_embeds",
    "inf_embeds",
    "embeds_dtype",
    "embeds_shape_1d",
    "embeds_width",
    "embeds_empty",
    "both_prompts",
    "no_prompt",
    "empty_ids",
    "negative_id",
    "id_over_vocab",
    "bool_id",
    "float_id",
    "ids_tensor_float",
    "too_long",
    "too_long_embeds",
    "nan_conditioning",
    "conditioning_not_tensor",
    "info_nan",
    "info_key",
    "info_object",
    "info_nan_tensor",
    "info_not_mapping",
    "info_big_int",
    "info_list_object",
    "final_unknown",
    "final_before",
    "max_tokens",
    "sampling_params_type",
    "empty_request_id",
    "embeds_not_tensor",
    "ids_tensor_2d",
    "ids_tensor_0d",
    "embeds_meta",
    "conditioning_meta",
    "trace_headers_not_str",
    "trace_headers_not_mapping",
)
# Defects of input forms an adapter need not take (``StageInputSpec``'s options).
_OPTIONAL_KINDS = {
    "ids_tensor_2d": "id_tensors",
    "ids_tensor_0d": "id_tensors",
    "trace_headers_not_str": "trace_headers",
    "trace_headers_not_mapping": "trace_headers",
}


def malformed_kinds(spec: StageInputSpec) -> tuple[str, ...]:
    """The defects ``spec``'s adapter can be fed: every kind but those of forms it does not
    take."""
    return tuple(
        k for k in MALFORMED_KINDS if k not in _OPTIONAL_KINDS or getattr(spec, _OPTIONAL_KINDS[k])
    )


@st.composite
def malformed_inputs(
    draw: st.DrawFn, spec: StageInputSpec, kinds: Sequence[str] | None = None
) -> Malformed:
    """One defect, of one of ``kinds`` (default: every kind ``spec``'s adapter can be fed), in
    an otherwise valid input of ``spec``'s stage."""
    kinds = malformed_kinds(spec) if kinds is None else kinds
    HIDDEN, VOCAB = spec.hidden_size, spec.vocab_size
    n = draw(st.integers(1, 8))
    pos = draw(st.integers(0, n - 1))
    ids = [10 + i for i in range(n)]
    kind = draw(st.sampled_from(kinds))
    kw: dict[str, Any] = {"prompt_token_ids": ids}
    fld = "prompt"
    if kind in ("nan_embeds", "inf_embeds"):
        e = _embeds(n, dim=HIDDEN)
        e[pos, draw(st.integers(0, HIDDEN - 1))] = (
            float("nan") if kind == "nan_embeds" else float("inf")
        )
        kw = {"prompt_embeds": e}
        fld = "prompt_embeds"
    elif kind == "embeds_dtype":
        kw = {
            "prompt_embeds": _embeds(
                n, dim=HIDDEN, dtype=draw(st.sampled_from([torch.float16, torch.float64]))
            )
        }
        fld = "prompt_embeds"
    elif kind == "embeds_shape_1d":
        kw = {"prompt_embeds": _embeds(n, dim=HIDDEN).reshape(-1)}
        fld = "prompt_embeds"
    elif kind == "embeds_width":
        kw = {"prompt_embeds": _embeds(n, dim=draw(st.sampled_from([HIDDEN - 1, HIDDEN + 1, 8])))}
        fld = "prompt_embeds"
    elif kind == "embeds_empty":
        kw = {"prompt_embeds": torch.zeros((0, HIDDEN))}
        fld = "prompt_embeds"
    elif kind == "both_prompts":
        kw = {"prompt_token_ids": ids, "prompt_embeds": _embeds(n, dim=HIDDEN)}
    elif kind == "no_prompt":
        kw = {}
    elif kind == "empty_ids":
        kw = {"prompt_token_ids": []}
        fld = "prompt_token_ids"
    elif kind in ("negative_id", "id_over_vocab", "bool_id", "float_id"):
        bad: Any = {
            "negative_id": -draw(st.integers(1, 5)),
            "id_over_vocab": VOCAB + draw(st.integers(0, 5)),
            "bool_id": True,
            "float_id": 3.0,
        }[kind]
        ids[pos] = bad
        kw = {"prompt_token_ids": ids}
        fld = f"prompt_token_ids[{pos}]"
    elif kind == "ids_tensor_float":
        kw = {"prompt_token_ids": torch.tensor(ids, dtype=torch.float32)}
        fld = "prompt_token_ids"
    elif kind == "too_long":
        # A prompt that fills the context is too long as well: upstream's input processor
        # refuses it for a generating model (no room for the first output token).
        kw = {"prompt_token_ids": [7] * (spec.max_model_len + draw(st.integers(0, 20)))}
    elif kind == "too_long_embeds":
        # Embeds count one prompt token per row, whatever their width.
        rows = spec.max_model_len + draw(st.integers(0, 20))
        kw = {"prompt_embeds": torch.zeros((rows, HIDDEN))}
    elif kind == "nan_conditioning":
        c = torch.zeros(HIDDEN)
        c[draw(st.integers(0, HIDDEN - 1))] = float("nan")
        kw["conditioning"] = c
        fld = "conditioning"
    elif kind == "conditioning_not_tensor":
        kw["conditioning"] = [0.0] * 4
        fld = "conditioning"
    elif kind == "info_nan":
        kw["additional_information"] = {"speaker": float("nan")}
        fld = "additional_information['speaker']"
    elif kind == "info_key":
        kw["additional_information"] = {3: "x"}
        fld = "additional_information[3]"
    elif kind == "info_object":
        kw["additional_information"] = {"obj": object()}
        fld = "additional_information['obj']"
    elif kind == "info_nan_tensor":
        t = torch.ones(3)
        t[pos % 3] = float("nan")
        kw["additional_information"] = {"voice": t}
        fld = "additional_information['voice']"
    elif kind == "info_not_mapping":
        kw["additional_information"] = [("speaker", 0.5)]
        fld = "additional_information"
    elif kind == "info_big_int":
        # vLLM's request codec (msgpack) carries integers of 64 bits, no more: one past that
        # range cannot reach a stage in another process, so no stage may accept it.
        big = draw(st.sampled_from([2**64, -(2**63) - 1, 2**80]))
        kw["additional_information"] = {"seed": [1, big] if pos % 2 else big}
        fld = "additional_information['seed']"
    elif kind == "info_list_object":
        kw["additional_information"] = {"tags": ["a", object()]}
        fld = "additional_information['tags']"
    elif kind == "embeds_not_tensor":
        kw = {"prompt_embeds": _embeds(n, dim=HIDDEN).tolist()}
        fld = "prompt_embeds"
    elif kind == "ids_tensor_2d":
        kw = {"prompt_token_ids": torch.tensor([ids], dtype=torch.long)}
        fld = "prompt_token_ids"
    elif kind == "ids_tensor_0d":
        # One id as a scalar tensor: not a sequence of ids.
        kw = {"prompt_token_ids": torch.tensor(ids[pos], dtype=torch.long)}
        fld = "prompt_token_ids"
    elif kind == "embeds_meta":
        # Shape and dtype right, but no data (a tensor on torch's meta device).
        kw = {"prompt_embeds": torch.empty((n, HIDDEN), device="meta")}
        fld = "prompt_embeds"
    elif kind == "conditioning_meta":
        kw["conditioning"] = torch.empty(HIDDEN, device="meta")
        fld = "conditioning"
    elif kind == "trace_headers_not_str":
        kw["trace_headers"] = {"traceparent": draw(st.sampled_from([1, None, b"00"]))}
        fld = "trace_headers"
    elif kind == "trace_headers_not_mapping":
        kw["trace_headers"] = [("traceparent", "00")]
        fld = "trace_headers"
    elif kind == "final_unknown":
        kw["final_stage_id"] = "no-such-stage"
        fld = "final_stage_id"
    elif kind == "final_before":
        # A stage before this one (or, for the first stage, one that does not exist).
        earlier = spec.stages[: spec.stages.index(spec.stage_id)]
        kw["final_stage_id"] = earlier[-1] if earlier else "no-such-stage"
        fld = "final_stage_id"
    elif kind == "max_tokens":
        kw["max_tokens"] = 0
        fld = "sampling_params.max_tokens"
    elif kind == "sampling_params_type":
        # What a client of another engine might send: the parameters as a plain mapping, or
        # nothing. A generating stage has no request without vLLM's ``SamplingParams``.
        kw["sampling_params"] = draw(st.sampled_from([{"max_tokens": 4}, None]))
        fld = "sampling_params"
    elif kind == "empty_request_id":
        kw["request_id"] = ""
        fld = "request_id"
    wrong = {
        "bool_id": "bool",
        "float_id": "float",
        "conditioning_not_tensor": "list",
        "info_object": "object",
        "embeds_not_tensor": "list",
    }.get(kind)
    return Malformed(kind, fld, kw, wrong)


# ---- request batches for runner-level properties ------------------------------------------


@dataclass(frozen=True)
class Job:
    """One request of a runner-level workload: shared prefix, own length, limit, abort step."""

    prefix: int
    length: int
    max_tokens: int
    abort_after: int | None


# The workload language's shared prefixes (``conformance._core.machine.PREFIXES``), numbered for ``Job``.
PREFIX_TOKENS: dict[int, list[int]] = {0: [], 1: list(PREFIXES["sys"]), 2: list(PREFIXES["doc"])}

# Batches whose shape random draws meet rarely, but where a runner's bookkeeping changes: the
# first request's last prompt position is row 0 of the step (a one-token prompt first in the
# batch: row 0 is a real row, not "none"), with a second request's last prompt row after it.
EDGE_JOBS: tuple[tuple[Job, ...], ...] = ((Job(0, 1, 3, None), Job(0, 4, 2, None)),)

jobs = st.sampled_from(EDGE_JOBS).map(list) | st.lists(
    st.builds(
        Job,
        prefix=st.integers(0, 2),
        length=st.integers(1, 30),
        max_tokens=st.integers(1, 12),
        abort_after=st.none() | st.integers(0, 8),
    ),
    min_size=1,
    max_size=6,
)


def job_prompt(i: int, job: Job) -> list[int]:
    return PREFIX_TOKENS[job.prefix] + [100 + (i * 37 + k) % 200 for k in range(job.length)]


# ---- well-formed stage inputs with every kind of value a slot may carry (C-46) ----------------

_SLOT_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
)


@st.composite
def slot_tensors(draw: st.DrawFn) -> torch.Tensor:
    """A finite tensor of any dtype the wire must keep: 0-d, empty, 1-d, 2-d or a transposed
    (non-contiguous) view; values include -0.0, subnormals and each dtype's extremes."""
    dtype = draw(st.sampled_from(_SLOT_DTYPES))
    shape = draw(st.sampled_from([(), (0,), (1,), (5,), (2, 3), (3, 0), (4, 2)]))
    n = 1
    for d in shape:
        n *= d
    if dtype.is_floating_point:
        limit = 6.0e4 if dtype == torch.float16 else 2.0**100
        values = draw(
            st.lists(
                st.floats(-limit, limit, allow_nan=False, allow_infinity=False, width=32)
                | st.sampled_from([-0.0, 1.0e-40, -1.0e-45, 3.0e38 if limit > 1e5 else 6.0e4]),
                min_size=n,
                max_size=n,
            )
        )
        t = torch.tensor(values, dtype=torch.float32).to(dtype)
    elif dtype == torch.bool:
        t = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=dtype)
    else:
        info = torch.iinfo(dtype)
        ints = st.integers(info.min, info.max) | st.sampled_from([info.min, info.max, 0])
        t = torch.tensor(draw(st.lists(ints, min_size=n, max_size=n)), dtype=dtype)
    t = t.reshape(shape)
    if t.dim() == 2 and draw(st.booleans()):
        t = t.t()  # a view whose memory is not in its logical order
    return t


def every_slot_kind(spec: StageInputSpec) -> dict[str, Any]:
    """One input whose slot holds a tensor of every dtype ``slot_tensors`` draws (0-d, empty and
    transposed ones among them), every kind of scalar and a list: checked before the generated
    ones, so no kind depends on the examples a profile happens to draw."""
    info: dict[str, Any] = {}
    for i, dtype in enumerate(_SLOT_DTYPES):
        base = torch.arange(6, dtype=torch.float32) - 2.5
        t = (base > 0) if dtype == torch.bool else base.to(dtype)
        info[f"t{i}"] = t.reshape(2, 3).t() if i % 2 else t
    info["zero_d"] = torch.tensor(-0.0)
    info["empty"] = torch.empty((3, 0), dtype=torch.int16)
    info.update({"none": None, "flag": True, "n": -(2**63), "x": 1e-310, "s": "é", "l": [1, "a"]})
    return {
        "prompt_token_ids": [1, 2, 3],
        "conditioning": torch.linspace(-1, 1, spec.hidden_size),
        "additional_information": info,
    }


# Integers reach past 64 bits: an adapter may accept only what its stage's wire can carry.
_SLOT_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.sampled_from([2**64 - 1, 2**64, -(2**63) - 1, 2**80])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6)
)


@st.composite
def stage_inputs(draw: st.DrawFn, spec: StageInputSpec) -> dict[str, Any]:
    """A well-formed input of ``spec``'s stage: prompt ids or embeds, optional conditioning,
    additional information mixing tensors, scalars and lists, and a final stage."""
    fields: dict[str, Any] = {}
    n = draw(st.integers(1, 6))
    if draw(st.booleans()):
        fields["prompt_token_ids"] = draw(
            st.lists(st.integers(0, spec.vocab_size - 1), min_size=n, max_size=n)
        )
    else:
        fields["prompt_embeds"] = _embeds(n, dim=spec.hidden_size) * draw(st.floats(0.5, 2.0))
    if draw(st.booleans()):
        fields["conditioning"] = draw(slot_tensors())
    if draw(st.booleans()):
        values = slot_tensors() | _SLOT_SCALARS | st.lists(_SLOT_SCALARS, max_size=3)
        fields["additional_information"] = draw(
            st.dictionaries(st.text(min_size=1, max_size=8), values, max_size=4)
        )
    later = spec.stages[spec.stages.index(spec.stage_id) :]
    fields["final_stage_id"] = draw(st.sampled_from([None, *later]))
    return fields
