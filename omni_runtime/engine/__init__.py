"""The multi-stage engine: stage engines on vLLM's ``EngineCore``, connectors, orchestrator.

``graph``          — the stage graph file (default ``omni_runtime/configs/default_pipeline.json``).
``config``         — ``EngineOptions`` and the one builder of a runtime ``VllmConfig``.
``stage``          — ``StageEngine``: one ``EngineCore`` per AR stage.
``mp_stage``       — ``MPStageEngine``: an AR stage's ``EngineCore`` in its own process.
``backends``       — ``make_stage_engine``: the stage engine ``EngineOptions.backend`` names.
``code2wav_stage`` — ``Code2WavStage``: streamed codec chunks to audio.
``vllm_compat``    — the engine's single seam to vLLM internals.
``connectors``     — in-process and cross-process (pipe) chunk connectors.
``orchestrator``   — routing between stages, request tracking, abort and fault outcomes.
``pipeline``       — ``OmniPipeline``, the Python API (``generate``, ``stream``).

Names are imported lazily so that a connector's spawned relay process (which imports
``omni_runtime.engine._relay``) does not pay for torch and vLLM.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "OmniPipeline": "omni_runtime.engine.pipeline",
    "Orchestrator": "omni_runtime.engine.orchestrator",
    "PipelineEvent": "omni_runtime.engine.orchestrator",
    "RequestResult": "omni_runtime.engine.orchestrator",
    "StageEngine": "omni_runtime.engine.stage",
    "MPStageEngine": "omni_runtime.engine.mp_stage",
    "make_stage_engine": "omni_runtime.engine.backends",
    "Code2WavStage": "omni_runtime.engine.code2wav_stage",
    "EngineOptions": "omni_runtime.engine.config",
    "InProcessConnector": "omni_runtime.engine.connectors",
    "PipeConnector": "omni_runtime.engine.connectors",
    "PipelineConfig": "omni_runtime.engine.graph",
    "load_pipeline_config": "omni_runtime.engine.graph",
}

__all__ = [
    "Code2WavStage",
    "EngineOptions",
    "InProcessConnector",
    "MPStageEngine",
    "OmniPipeline",
    "Orchestrator",
    "PipeConnector",
    "PipelineConfig",
    "PipelineEvent",
    "RequestResult",
    "StageEngine",
    "load_pipeline_config",
    "make_stage_engine",
]

if TYPE_CHECKING:
    from omni_runtime.engine.backends import make_stage_engine
    from omni_runtime.engine.code2wav_stage import Code2WavStage
    from omni_runtime.engine.config import EngineOptions
    from omni_runtime.engine.connectors import InProcessConnector, PipeConnector
    from omni_runtime.engine.graph import PipelineConfig, load_pipeline_config
    from omni_runtime.engine.mp_stage import MPStageEngine
    from omni_runtime.engine.orchestrator import Orchestrator, PipelineEvent, RequestResult
    from omni_runtime.engine.pipeline import OmniPipeline
    from omni_runtime.engine.stage import StageEngine


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'omni_runtime.engine' has no attribute {name!r}")
    return getattr(import_module(module), name)
