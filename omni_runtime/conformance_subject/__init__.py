"""This runtime as a conformance subject: what the gate may check of it, and where to look.

The gate (``conformance`` + ``invariants``) never imports this package; it finds these subjects
through the ``omni_conformance.subjects`` entry point, exactly as it finds any other runtime's,
and this package imports nothing of the gate but ``conformance.api``:

* ``omni`` (``OmniSubject``): the omni schedulers, the real model runner over the generated
  thinker weights, and every capability the suite can check;
* ``omni-scheduler`` (``OmniSchedulerSubject``): the schedulers alone, with the harness's token
  source; the worker-level properties are not applicable to it;
* ``omni-process-stage`` (``ProcessStageSubject``): ``omni`` as its schedulers run inside a
  stage process, with the ``process_boundary`` capability (C-46).

One concern per module: ``stages``, ``witnesses``, ``delivery``, ``runner``, ``reference``,
``input_adapter``, ``subjects``, ``process_stage``. Guide: ``docs/adopting-the-gate.md``.
"""

from __future__ import annotations

from omni_runtime.conformance_subject.delivery import OmniChunkDelivery, payload_view
from omni_runtime.conformance_subject.input_adapter import OmniInputAdapterProbe
from omni_runtime.conformance_subject.process_stage import (
    WIRE_DIFFERENCE,
    ProcessStageBoundary,
    ProcessStageDelivery,
    ProcessStageSubject,
    StageProcessWire,
    chunk_fields,
    process_stage_subject,
    request_fields,
)
from omni_runtime.conformance_subject.reference import OmniModelReference, shared_model
from omni_runtime.conformance_subject.runner import (
    GRAPHS,
    DeferredPool,
    LazyFuture,
    OmniFaultContainment,
    OmniMaterializationProbe,
    OmniRunnerProbes,
)
from omni_runtime.conformance_subject.stages import (
    CODEC_CHUNK,
    CODEC_STREAMER,
    CODEC_VOCAB,
    HIDDEN_FORWARDER,
    MODEL_KEY,
    PACKAGE,
    POSTPROCESS_MODEL,
    STAGES,
    TOKEN_UPDATES,
    WORKER_FEATURES,
    stage_of,
    talker_stage,
    thinker_stage,
)
from omni_runtime.conformance_subject.subjects import (
    OmniSchedulerSubject,
    OmniSubject,
    omni_scheduler_subject,
    omni_subject,
)
from omni_runtime.conformance_subject.witnesses import FailMarkedRequests, difference_witnesses

__all__ = [
    "CODEC_CHUNK",
    "CODEC_STREAMER",
    "CODEC_VOCAB",
    "GRAPHS",
    "HIDDEN_FORWARDER",
    "MODEL_KEY",
    "PACKAGE",
    "POSTPROCESS_MODEL",
    "STAGES",
    "TOKEN_UPDATES",
    "WIRE_DIFFERENCE",
    "WORKER_FEATURES",
    "DeferredPool",
    "FailMarkedRequests",
    "LazyFuture",
    "OmniChunkDelivery",
    "OmniFaultContainment",
    "OmniInputAdapterProbe",
    "OmniMaterializationProbe",
    "OmniModelReference",
    "OmniRunnerProbes",
    "OmniSchedulerSubject",
    "OmniSubject",
    "ProcessStageBoundary",
    "ProcessStageDelivery",
    "ProcessStageSubject",
    "StageProcessWire",
    "chunk_fields",
    "difference_witnesses",
    "omni_scheduler_subject",
    "omni_subject",
    "payload_view",
    "process_stage_subject",
    "request_fields",
    "shared_model",
    "stage_of",
    "talker_stage",
    "thinker_stage",
]
