"""What a subject can be checked for, beyond lock-step parity: the capability vocabulary.

Every runtime can be compared with upstream step by step (AR-INV-001); the other checks of the
suite look inside a runtime (its request slot, its send path, its worker's payloads, its input
adapter, its source tree) and so need the runtime to say where to look. A subject declares each
such capability by returning an object from the matching ``Subject`` hook; ``BaseSubject``
returns ``None`` for all of them ("not provided"), and a test whose capability is not provided is
reported *not applicable* with the reason (``require``), never run against another runtime.

The objects here are the shared language between the suite and a subject: plain dataclasses for
what a subject declares (``Feature``, ``DeclaredAttributes``, ``SourceLayout``, ``StageInputSpec``)
and the normalised views the suite reads (``ChunkView``, ``PayloadView``), plus protocols for the
hooks that must run the subject's own code (``ChunkDelivery``, ``InputAdapterProbe``,
``RunnerProbes``, ``ModelReference``, ``FaultContainment``, ``ProcessBoundary``). Nothing in this module imports a runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    from conformance._core.workload import Op

# The capability hooks of ``conformance._core.subjects.BaseSubject``: each returns None when the subject
# does not provide that capability.
CAPABILITY_HOOKS: tuple[str, ...] = (
    "declared_attributes",
    "chunk_delivery",
    "source_layout",
    "input_adapter",
    "runner_probes",
    "model_reference",
    "difference_witnesses",
    "fault_containment",
    "process_boundary",
    "receiving_stage",
)


class NotApplicable(Exception):
    """The subject does not provide what a check needs; the plugin reports it as skipped."""


class CheckNotRun(Exception):
    """A check the subject's capabilities promise could not run here, for an environmental
    reason (a missing tool or package, an unreadable file): reported as ``not_run`` with the
    reason, and ``omni-conformance check`` fails, since a check that quietly does not run would
    leave its clause looking as if it held."""


@dataclass(frozen=True)
class Feature:
    """One configuration of the subject to run the lock-step machines with.

    ``additional_config`` is merged into ``HarnessConfig.additional_config``; ``final_stages``
    are the values the workload may draw for ``AddRequest.final_stage``; ``use_worker`` runs the
    subject's real worker on both sides instead of the harness's token source; ``token_edges``
    are ids where the subject's handling of sampled ids changes (the ends of an id range it
    treats apart), which the harness's token source then samples at a fixed share of positions
    (``conformance._core.tokens.EDGE_PERIOD``): uniform sampling over the vocabulary rarely or never
    reaches them. ``plain_requests``: the subject's engine also serves requests from clients
    that know nothing of its runtime (upstream's own requests, without its per-request data), so
    the workload draws some (``AddRequest.plain``); each must be served as upstream serves it and
    send nothing downstream (C-42).
    """

    name: str
    additional_config: Mapping[str, Any] = field(default_factory=dict)
    final_stages: tuple[str | None, ...] = (None,)
    use_worker: bool = False
    token_edges: tuple[int, ...] = ()
    plain_requests: bool = False

    @classmethod
    def from_config(cls, name: str, cfg: Mapping[str, Any]) -> Feature:
        """A ``Subject.feature_configs()`` value as a ``Feature``."""
        return cls(
            name,
            dict(cfg.get("additional_config") or {}),
            tuple(cfg.get("final_stages") or (None,)),
            bool(cfg.get("use_worker", False)),
            tuple(int(t) for t in cfg.get("token_edges") or ()),
            bool(cfg.get("plain_requests", False)),
        )


OFF = Feature("off")


@dataclass(frozen=True)
class DeclaredAttributes:
    """What the subject adds to upstream objects (C-10..C-12).

    ``request`` maps each attribute a subject's ``Request`` may carry beyond upstream's to the
    type(s) its value must have (the declared slot); ``scheduler`` names the attributes its
    scheduler adds; ``send_path`` are those of them allowed to hold tensors (an outbox waiting
    for delivery); ``modality_types`` are the subject's payload classes, searched for besides
    tensors and arrays wherever no tensor may be.
    """

    request: Mapping[str, type | tuple[type, ...]] = field(default_factory=dict)
    scheduler: frozenset[str] = frozenset()
    send_path: frozenset[str] = frozenset()
    modality_types: tuple[type, ...] = ()
    # Upstream fields whose upstream meaning is a tensor.
    upstream_tensor_fields: frozenset[str] = frozenset({"prompt_embeds"})


@dataclass(frozen=True)
class PayloadView:
    """A per-request payload as the suite reads it: rows ``[start, start + num_tokens)``."""

    request_id: str
    start: int
    num_tokens: int
    hidden: torch.Tensor | None = None  # [rows, width]
    conditioning: torch.Tensor | None = None
    multimodal: Mapping[str, Any] = field(default_factory=dict)
    has_tensors: bool = False


@dataclass(frozen=True)
class ChunkView:
    """One delivery to the downstream stage: its order, whether it is the EOF, what it carries."""

    request_id: str
    seq: int
    is_final: bool
    token_ids: tuple[int, ...] | None = None
    payload: PayloadView | None = None
    # On the EOF, why the request ended as vLLM names it (``stop``, ``length``, ``abort``,
    # ``error``), when the subject's chunks say; None: they do not.
    finish_reason: str | None = None


@runtime_checkable
class ChunkDelivery(Protocol):
    """How a subject hands work downstream (C-21, C-40..C-45)."""

    def install_sink(self, scheduler: Scheduler, sink: Any) -> bool:
        """Route the scheduler's sends through ``sink.send(chunk)``; False if it has no send path
        in this configuration."""

    # Optional: ``sink_is_connector`` (default True): the installed sink is where the stage's
    # connector sends, so a sink that raises is a connector fault the stage must keep to its
    # request (C-61). False declares that the sink only sees chunks after they crossed (a stage
    # in another process): connector faults are then not planted through it.

    def view(self, chunk: Any) -> ChunkView: ...

    def payload_view(self, payload: Any) -> PayloadView | None:
        """A payload as handed to a processor, read as the suite reads payloads."""

    def expected_tokens(self, feature: Feature, accepted: Sequence[int]) -> list[int] | None:
        """The ids the configured processor streams for a request that accepted ``accepted``
        (None: this feature streams no ids).

        A delivery may also define ``expected_chunks(feature, steps, last_step_ends)``, optional
        and read with ``getattr``: the id groups the configured processor delivers, chunk by
        chunk and ending with the EOF's, for a request that accepted ``steps`` (its accepted
        ids, one tuple per step that accepted any). ``last_step_ends``: the last of them
        finished the request (a stop or its length), so its ids come with the final call; else
        the request was aborted and the final call carries none. None: the feature promises no
        grouping, only the ids."""

    @property
    def processor_feature(self) -> Feature | None:
        """The feature generated processors run with (C-40..C-44); None: not provided."""

    def set_processor(self, scheduler: Scheduler, processor: Callable[..., Any]) -> None:
        """Install ``processor``, called ``processor(request_id, payload, is_final[,
        new_token_ids])``; it declares ``requires_token_updates`` as an attribute or not."""

    def with_payloads(
        self, output: ModelRunnerOutput, rows: Sequence[tuple[int, torch.Tensor] | None]
    ) -> ModelRunnerOutput:
        """``output`` (a ``ModelRunnerOutput``) carrying, per request, hidden ``rows`` starting
        at a position, in the subject's own payload type."""

    # Optional: ``abort_eof`` (default True). False declares that the EOF of a request the
    # caller aborted never reaches the downstream as a chunk, because the caller that aborted
    # ends the request downstream itself (a stage process's parent does: it decided the
    # outcome before the abort crossed). The chunk ledger (C-43) then requires that an aborted
    # request got no EOF and that the ids it streamed are a prefix of its accepted ids, instead
    # of exactly one EOF and all of them.
    #
    # Optional: ``error_eof`` (default True). False declares the same for a request the stage
    # finishes with an error (a failed KV load under the fail policy, a grammar that does not
    # compile): the caller that receives the error output ends the request downstream, so no EOF
    # is owed; one may still cross when the error came in the step that sent the request's last
    # chunk (at most one, last).
    #
    # Optional: ``releases_on_final_fault`` (default False). True declares that a processor with
    # a ``release(request_id)`` method is called there once for a request whose final call
    # raised (the call in which it would have let go of the request's state itself), and for
    # no other request; the send-path fault check (C-61) then holds the subject to it.


@dataclass(frozen=True)
class SourceLayout:
    """Where a subject's code lives, for the static and stack audits (C-10, C-11, C-21).

    ``worker_roots``: folders whose frames must never be on the stack of a send.
    ``import_contracts``: an import-linter configuration (``pyproject.toml`` or ``.importlinter``)
    whose contracts keep workers away from routing code. ``payload_root`` / ``payload_type`` /
    ``payload_builders``: only modules under ``payload_builders`` (relative to the root) may call
    ``payload_type(...)``; ``payload_exceptions`` maps ``(module, function)`` to why it may too.
    """

    worker_roots: tuple[Path, ...] = ()
    import_contracts: Path | None = None
    payload_root: Path | None = None
    payload_type: str | None = None
    payload_builders: tuple[str, ...] = ()
    payload_exceptions: Mapping[tuple[str, str], str] = field(default_factory=dict)


@dataclass(frozen=True)
class SubjectAreas:
    """The parts of a subject's own package that ``omni-conformance reach`` reports coverage of,
    returned by the optional ``reach_areas()`` hook (read with ``getattr``: not a ``Subject``
    member). ``package``: the importable package the paths are relative to; ``areas``: area
    name -> files or folders (``"worker/"``: every module in it), in report order. A file two
    areas name belongs to the first; a path the installed release lacks is reported as such."""

    package: str
    areas: Mapping[str, tuple[str, ...]]


@dataclass(frozen=True)
class StageInputSpec:
    """The shapes a stage input must have, for generating malformed ones (C-13)."""

    stage_id: str
    stages: tuple[str, ...]
    hidden_size: int
    vocab_size: int
    max_model_len: int
    # Optional input forms an adapter may take (off: the suite neither feeds nor corrupts them):
    # ``prompt_token_ids`` as a 1-D integer tensor, vLLM's ``trace_headers`` (str to str).
    id_tensors: bool = False
    trace_headers: bool = False
    # vLLM's per-request fields the adapter passes through to upstream's ``Request``
    # (``arrival_time``, ``priority``, ``cache_salt``, ``client_index``): a well-formed input
    # carrying them must become a request carrying them, and one without an arrival time a
    # request with one.
    request_fields: bool = False
    # Whether the adapter's rejection of a value of the wrong type names that type ("expected a
    # tensor, got list"): a subject that says so is held to it for every such defect.
    names_types: bool = False


@runtime_checkable
class InputAdapterProbe(Protocol):
    """The subject's input adapter (C-13, C-60)."""

    @property
    def spec(self) -> StageInputSpec: ...

    @property
    def rejection(self) -> type[BaseException]:
        """Raised for bad input; instances carry ``request_id`` and ``field``, and may carry
        ``problem``: what is wrong, in words (then it must say it, as the message does)."""

    def scheduler(self) -> Scheduler:
        """A live scheduler of the adapter's stage (requests it accepts may be added to it)."""

    def build(
        self, scheduler: Scheduler, request_id: str, sampling_params: SamplingParams, **fields: Any
    ) -> Request:
        """A request for ``scheduler`` from stage-input ``fields`` (``prompt_token_ids``,
        ``prompt_embeds``, ``conditioning``, ``additional_information``, ``final_stage_id``)."""

    # Optional: ``additional_information(request) -> Mapping[str, Any]``, the additional
    # information a request ``build`` made carries for its stage's model, as that model reads
    # it; then a well-formed input's must arrive with every key and value (a list may arrive as
    # a tuple, a tensor as an equal copy).


@runtime_checkable
class RunnerProbes(Protocol):
    """Handles on the subject's real model runner for the payload and materialization
    properties (C-22, C-30, C-31, C-50..C-55)."""

    @property
    def graphs(self) -> tuple[str, ...]:
        """Names of stage graphs that may follow the stage (C-22 runs one runner per graph)."""

    def payload_feature(
        self,
        *,
        include_hidden: bool,
        full_prefix: bool,
        materialization: str = "inline",
        graph: str | None = None,
        multimodal: bool = False,
        postprocess: bool = False,
    ) -> Feature:
        """A worker feature whose runner delivers hidden rows (or, not ``include_hidden``,
        token-only payloads with the prefill conditioning); ``multimodal``: per-token
        multimodal outputs too, which both payload modes deliver (C-30); ``postprocess``: over
        a model (the same weights) whose payload postprocess is defined, asked for only when
        the probes define ``postprocessed``."""

    def includes_hidden(self, feature: Feature) -> bool: ...

    def payloads(self, output: Any) -> list[PayloadView | None] | None:
        """The output's per-request payload slots (None: no payload objects this step)."""

    # Optional: ``final_feature(include_hidden) -> Feature``, the same stage with nobody
    # downstream (the request's last stage): its runner has nothing to deliver (C-50).
    # Optional: ``unknown_output_feature(name) -> Feature``, the multimodal payload feature
    # with a per-token output called ``name`` among those it asks for, which the model does not
    # provide: building its worker must fail with an error that names ``name`` (C-30).
    # Optional: ``postprocessed(payload) -> bool``, for a subject whose models may postprocess
    # each payload their runner builds (a model's own step after the build, which sees every
    # scheduled request's payload on every step, one with nothing else to deliver included):
    # whether ``payload`` carries what the postprocess of ``payload_feature(...,
    # postprocess=True)``'s model adds. The postprocess keeps what was built (request id,
    # positions, hidden rows, conditioning, C-51); without ``postprocessed`` the token-only
    # property's postprocess case is not applicable.

    # Optional: ``failed_requests(output) -> Mapping[str, str]``, the requests the step's output
    # reports as failed by the runner, with their causes (C-54 recovery, C-61).
    # Optional, together: ``retry_features() -> Sequence[Feature]``, background-materialization
    # payload features that differ from the default in how often the stage retries a failed
    # build (its configuration's retry budget), and ``recovery_builds(feature, n) -> int``, how
    # many builds in all the stage makes for a step of ``n`` requests when every build holding
    # one of them fails. The recovery property then holds the runner to that number on every
    # such step: recovery neither gives up before the configured budget nor retries past it.

    def reusable_buffers(self, runner: Any) -> Iterable[Any]:
        """Every buffer the runner may overwrite as soon as a step returns (C-52)."""

    def defer_background_builds(self, runner: Any) -> None:
        """Make background builds run only when their output is collected (C-52, no race)."""

    def instrument(self, runner: Any) -> MaterializationProbe: ...

    def shutdown(self, runner: Any) -> None: ...


@runtime_checkable
class MaterializationProbe(Protocol):
    """Observes one runner's background materialization (C-54)."""

    # Thread ids that collected connector output, one per collection.
    collector_threads: list[int]
    # Builds started so far; ``fail_build`` makes that build number raise ``error``.
    builds: int

    def fail_build(self, number: int, error: BaseException) -> None: ...

    # The threads the subject's background builds ran on, as the subject records them.
    def builder_threads(self) -> set[int]: ...

    # Optional: ``build_threads``, the thread id of every build call as the probe saw it (the
    # check then does not take the subject's word for where builds ran, and, in a run without
    # a fault, holds ``builder_threads()`` to naming every one of them).
    # Optional: ``fail_request(request_id, error, times=None)`` makes every build whose batch
    # holds that request raise ``error`` (a fault that persists, for the C-54 recovery
    # property), or with ``times`` every such build of a batch and the first ``times`` builds
    # of that request alone (a fault only recovery's per-request pass outlasts); a probe
    # without it, or without ``times``, leaves that property not applicable.


@runtime_checkable
class ModelReference(Protocol):
    """An independent implementation of the subject's model (C-08, C-31, C-51..C-55)."""

    @property
    def features(self) -> tuple[str, ...]:
        """Worker features the model-parity property runs with (prefix caching on, then off)."""

    def greedy(self, model_path: str, prompt: Sequence[int], n: int) -> list[int]: ...

    def hidden_rows(self, model_path: str, tokens: Sequence[int]) -> torch.Tensor:
        """Final hidden rows of ``tokens`` by full recompute (no paging, no cache)."""


@dataclass(frozen=True)
class DifferenceWitness:
    """A workload that makes one registry entry's difference happen (C-03).

    ``ops`` (``conformance._core.workload`` operations) run in one lock-step session under
    ``feature``'s configuration and ``mode``, then the session drains. With the subject's whole
    registry the run must pass and ``entry`` must tolerate at least one difference; with the
    registry minus ``entry`` the same run must fail at a field the entry names. So an entry whose
    difference no longer happens (stale: it hides nothing and must go) and an entry the workload
    does not need both fail. It is the gate's runnable form of the entry's ``tests``.
    """

    entry: str
    feature: Feature
    ops: tuple[Op, ...]
    mode: str = "sync"


@runtime_checkable
class FaultContainment(Protocol):
    """The subject's claim that its worker keeps a fault raised in its model's forward to the
    requests whose data cause it, reporting them as finished with an error (C-61).

    The gate plants the fault itself (``invariants/test_reliability.py``): a forward pre-hook on
    the module ``embedding`` returns. The subject only says where its model embeds token ids,
    how to configure its scheduler and worker for the check, and how to stop the worker.
    """

    def feature(self, materialization: str) -> Feature:
        """A real-worker feature (``use_worker``) with ``materialization`` ("inline" or
        "background") payloads, or the subject's only mode when it has none."""

    def embedding(self, worker: Any) -> torch.nn.Module:
        """The ``torch.nn.Module`` the worker's forward calls with the step's token ids (vLLM
        models name it ``get_input_embeddings()``)."""

    def shutdown(self, worker: Any) -> None: ...

    # Optional: ``cause_field``, the name of the output field on which the subject reports why a
    # request failed (C-61's "and a message"). When given, the failed request's terminal output
    # must carry the planted fault's text there, and no other request's output may carry one.
    # Optional: ``stage_name(additional_config) -> str | None``, the name the subject's failure
    # causes give the stage that ``additional_config`` configures. When it names one, every
    # cause the gate reads (send-path faults, payload build faults) must name that stage and the
    # fault's type as well as its text: in a pipeline of stages, which stage failed a request,
    # and with what, is what its operator needs to read first.


# One value that crossed a process boundary: flattened to ``{field path: scalar or tensor}``.
Fields = Mapping[str, Any]


@dataclass(frozen=True)
class Crossing:
    """One object as its sender had it and as the receiver rebuilt it (C-46). ``label`` names it
    in a report (``chunk r3#2``, ``slot of r3``)."""

    label: str
    sent: Fields
    received: Fields


@runtime_checkable
class ProcessBoundary(Protocol):
    """A subject whose scheduler runs in a process of its own, and how the gate sees what
    crosses (C-46). The subject's ``admit`` sends requests across and its
    ``receive_outputs`` reads the step's outputs (and what rides on them) on the far side, as its
    runtime does; this capability reports what they saw.

    Flattened fields: every scalar (ids, seq, flags, reasons, positions) under its path, every
    tensor as itself; the gate requires the received fields to equal the sent ones, tensors
    bit for bit with the same dtype and shape.
    """

    def chunk_crossings(self, scheduler: Scheduler) -> Sequence[Crossing]:
        """The chunks the stage sent that crossed since the last call: as the stage handed
        them to its sink, and as the receiving side read them. A sent chunk the receiver did
        not read appears with empty ``received`` (and the other way round)."""

    def request_crossings(self, scheduler: Scheduler) -> Sequence[Crossing]:
        """The requests admitted since the last call: their stage-input slot (and prompt) as
        the caller built them, and as the scheduler's process attached them."""

    def leftovers(self, scheduler: Scheduler) -> Mapping[str, Any]:
        """What the crossing still holds (shared-memory segments, chunks written but not read,
        requests staged but not admitted), by kind. Between two operations of the harness
        every value must be empty: a step's outputs have been received, and an abort or
        finish leaves nothing of its request behind."""


@runtime_checkable
class ReceivingStage(Protocol):
    """A downstream stage whose scheduler parks a request until the upstream stage's chunks
    arrive (C-47): a state upstream vLLM has no counterpart for, so it is checked on the subject
    alone against upstream's own state machine (``invariants/test_receiving_stages.py``)."""

    @property
    def feature(self) -> Feature:
        """The configuration of a receiving stage."""

    # Optional: ``features``, a tuple of configurations when the subject has several kinds of
    # receiving stage (streamed chunks, a whole payload): C-47 runs on each in turn. Default:
    # ``(feature,)``.

    def arrive(self, scheduler: Scheduler, request_id: str, final: bool) -> None:
        """Script one chunk from the upstream stage for ``request_id`` (``final``: the last),
        through the stage's own connector, as the upstream stage would send it."""

    def parked(self, scheduler: Scheduler) -> Mapping[str, int]:
        """Each request waiting for a chunk, with how many times the receiving machinery keeps
        it outside the scheduler's queues (0: it waits in a queue)."""

    def held_for(self, scheduler: Scheduler, request_id: str) -> list[str]:
        """What the receiving machinery still keeps for ``request_id``, by name (empty once
        the request is gone)."""
