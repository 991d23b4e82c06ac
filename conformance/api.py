"""The gate's public API: everything a subject author imports, and the names the ``conformance``
package exported before this module existed (the lock-step session, ``run_trace``, ``replay``,
the loader, the registry and ``FieldDifference``), which its lazy names still resolve here.

A runtime's subject module imports from here only; ``conformance._core`` is the gate's private
core and may change between releases. What is here: the ``Subject`` protocol and
``BaseSubject`` (upstream's behaviour for every member), the capability vocabulary (declarations,
the protocols of hooks that run the subject's own code, the views the suite reads), differences
registry entries, the harness configuration and the builders a subject's schedulers and requests
use, the workload operations a difference witness runs, the suite's tight configuration, the
per-release version helper and the read of a scheduler's holdings. Importing this module imports
neither vLLM nor a runtime. How to write a subject: ``docs/adopting-the-gate.md``.
"""

from __future__ import annotations

from conformance._core.capabilities import (
    CAPABILITY_HOOKS,
    CheckNotRun,
    ChunkDelivery,
    ChunkView,
    Crossing,
    DeclaredAttributes,
    DifferenceWitness,
    FaultContainment,
    Feature,
    InputAdapterProbe,
    MaterializationProbe,
    ModelReference,
    NotApplicable,
    PayloadView,
    ProcessBoundary,
    ReceivingStage,
    RunnerProbes,
    SourceLayout,
    StageInputSpec,
    SubjectAreas,
)
from conformance._core.compare import FieldDifference
from conformance._core.config import (
    HarnessConfig,
    block_hasher,
    build_kv_cache_config,
    build_scheduler,
    build_vllm_config,
    request_block_hasher,
)
from conformance._core.differences import Difference, Registry
from conformance._core.lockstep import Lockstep, run_trace
from conformance._core.machine import TIGHT
from conformance._core.replay import replay
from conformance._core.subjects import (
    BaseSubject,
    DifferenceEntry,
    SchedulerHoldings,
    Subject,
    SubjectUnsupported,
    UpstreamSubject,
    image_features,
    load_subject,
    lora_request,
    make_sampling_params,
    prompt_embeddings,
    request_kwargs,
    scheduler_holdings,
)
from conformance._core.vllm_compat.versions import release
from conformance._core.workload import (
    Abort,
    AddRequest,
    ChunkArrives,
    DeliverChunks,
    ResetPrefixCache,
    Shutdown,
    Step,
    Trace,
)

__all__ = [
    # subjects
    "Subject",
    "BaseSubject",
    "UpstreamSubject",
    "SubjectUnsupported",
    "load_subject",
    "make_sampling_params",
    "prompt_embeddings",
    "request_kwargs",
    "image_features",
    "lora_request",
    "SchedulerHoldings",
    "scheduler_holdings",
    # capabilities
    "CAPABILITY_HOOKS",
    "NotApplicable",
    "CheckNotRun",
    "Feature",
    "DeclaredAttributes",
    "SourceLayout",
    "StageInputSpec",
    "SubjectAreas",
    "ChunkView",
    "PayloadView",
    "DifferenceWitness",
    "Crossing",
    "ChunkDelivery",
    "InputAdapterProbe",
    "RunnerProbes",
    "MaterializationProbe",
    "ModelReference",
    "FaultContainment",
    "ProcessBoundary",
    "ReceivingStage",
    # differences
    "Difference",
    "DifferenceEntry",
    "Registry",
    "FieldDifference",
    # configuration
    "HarnessConfig",
    "TIGHT",
    "build_scheduler",
    "build_vllm_config",
    "build_kv_cache_config",
    "block_hasher",
    "request_block_hasher",
    "release",
    # workloads
    "Trace",
    "AddRequest",
    "Step",
    "Abort",
    "ResetPrefixCache",
    "DeliverChunks",
    "ChunkArrives",
    "Shutdown",
    "Lockstep",
    "run_trace",
    "replay",
]
