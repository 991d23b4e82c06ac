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
    "HarnessConfig": "conformance.config",
    "build_scheduler": "conformance.config",
    "Subject": "conformance.subjects",
    "BaseSubject": "conformance.subjects",
    "load_subject": "conformance.subjects",
    "Feature": "conformance.capabilities",
    "DeclaredAttributes": "conformance.capabilities",
    "SourceLayout": "conformance.capabilities",
    "StageInputSpec": "conformance.capabilities",
    "ChunkView": "conformance.capabilities",
    "PayloadView": "conformance.capabilities",
    "NotApplicable": "conformance.capabilities",
    "Trace": "conformance.workload",
    "AddRequest": "conformance.workload",
    "Step": "conformance.workload",
    "Abort": "conformance.workload",
    "ResetPrefixCache": "conformance.workload",
    "DeliverChunks": "conformance.workload",
    "Lockstep": "conformance.lockstep",
    "run_trace": "conformance.lockstep",
    "Registry": "conformance.differences",
    "FieldDifference": "conformance.compare",
    "replay": "conformance.replay",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'conformance' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
