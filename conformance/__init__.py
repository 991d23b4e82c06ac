"""omni-conformance: a differential, property-based harness that checks a vLLM-based runtime
(a *subject*) against upstream vLLM, step by step.

The public API is ``conformance.api`` (what a subject author imports); the names it lists are
also reachable here, resolved lazily, because the package itself must import nothing heavy (the
pytest plugin, ``conformance.plugin``, loads in every pytest run). The gate's core lives under
``conformance._core`` (private), its release tooling under ``conformance.release``, the command
line in ``conformance.cli``; ``docs/design.md`` says how they fit together.
"""

from __future__ import annotations

import importlib
from typing import Any

_API = "conformance.api"
# The public names, as ``conformance.api.__all__`` lists them (a test keeps the two equal;
# reading that list here would import the API eagerly), less ``release``: here that name is the
# release tooling's subpackage (``conformance.release``), so the version helper is reached as
# ``conformance.api.release`` only.
__all__ = sorted(
    [
        "Abort",
        "AddRequest",
        "BaseSubject",
        "CAPABILITY_HOOKS",
        "CheckNotRun",
        "ChunkArrives",
        "ChunkDelivery",
        "ChunkView",
        "Crossing",
        "DeclaredAttributes",
        "DeliverChunks",
        "Difference",
        "DifferenceEntry",
        "DifferenceWitness",
        "FaultContainment",
        "Feature",
        "FieldDifference",
        "HarnessConfig",
        "InputAdapterProbe",
        "Lockstep",
        "MaterializationProbe",
        "ModelReference",
        "NotApplicable",
        "PayloadView",
        "ProcessBoundary",
        "ReceivingStage",
        "Registry",
        "ResetPrefixCache",
        "RunnerProbes",
        "SchedulerHoldings",
        "Shutdown",
        "SourceLayout",
        "StageInputSpec",
        "Step",
        "Subject",
        "SubjectAreas",
        "SubjectUnsupported",
        "TIGHT",
        "Trace",
        "UpstreamSubject",
        "block_hasher",
        "build_kv_cache_config",
        "build_scheduler",
        "build_vllm_config",
        "request_block_hasher",
        "image_features",
        "load_subject",
        "lora_request",
        "make_sampling_params",
        "prompt_embeddings",
        "replay",
        "request_kwargs",
        "run_trace",
        "scheduler_holdings",
    ]
)


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'conformance' has no attribute {name!r}")
    return getattr(importlib.import_module(_API), name)
