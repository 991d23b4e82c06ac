"""omni-conformance: a differential, property-based harness that checks a vLLM-based runtime
(a *subject*) against upstream vLLM, step by step.

Modules, one concept each: ``config`` (harness configuration, scheduler construction),
``subjects`` (the ``Subject`` protocol and registry), ``capabilities`` (what a subject declares
beyond parity: attributes, chunk delivery, source layout, input adapter, runner probes, model
reference), ``pristine`` (noticing subjects that patch vLLM), ``oracle_process`` (upstream in
its own process for them), ``workload`` (operations and traces),
``tokens`` / ``token_worker`` (deterministic token source and engine worker), ``driver`` (sync and
batch-queue drivers), ``observe`` (snapshots), ``vllm_compat`` (every read of vLLM internals),
``compare`` / ``differences`` (first difference, registry tolerance), ``lockstep`` (sessions,
trace runs, shrinking), ``scenarios`` (a canonical scripted workload), ``machine`` (the hypothesis
state machine), ``replay``, ``report``, ``plugin`` (pytest) and ``cli``.

The package imports nothing heavy at import time (the pytest plugin loads in every pytest run);
the public names below resolve lazily.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "HarnessConfig": "conformance._core.config",
    "build_scheduler": "conformance._core.config",
    "Subject": "conformance._core.subjects",
    "BaseSubject": "conformance._core.subjects",
    "load_subject": "conformance._core.subjects",
    "Feature": "conformance._core.capabilities",
    "DeclaredAttributes": "conformance._core.capabilities",
    "SourceLayout": "conformance._core.capabilities",
    "StageInputSpec": "conformance._core.capabilities",
    "ChunkView": "conformance._core.capabilities",
    "PayloadView": "conformance._core.capabilities",
    "NotApplicable": "conformance._core.capabilities",
    "Trace": "conformance._core.workload",
    "AddRequest": "conformance._core.workload",
    "Step": "conformance._core.workload",
    "Abort": "conformance._core.workload",
    "ResetPrefixCache": "conformance._core.workload",
    "DeliverChunks": "conformance._core.workload",
    "Lockstep": "conformance._core.lockstep",
    "run_trace": "conformance._core.lockstep",
    "Registry": "conformance._core.differences",
    "FieldDifference": "conformance._core.compare",
    "replay": "conformance._core.replay",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'conformance' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
