"""CPU worker and model runner for omni AR stages, plugged into vLLM's executor.

``worker``       — ``OmniARWorker`` (vLLM ``WorkerBase``): the engine-facing life cycle.
``runner``       — ``OmniARModelRunner``: request states, paged-KV forward, sampling, payloads.
``attention``    — paged KV storage, the hidden-row prefix cache, per-step attention.
``sampler``      — batch-independent greedy / seeded sampling.
``materialize``  — inline and background payload materialization.
``vllm_compat``  — every read of a private or release-dependent vLLM field.

This package never imports ``omni_runtime.engine``, ``omni_runtime.sched`` or vLLM engine code
(AR-INV-003; enforced by import-linter).
"""

from omni_runtime.worker.runner import OmniARModelRunner
from omni_runtime.worker.worker import OmniARWorker

__all__ = ["OmniARModelRunner", "OmniARWorker"]
