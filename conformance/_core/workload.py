"""The workload language: the operations a lock-step run applies to both schedulers, and traces.

A ``Trace`` is a ``HarnessConfig``, named shared prompt prefixes and a list of operations; it is
the unit of replay (``to_json``; ``omni-conformance replay``). The operations are deliberately
few: ``AddRequest``, ``StreamInput``, ``Step``, ``Abort``, ``ResetPrefixCache``,
``DeliverChunks`` and ``ChunkArrives``. Nothing else changes scheduler state, so a trace fully determines both runs.

What each operation carries and does: docs/design.md, "Inside the gate"; the trace headers and
client index of ``AddRequest``: C-07 in docs/contracts.md.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from conformance._core.config import HarnessConfig

FORMAT = "omni-conformance-trace/1"


@dataclass(frozen=True)
class AddRequest:
    kind: ClassVar[str] = "add"
    request_id: str
    prompt: tuple[int, ...]
    prefix: str | None = None
    max_tokens: int = 8
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = True
    final_stage: str | None = None
    # (name, value) pairs, kept as a tuple so that the operation stays hashable; ``headers()``
    # gives the mapping a request carries. None: the client sent none (upstream's default).
    trace_headers: tuple[tuple[str, str], ...] | None = None
    # The engine client the request came from (``EngineCoreRequest.client_index``; several API
    # server processes front one engine): a step's outputs come back grouped by it.
    client_index: int = 0
    # The request comes from a client that knows nothing of the subject's runtime (vLLM's own
    # front end, a health check): it is upstream's request as upstream's engine builds it, with
    # none of the runtime's per-request data. Drawn only for a feature that declares
    # ``plain_requests``; its subject must then serve it as upstream would and send nothing
    # downstream for it (C-42).
    plain: bool = False
    # ``Request.priority`` (the priority scheduling axis): lower is served first; ties go by
    # arrival. Ignored by the default first-come-first-served policy.
    priority: int = 0
    # The client's arrival time (``Request.arrival_time``), when the workload draws one: the
    # priority policy breaks ties by it, and API servers' clocks need not agree. None: the
    # session's own clock, one tick per request.
    arrival: float | None = None
    # What the client sends the KV connector (``Request.kv_transfer_params``, through
    # ``SamplingParams.extra_args``): (key, value) pairs, hashable as ``trace_headers``. None:
    # none sent. Drawn by the KV-connector axes (``conformance._core.harness_connector.Plan``).
    kv_transfer_params: tuple[tuple[str, Any], ...] | None = None
    # The grammar the request's output must follow (``SamplingParams.structured_outputs``): a
    # name in ``conformance._core.grammars.CATALOGUE``. None: unconstrained.
    grammar: str | None = None
    # How the request's prefix-cache hits are published as KV events
    # (``SamplingParams.extra_args["kv_cache_report_mode"]``): "full" re-publishes the blocks a
    # hit reuses as stored, for a consumer that learns the cache from one request. None: the
    # client sent no mode (vLLM's "incremental": only newly stored blocks).
    kv_cache_report_mode: str | None = None
    # ``SamplingParams.skip_reading_prefix_cache``: the request computes its whole prompt, with
    # no local prefix-cache hit and no external (KV connector) hit, as a request for prompt
    # log-probabilities does; its blocks are still cached for others.
    skip_reading_prefix_cache: bool = False
    # A streaming input session (``Request.resumable``): the request stops at ``max_tokens`` and
    # waits for more input under its id (``StreamInput``) instead of finishing.
    resumable: bool = False
    # ``SamplingParams.logprobs``: candidates per sampled token the output must carry (the
    # ``logprobs`` axis; ``conformance._core.logprobs``). None: none asked for.
    logprobs: int | None = None
    # Images the client sends (the multimodal axes; ``conformance._core.multimodal``): (name in
    # ``IMAGES``, position among the request's own tokens) pairs. The prompt the engine gets
    # has each expanded into its placeholder tokens there (``Trace.prompt_of``).
    images: tuple[tuple[str, int], ...] = ()
    # ``SamplingParams.min_tokens``: stop ids and EOS do not end the request before it has this
    # many output tokens (the limits axis).
    min_tokens: int = 0
    # ``SamplingParams.prompt_logprobs``: candidates per prompt position the output carrying the
    # request's first token must hold (the ``logprobs`` axes; ``conformance._core.logprobs``).
    # vLLM then reads no prefix-cache hit for it. None: none asked for.
    prompt_logprobs: int | None = None
    # The LoRA adapter the request runs with (``Request.lora_request``, the LoRA axis): its
    # integer id, 0 for none. Its name (``lora-<id>``) keys the prefix cache's block hashes.
    lora: int = 0
    # ``SamplingParams.repetition_detection`` as (max_pattern_size, min_pattern_size, min_count):
    # the request ends (``FINISHED_REPETITION``) once its output's tail repeats a pattern of that
    # size that many times (the limits axis). None: no detection.
    repetition: tuple[int, int, int] | None = None
    # The client sends the prompt as embeddings (``prompt_embeds``, one row per token, no token
    # ids), as a downstream stage fed by another model's hidden states is (the prompt-embeds
    # axis; ``subjects.prompt_embeddings``).
    embeds: bool = False

    def headers(self) -> dict[str, str] | None:
        """The trace headers as the mapping vLLM's ``Request.trace_headers`` holds."""
        return None if self.trace_headers is None else dict(self.trace_headers)

    def describe(self) -> str:
        pre = f"{self.prefix}+" if self.prefix else ""
        return (
            f"add {self.request_id} prompt={pre}{len(self.prompt)} max_tokens={self.max_tokens}"
            f" stop={list(self.stop_token_ids)} ignore_eos={self.ignore_eos}"
            + (f" final_stage={self.final_stage}" if self.final_stage else "")
            + (f" trace_headers={self.headers()}" if self.trace_headers is not None else "")
            + (f" client={self.client_index}" if self.client_index else "")
            + (" plain" if self.plain else "")
            + (f" priority={self.priority}" if self.priority else "")
            + (f" arrival={self.arrival}" if self.arrival is not None else "")
            + (
                f" kv_transfer_params={dict(self.kv_transfer_params)}"
                if self.kv_transfer_params is not None
                else ""
            )
            + (f" grammar={self.grammar}" if self.grammar is not None else "")
            + (
                f" kv_cache_report_mode={self.kv_cache_report_mode}"
                if self.kv_cache_report_mode is not None
                else ""
            )
            + (" skip_reading_prefix_cache" if self.skip_reading_prefix_cache else "")
            + (" resumable" if self.resumable else "")
            + (f" logprobs={self.logprobs}" if self.logprobs is not None else "")
            + (f" images={_images(self.images)}" if self.images else "")
            + (f" min_tokens={self.min_tokens}" if self.min_tokens else "")
            + (f" lora={self.lora}" if self.lora else "")
            + (
                f" prompt_logprobs={self.prompt_logprobs}"
                if self.prompt_logprobs is not None
                else ""
            )
            + (f" repetition={list(self.repetition)}" if self.repetition is not None else "")
            + (" embeds" if self.embeds else "")
        )


@dataclass(frozen=True)
class StreamInput:
    """The client sends a streaming session more input under its id, as vLLM's ``AsyncLLM``
    does for each chunk of an input stream: an ``EngineCoreRequest`` of the same id, resumable,
    with the chunk as its prompt and the session's sampling parameters (``max_tokens`` its own
    when given). ``end``: the stream closed, sent as vLLM sends it (a request that is not
    resumable, prompt ``[0]``): the session finishes after the turn it is in."""

    kind: ClassVar[str] = "stream_input"
    request_id: str
    prompt: tuple[int, ...] = ()
    max_tokens: int | None = None
    end: bool = False
    # Images the chunk carries (a multimodal model's sessions), placed among the chunk's own
    # tokens as ``AddRequest.images`` are; vLLM moves them past what the session holds.
    images: tuple[tuple[str, int], ...] = ()

    def describe(self) -> str:
        if self.end:
            return f"end the input stream of {self.request_id}"
        limit = f" max_tokens={self.max_tokens}" if self.max_tokens is not None else ""
        pictures = f" images={_images(self.images)}" if self.images else ""
        return f"more input for {self.request_id}: prompt={len(self.prompt)}{limit}{pictures}"


@dataclass(frozen=True)
class Step:
    kind: ClassVar[str] = "step"

    def describe(self) -> str:
        return "step"


@dataclass(frozen=True)
class Abort:
    kind: ClassVar[str] = "abort"
    request_ids: tuple[str, ...]

    def describe(self) -> str:
        return f"abort {list(self.request_ids)}"


@dataclass(frozen=True)
class ResetPrefixCache:
    kind: ClassVar[str] = "reset_prefix_cache"
    reset_running_requests: bool = False
    reset_connector: bool = False

    def describe(self) -> str:
        return (
            f"reset_prefix_cache(reset_running_requests={self.reset_running_requests}, "
            f"reset_connector={self.reset_connector})"
        )


@dataclass(frozen=True)
class Pause:
    """The engine pauses or resumes its scheduler (``set_pause_state``, as vLLM's
    ``pause_scheduler`` and ``resume_scheduler`` do): ``new`` schedules no new requests, ``all``
    schedules nothing, ``off`` resumes."""

    kind: ClassVar[str] = "pause"
    state: str

    def describe(self) -> str:
        return (
            "resume the scheduler" if self.state == "off" else f"pause the scheduler ({self.state})"
        )


PAUSE_STATES = ("new", "all", "off")


@dataclass(frozen=True)
class ResetEncoderCache:
    """The engine drops every cached encoder output (``reset_encoder_cache``, as it does when
    the model's weights are updated): later images are encoded again."""

    kind: ClassVar[str] = "reset_encoder_cache"

    def describe(self) -> str:
        return "reset_encoder_cache"


@dataclass(frozen=True)
class DeliverChunks:
    kind: ClassVar[str] = "deliver_chunks"

    def describe(self) -> str:
        return "deliver_chunks"


@dataclass(frozen=True)
class Shutdown:
    """The engine shuts the scheduler down (``EngineCore.shutdown``): its KV connector, encoder
    cache connector and event publisher with it. The drain's last operation."""

    kind: ClassVar[str] = "shutdown"

    def describe(self) -> str:
        return "shutdown"


@dataclass(frozen=True)
class ChunkArrives:
    """A chunk from the upstream stage arrives for a request of a receiving stage (C-47);
    ``final``: the last one. Upstream vLLM has no such input: its side does nothing."""

    kind: ClassVar[str] = "chunk_arrives"
    request_id: str
    final: bool = False

    def describe(self) -> str:
        return f"chunk arrives for {self.request_id}" + (" (final)" if self.final else "")


Op = (
    AddRequest
    | StreamInput
    | Step
    | Abort
    | ResetPrefixCache
    | Pause
    | ResetEncoderCache
    | DeliverChunks
    | ChunkArrives
    | Shutdown
)
OP_TYPES: dict[str, type] = {
    t.kind: t
    for t in (
        AddRequest,
        StreamInput,
        Step,
        Abort,
        Pause,
        ResetEncoderCache,
        ResetPrefixCache,
        DeliverChunks,
        ChunkArrives,
        Shutdown,
    )
}


def _as_lists(v: Any) -> Any:
    return [_as_lists(x) for x in v] if isinstance(v, tuple) else v


def _images(images: tuple[tuple[str, int], ...]) -> str:
    from conformance._core.multimodal import describe

    return describe(images)


def _as_tuples(v: Any) -> Any:
    return tuple(_as_tuples(x) for x in v) if isinstance(v, list) else v


def op_to_dict(op: Op) -> dict[str, Any]:
    d: dict[str, Any] = {"op": op.kind}
    for k, v in asdict(op).items():
        # A field left at its default is not written, so traces from before a field existed
        # and traces after it read the same, and a trace shows only what was chosen.
        if (k, v) in (
            ("trace_headers", None),
            ("client_index", 0),
            ("plain", False),
            ("priority", 0),
            ("arrival", None),
            ("kv_transfer_params", None),
            ("grammar", None),
            ("kv_cache_report_mode", None),
            ("skip_reading_prefix_cache", False),
            ("resumable", False),
            ("logprobs", None),
            ("images", ()),
            ("min_tokens", 0),
            ("lora", 0),
            ("prompt_logprobs", None),
            ("repetition", None),
            ("embeds", False),
            ("max_tokens", None),
            ("end", False),
        ):
            continue
        d[k] = _as_lists(v)
    return d


def op_from_dict(d: dict[str, Any]) -> Op:
    data = dict(d)
    kind = data.pop("op")
    try:
        cls = OP_TYPES[kind]
    except KeyError:
        raise ValueError(f"trace: unknown op {kind!r}; known {sorted(OP_TYPES)}") from None
    for k, v in list(data.items()):
        data[k] = _as_tuples(v)
    return cls(**data)  # type: ignore[no-any-return]


@dataclass
class Trace:
    config: HarnessConfig = field(default_factory=HarnessConfig)
    ops: list[Op] = field(default_factory=list)
    prefixes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def prompt_of(self, op: AddRequest) -> list[int]:
        head = list(self.prefixes[op.prefix]) if op.prefix else []
        if op.images:
            from conformance._core.multimodal import expand

            return head + expand(op.prompt, op.images)
        return head + list(op.prompt)

    def session_input(self, op: StreamInput, upto: int | None = None) -> AddRequest:
        """The request the client sends for ``op``: the session's own ``AddRequest`` (the first
        of its id among the first ``upto`` operations) with the chunk as its prompt, resumable;
        for the end of the stream, not resumable and prompt ``[0]`` (vLLM's end marker)."""
        ops = self.ops if upto is None else self.ops[:upto]
        first = next(
            (o for o in ops if isinstance(o, AddRequest) and o.request_id == op.request_id), None
        )
        if first is None:
            raise ValueError(f"trace: input for {op.request_id!r}, which no request started")
        if op.end:
            return replace(first, prompt=(0,), prefix=None, resumable=False, images=())
        limit = first.max_tokens if op.max_tokens is None else op.max_tokens
        return replace(
            first,
            prompt=op.prompt,
            prefix=None,
            max_tokens=limit,
            resumable=True,
            images=op.images,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "config": self.config.to_dict(),
            "prefixes": {k: list(v) for k, v in self.prefixes.items()},
            "ops": [op_to_dict(op) for op in self.ops],
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trace:
        found = data.get("format")
        if found != FORMAT:
            prefix, _, number = str(found).rpartition("/")
            mine = int(FORMAT.rpartition("/")[2])
            if prefix == FORMAT.rpartition("/")[0] and number.isdigit() and int(number) > mine:
                raise ValueError(
                    f"trace: format {found!r} was written by a newer omni-conformance; this one "
                    f"reads {FORMAT!r} (upgrade omni-conformance to replay it)"
                )
            raise ValueError(f"trace: expected format {FORMAT!r}, got {found!r}")
        return cls(
            config=HarnessConfig.from_dict(data["config"]),
            ops=[op_from_dict(o) for o in data["ops"]],
            prefixes={k: tuple(v) for k, v in data.get("prefixes", {}).items()},
            meta=dict(data.get("meta", {})),
        )

    def to_json(self) -> str:
        """Readable JSON: one line per operation and per prefix, so diffs of traces are small."""
        d = self.to_dict()

        def dump(v: Any) -> str:
            return json.dumps(v, default=_jsonable)

        prefixes = ",\n".join(f"  {dump(k)}: {dump(v)}" for k, v in d["prefixes"].items())
        ops = ",\n".join(f"  {dump(o)}" for o in d["ops"])
        return (
            "{\n"
            f' "format": {dump(d["format"])},\n'
            f' "config": {dump(d["config"])},\n'
            f' "prefixes": {{\n{prefixes}\n }},\n'
            f' "ops": [\n{ops}\n ],\n'
            f' "meta": {json.dumps(d["meta"], indent=1, default=_jsonable)}\n'
            "}\n"
        )

    @classmethod
    def from_json(cls, text: str) -> Trace:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(self.to_json())
        return p

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        return cls.from_json(Path(path).read_text())


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    if isinstance(value, bytes):
        return value.hex()
    return str(value)
