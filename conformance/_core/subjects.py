"""Subjects: the runtimes the harness compares with upstream vLLM, and where they come from.

Owns the ``Subject`` protocol (every member the gate calls, the optional hooks and the
capability hooks included), ``BaseSubject`` (each member as upstream vLLM behaves, capabilities
None: not provided), the built-in ``upstream`` subject, ``make_sampling_params``,
``scheduler_holdings`` and the loader: a ``module:attr`` spec, then the entry-point group
``omni_conformance.subjects``, then the built-ins. Loading runs under the pristine guard
(``conformance._core.pristine``), since some runtimes patch vLLM when imported. The harness
imports no runtime. Adopters import all of this from ``conformance.api``; the hooks and what
each enables are in ``docs/adopting-the-gate.md``.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from conformance._core.capabilities import (
    ChunkDelivery,
    DeclaredAttributes,
    DifferenceWitness,
    FaultContainment,
    InputAdapterProbe,
    ModelReference,
    NotApplicable,
    ProcessBoundary,
    ReceivingStage,
    RunnerProbes,
    SourceLayout,
)
from conformance._core.config import (
    HarnessConfig,
    build_scheduler,
    request_block_hasher,
)
from conformance._core.vllm_compat import init_grammar
from conformance._core.vllm_compat.state import (
    block_pool,
    live_request_ids,
    num_free_blocks,
    scheduler_queues,
)
from conformance._core.workload import AddRequest

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.request import Request

ENTRY_POINT_GROUP = "omni_conformance.subjects"


class SubjectUnsupported(Exception):
    """The subject does not support this environment (for example the installed vLLM release).

    Raised by a subject's factory; the gate reports it as "unsupported" (``check`` exits 4),
    which is a fact about the subject's declared support, not a failure of the subject.
    """


@runtime_checkable
class DifferenceEntry(Protocol):
    """What the harness needs from one registry entry (``conformance._core.differences.Difference``)."""

    @property
    def id(self) -> str: ...
    @property
    def fields(self) -> tuple[str, ...]: ...
    @property
    def condition(self) -> str: ...
    @property
    def rationale(self) -> str: ...
    @property
    def tests(self) -> tuple[str, ...]: ...
    @property
    def clauses(self) -> tuple[str, ...]: ...
    # A plain attribute holding the condition (a frozen dataclass field, not a method).
    @property
    def applies(self) -> Callable[[Mapping[str, Any]], bool]: ...

    # Optional: ``planted_only`` (default False), for a difference that only a planted fault
    # makes: the audited lock-step programs, which plant none, then report every tolerance.


@runtime_checkable
class Subject(Protocol):
    """What the gate calls on a runtime. ``BaseSubject`` implements every member the way
    upstream vLLM behaves; the members after ``feature_configs`` are optional in that sense (a
    subclass overrides them only to change them), and the capability hooks return None for
    "not provided" (``conformance._core.capabilities``)."""

    name: str
    # The engine serves one client only (a stage process, whose one client is its parent): the
    # harness then sends it every request as client 0, where it otherwise draws some from a
    # second client, as several API server processes in front of one vLLM engine send them.
    single_engine_client: bool

    def scheduler_class(self, cfg: HarnessConfig) -> type: ...

    def build_scheduler(self, cfg: HarnessConfig) -> Scheduler: ...

    def differences(self) -> Sequence[DifferenceEntry]: ...

    def make_request(
        self,
        op: AddRequest,
        prompt: list[int],
        cfg: HarnessConfig,
        scheduler: Scheduler,
        arrival: float,
    ) -> Request: ...

    def request_facts(self, request: Request) -> dict[str, Any]: ...

    def scheduler_facts(self, scheduler: Scheduler) -> dict[str, dict[str, Any]]: ...

    def live_omni_ids(self, scheduler: Scheduler) -> set[str]: ...

    def drain_chunks(self, scheduler: Scheduler) -> list[Any]: ...

    def has_worker(self) -> bool: ...

    def make_worker(self, cfg: HarnessConfig) -> Any: ...

    def worker_config(self, cfg: HarnessConfig) -> HarnessConfig: ...

    def feature_configs(self) -> dict[str, dict[str, Any]]: ...

    def admit(self, scheduler: Scheduler, request: Request) -> None: ...

    def receive_outputs(
        self, scheduler: Scheduler, outputs: dict[int, EngineCoreOutputs] | None
    ) -> dict[int, EngineCoreOutputs] | None: ...

    def declared_attributes(self) -> DeclaredAttributes | None: ...

    def chunk_delivery(self) -> ChunkDelivery | None: ...

    def source_layout(self) -> SourceLayout | None: ...

    def input_adapter(self) -> InputAdapterProbe | None: ...

    def runner_probes(self) -> RunnerProbes | None: ...

    def model_reference(self) -> ModelReference | None: ...

    def difference_witnesses(self) -> Sequence[DifferenceWitness] | None: ...

    def fault_containment(self) -> FaultContainment | None: ...

    def process_boundary(self) -> ProcessBoundary | None: ...

    def receiving_stage(self) -> ReceivingStage | None: ...


# Every member of ``Subject``, in declaration order.
SUBJECT_MEMBERS: tuple[str, ...] = (
    *Subject.__annotations__,
    *(n for n, v in vars(Subject).items() if callable(v) and not n.startswith("_")),
)


def missing_members(obj: object) -> list[str]:
    """The ``Subject`` members ``obj`` lacks (none for a ``BaseSubject``)."""
    return [name for name in SUBJECT_MEMBERS if not hasattr(obj, name)]


def make_sampling_params(op: AddRequest, cfg: HarnessConfig) -> SamplingParams:
    """The sampling parameters upstream's engine gives ``op`` (greedy, its stop ids and
    length), with the model's generation config applied as the engine's input processor does."""
    from vllm.sampling_params import SamplingParams

    sp = SamplingParams(
        max_tokens=op.max_tokens,
        # Given here, so that vLLM's own check (at most max_tokens) applies as to a client's.
        min_tokens=op.min_tokens,
        stop_token_ids=list(op.stop_token_ids),
        ignore_eos=op.ignore_eos,
        temperature=0.0,
        # Given here: vLLM then skips reading the prefix cache for the request, as for a client's.
        prompt_logprobs=op.prompt_logprobs,
    )
    # What the engine's input processor does with the model's generation config.
    sp.update_from_generation_config({}, eos_token_id=cfg.model_shape().get("eos_token_id"))
    if op.kv_transfer_params is not None:
        # Where the engine's input processor puts a client's ``kv_transfer_params``.
        sp.extra_args = {**(sp.extra_args or {}), "kv_transfer_params": dict(op.kv_transfer_params)}
    if op.kv_cache_report_mode is not None:
        # Read from the same extra arguments when vLLM builds the request.
        sp.extra_args = {**(sp.extra_args or {}), "kv_cache_report_mode": op.kv_cache_report_mode}
    if op.skip_reading_prefix_cache:
        sp.skip_reading_prefix_cache = True
    if op.logprobs is not None:
        sp.logprobs = op.logprobs
    if op.repetition is not None:
        from vllm.sampling_params import RepetitionDetectionParams

        # Its own validation applies, as to a client's (min_count >= 2 once a size is set).
        sp.repetition_detection = RepetitionDetectionParams(*op.repetition)
    if op.grammar is not None:
        from conformance._core.grammars import constrain

        constrain(sp, op.grammar, cfg)  # as the input processor validates and hands it on
    return sp


def request_kwargs(
    op: AddRequest, prompt: list[int], cfg: HarnessConfig, arrival: float
) -> dict[str, Any]:
    """The keyword arguments of vLLM's ``Request`` for ``op``, as vLLM's engine builds it from
    the client's ``EngineCoreRequest``; a subject whose runtime builds a ``Request`` subclass
    passes them on beside its own fields. A subject's ``make_request`` must carry
    ``op.trace_headers`` and ``op.client_index`` into its request the way its engine does."""
    kwargs: dict[str, Any] = {
        "request_id": op.request_id,
        "prompt_token_ids": None if op.embeds else prompt,
        "sampling_params": None if cfg.runner == "pooling" else make_sampling_params(op, cfg),
        "pooling_params": pooling_params(cfg),
        "arrival_time": arrival,
        "block_hasher": request_block_hasher(cfg),
        "trace_headers": op.headers(),
        "client_index": op.client_index,
        "priority": op.priority,
    }
    if op.resumable:  # only then: releases before streaming sessions have no such argument
        kwargs["resumable"] = True
    if op.images:
        kwargs["mm_features"] = image_features(op, prompt, cfg.model_runner_v2)
    if op.lora:
        kwargs["lora_request"] = lora_request(op)
    if op.embeds:
        kwargs["prompt_embeds"] = prompt_embeddings(prompt, cfg)
    return kwargs


def prompt_embeddings(prompt: list[int], cfg: HarnessConfig) -> Any:
    """The embeddings a client sends in place of ``prompt`` (``AddRequest.embeds``): one row of
    the model's hidden size per token, a function of the token alone, so that equal prompts
    embed equally and share prefix-cache blocks (vLLM hashes each block's rows)."""
    import torch

    hidden = int(cfg.model_shape().get("hidden_size", 64))
    tokens = torch.tensor(prompt, dtype=torch.float32).unsqueeze(1)
    return torch.sin(tokens * torch.arange(1, hidden + 1, dtype=torch.float32) / hidden)


def pooling_params(cfg: HarnessConfig) -> Any:
    """A pooling model's requests' ``PoolingParams`` (an embedding each), verified against the
    model as vLLM's input processor does; None for a generating model."""
    if cfg.runner != "pooling":
        return None
    from vllm.pooling_params import PoolingParams

    params = PoolingParams(task="embed")
    params.verify(_pooling_model(cfg.model))
    return params


@functools.cache
def _pooling_model(model: str) -> Any:
    from vllm.config import ModelConfig

    return ModelConfig(model=model, runner="pooling", skip_tokenizer_init=True, dtype="float32")


def lora_request(op: AddRequest) -> Any:
    """The ``LoRARequest`` of ``op``'s adapter (None: it names none). The scheduler reads only
    its id and name; no adapter is loaded (the token source stands in for the model)."""
    if not op.lora:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"lora-{op.lora}", op.lora, f"omni-conformance://lora-{op.lora}")


def image_features(op: AddRequest, prompt: list[int], with_data: bool = False) -> list[Any]:
    """The multimodal features (``MultiModalFeatureSpec``) of ``op``'s images in ``prompt`` (the
    prompt ``Trace.prompt_of`` expanded them in), as vLLM's input processor makes them; empty
    for a request without images. ``with_data``: each carries its processed item
    (``multimodal.feature_specs``), as under ``HarnessConfig.model_runner_v2``."""
    from conformance._core.multimodal import feature_specs, placements

    return feature_specs(placements(len(op.prompt), op.images, len(prompt)), with_data)


@dataclass(frozen=True)
class SchedulerHoldings:
    """What an upstream-based scheduler holds, read through the gate's vLLM accessors (the
    reads its comparisons make, so they follow each vLLM release the gate supports)."""

    # Every request the scheduler holds, sorted.
    request_ids: tuple[str, ...]
    # The running and waiting queues, in queue order.
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    # Finished since the last ``schedule()``, not yet reported to the worker; sorted.
    finished_unsent: tuple[str, ...]
    free_blocks: int


def scheduler_holdings(scheduler: Scheduler) -> SchedulerHoldings:
    """``scheduler``'s requests, queues and free KV-cache blocks, as the gate reads them (for a
    subject that checks what its runtime reports about a scheduler against the scheduler)."""
    queues = scheduler_queues(scheduler)
    return SchedulerHoldings(
        request_ids=tuple(sorted(live_request_ids(scheduler))),
        running=tuple(queues["running"]),
        waiting=tuple(queues["waiting"]),
        finished_unsent=tuple(queues["finished_pending"]),
        free_blocks=num_free_blocks(block_pool(scheduler)),
    )


class BaseSubject:
    """Upstream behaviour for every hook; subclass and override what your runtime changes."""

    name = "base"
    sync_scheduler: str | type = "vllm.v1.core.sched.scheduler.Scheduler"
    async_scheduler: str | type = "vllm.v1.core.sched.async_scheduler.AsyncScheduler"
    # A vLLM WorkerBase subclass (qualname or class) for the harness's real-worker mode.
    worker_cls: str | type | None = None
    # The subject's engine serves one client only (see ``Subject``).
    single_engine_client = False

    def scheduler_class(self, cfg: HarnessConfig) -> type:
        spec = self.async_scheduler if cfg.async_scheduling else self.sync_scheduler
        return _resolve(spec) if isinstance(spec, str) else spec

    # Any, not ``Scheduler``: a subclass reads its own scheduler class's attributes off this.
    def build_scheduler(self, cfg: HarnessConfig) -> Any:
        return build_scheduler(self.scheduler_class(cfg), cfg)

    def differences(self) -> Sequence[DifferenceEntry]:
        return ()

    def make_request(
        self,
        op: AddRequest,
        prompt: list[int],
        cfg: HarnessConfig,
        scheduler: Scheduler,
        arrival: float,
    ) -> Request:
        from vllm.v1.request import Request

        return Request(**request_kwargs(op, prompt, cfg, arrival))

    def admit(self, scheduler: Scheduler, request: Request) -> None:
        """Hand ``request`` (from ``make_request``) to ``scheduler`` as the runtime's engine does.

        The harness admits every request through here. Upstream's engine starts a structured
        request's grammar compiling (``EngineCore.preprocess_add_request``), then calls
        ``add_request``; a runtime with staged admission (requests cross to another process,
        then are released into the queue together) does here what its engine does, so that the
        request is in the scheduler's queue when this returns, as upstream's would be.
        """
        init_grammar(scheduler, request)
        scheduler.add_request(request)

    def receive_outputs(
        self, scheduler: Scheduler, outputs: dict[int, EngineCoreOutputs] | None
    ) -> dict[int, EngineCoreOutputs] | None:
        """A step's outputs (``update_from_output``'s result) as the engine's caller receives
        them; the harness compares and reads what this returns. Upstream's caller gets the
        objects themselves; a runtime whose outputs cross a process boundary returns them as
        decoded on the other side (and may read what rides on them, e.g. chunks)."""
        return outputs

    def request_facts(self, request: Request) -> dict[str, Any]:
        return {}

    def scheduler_facts(self, scheduler: Scheduler) -> dict[str, dict[str, Any]]:
        """Per-request facts that arise later than ``add`` (merged after every operation)."""
        return {}

    def live_omni_ids(self, scheduler: Scheduler) -> set[str]:
        return set()

    def drain_chunks(self, scheduler: Scheduler) -> list[Any]:
        return []

    def has_worker(self) -> bool:
        return self.worker_cls is not None

    def worker_config(self, cfg: HarnessConfig) -> HarnessConfig:
        """The config to use in worker mode (e.g. pointing ``model`` at real weights)."""
        return cfg

    def make_worker(self, cfg: HarnessConfig) -> Any:
        """A started worker (optional hook); the default starts ``worker_cls`` as EngineCore does."""
        if self.worker_cls is None:
            # A capability the subject does not declare: the test asking is not applicable.
            raise NotApplicable(f"subject {self.name!r} provides no real worker")
        from conformance._core.token_worker import start_worker

        return start_worker(self.worker_cls, cfg)

    def feature_configs(self) -> dict[str, dict[str, Any]]:
        """Named subject features to run the suite with, besides "off" (no extra config).

        Each value has ``additional_config`` (merged into ``HarnessConfig.additional_config``)
        and optionally ``final_stages`` (values the workload may use for
        ``AddRequest.final_stage``) and ``use_worker`` (run the subject's real worker).
        """
        return {}

    # ---- capabilities (``conformance._core.capabilities``); None: not provided --------------------

    def declared_attributes(self) -> DeclaredAttributes | None:
        """What the runtime adds to upstream's Request and scheduler (C-10..C-12)."""
        return None

    def chunk_delivery(self) -> ChunkDelivery | None:
        """How the scheduler hands work downstream (C-21, C-40..C-45)."""
        return None

    def source_layout(self) -> SourceLayout | None:
        """Where worker and payload code lives, for the static and stack audits."""
        return None

    def input_adapter(self) -> InputAdapterProbe | None:
        """The stage-input adapter, for malformed-input properties (C-13)."""
        return None

    def runner_probes(self) -> RunnerProbes | None:
        """Handles on the real model runner's payloads and materialization (C-22, C-30..C-55)."""
        return None

    def model_reference(self) -> ModelReference | None:
        """An independent implementation of the worker's model (C-08, hidden-row checks)."""
        return None

    def difference_witnesses(self) -> Sequence[DifferenceWitness] | None:
        """For each entry of ``differences()``, a workload that makes it happen (C-03)."""
        return None

    def fault_containment(self) -> FaultContainment | None:
        """Whether the worker keeps a model fault to the requests it concerns (C-61)."""
        return None

    def process_boundary(self) -> ProcessBoundary | None:
        """What crosses between the scheduler's process and its caller's, as sent and as
        received, and what the crossing still holds (C-46)."""
        return None

    def receiving_stage(self) -> ReceivingStage | None:
        """A stage that parks requests until chunks arrive, checked on its own (C-47)."""
        return None

    def __repr__(self) -> str:
        return f"<subject {self.name}>"


class UpstreamSubject(BaseSubject):
    """vLLM's own schedulers: the oracle, and a subject that must always pass."""

    name = "upstream"

    def declared_attributes(self) -> DeclaredAttributes:
        # Upstream adds nothing to upstream: the attribute audit runs, and must find nothing.
        return DeclaredAttributes()


def upstream_subject() -> Subject:
    return UpstreamSubject()


BUILTINS: dict[str, Callable[[], Subject]] = {"upstream": upstream_subject}


def ensure_cwd_importable() -> None:
    """``module:attr`` specs name modules of the project being checked, relative to its root;
    console scripts do not put the working directory on ``sys.path``, so add it (last)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def _resolve(spec: str) -> Any:
    """``pkg.mod:attr`` or ``pkg.mod.attr``."""
    ensure_cwd_importable()
    if ":" in spec:
        mod, _, attr = spec.partition(":")
    else:
        mod, _, attr = spec.rpartition(".")
    obj: Any = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _instantiate(obj: Any, label: str) -> Subject:
    if isinstance(obj, type):
        obj = obj()
    elif callable(obj) and not isinstance(obj, Subject):
        obj = obj()
    if not isinstance(obj, Subject):
        raise TypeError(
            f"subject {label!r}: {obj!r} does not implement conformance.api.Subject (missing "
            f"{', '.join(missing_members(obj))}; subclass conformance.api.BaseSubject, which "
            "implements every member as upstream vLLM behaves)"
        )
    return obj


def available_subjects() -> dict[str, str]:
    """Name -> where it comes from (entry points override nothing: built-ins are fixed)."""
    out = {name: "built-in" for name in BUILTINS}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        out.setdefault(ep.name, f"entry point {ep.value}")
    return out


def load_subject(spec: str | Subject) -> Subject:
    """The subject ``spec`` names, loaded under the pristine guard: when loading it changed
    vLLM's own classes, the change is recorded for this process, and every lock-step session
    from then on runs upstream vLLM in a separate process (``conformance._core.pristine``)."""
    if not isinstance(spec, str):
        return spec
    from conformance._core.pristine import guard_load

    with guard_load(spec, refuse=False):
        return _load(spec)


def _load(spec: str) -> Subject:
    if ":" in spec:
        return _instantiate(_resolve(spec), spec)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == spec:
            return _instantiate(ep.load(), spec)
    if spec in BUILTINS:
        return BUILTINS[spec]()
    raise LookupError(
        f"unknown subject {spec!r}; known: {sorted(available_subjects())} or a module:attr spec"
    )
