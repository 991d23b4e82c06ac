"""``OmniARWorker``: the vLLM ``WorkerBase`` that vLLM's executor drives on a CPU-only host.

The worker owns the life cycle vLLM's ``EngineCore`` + uni executor impose (in call order):
``init_device``, ``load_model``, ``get_kv_cache_spec``, ``get_supported_kv_cache_layouts``,
``set_kv_cache_layout``, ``determine_available_memory``, ``initialize_from_config``,
``compile_or_warm_up_model``, then per step ``execute_model`` and ``sample_tokens``, and finally
``shutdown``; plus the auxiliary RPCs the engine or ``vllm.LLM`` may issue
(``get_supported_tasks``, ``take_draft_token_ids``, cache resets, ``update_max_model_len``,
``get_model``). All model work is delegated to ``OmniARModelRunner``.

Select it with ``ParallelConfig(worker_cls="omni_runtime.worker.OmniARWorker")``; our CPU
platform makes it the default for ``worker_cls="auto"``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.v1.worker.worker_base import WorkerBase

from omni_runtime.models import LlamaLM, load_model
from omni_runtime.worker import vllm_compat as compat
from omni_runtime.worker.runner import OmniARModelRunner

logger = logging.getLogger(__name__)

# Default KV cache budget when neither ``kv_cache_memory_bytes`` nor a block override is set:
# room for every sequence at full length, capped so a CPU host is not asked for gigabytes.
DEFAULT_KV_CACHE_CAP_BYTES = 512 * 1024 * 1024
# Intra-op torch threads for the worker process (unset: torch's default is left alone).
TORCH_THREADS_ENV = "OMNI_RUNTIME_TORCH_THREADS"


class OmniARWorker(WorkerBase):
    """See the module docstring."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        local_rank: int = 0,
        rank: int = 0,
        distributed_init_method: str = "",
        is_driver_worker: bool = True,
        **_: Any,
    ) -> None:
        super().__init__(
            vllm_config=vllm_config,
            local_rank=local_rank,
            rank=rank,
            distributed_init_method=distributed_init_method,
            is_driver_worker=is_driver_worker,
        )
        self.model_runner: OmniARModelRunner | None = None  # type: ignore[assignment]

    # ---- start-up -------------------------------------------------------------------------

    def init_device(self) -> None:
        self.device = torch.device("cpu")
        # Small stage models run fastest single-threaded, and on a shared host OpenMP spin-waits
        # of several intra-op threads cost far more than they save; the operator decides.
        threads = os.environ.get(TORCH_THREADS_ENV)
        if threads:
            torch.set_num_threads(int(threads))

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        dtype = self.model_config.dtype
        # ModelConfig resolves "auto"/"float32" to a torch.dtype; the guard is for mypy's view.
        if not isinstance(dtype, torch.dtype):
            dtype = torch.float32
        model = load_model(self.model_config.model, device=self.device or "cpu", dtype=dtype)
        if not isinstance(model, LlamaLM):
            raise TypeError(
                f"{self.model_config.model}: OmniARWorker runs decoder-only LMs, "
                f"got {type(model).__name__}"
            )
        self.model_runner = OmniARModelRunner(self.vllm_config, model, self.device)

    @property
    def runner(self) -> OmniARModelRunner:
        if self.model_runner is None:
            raise RuntimeError("load_model has not run")
        return self.model_runner

    def get_model(self) -> torch.nn.Module:
        return self.runner.model

    def get_kv_cache_spec(self) -> dict[str, Any]:
        return self.runner.get_kv_cache_spec()

    def get_supported_kv_cache_layouts(self) -> list[str]:
        # Our runner's own paged attention, not vLLM's backends, decides the layout.
        return list(compat.KV_CACHE_LAYOUTS)

    def determine_available_memory(self) -> int:
        """Bytes vLLM may turn into KV blocks.

        ``cache_config.kv_cache_memory_bytes`` wins when set. Otherwise: enough for
        ``max_num_seqs`` full-length sequences, capped at ``DEFAULT_KV_CACHE_CAP_BYTES`` and
        never below one full-length sequence plus a block (vLLM refuses a cache that cannot
        hold ``max_model_len``). The hidden-row cache of C-55, when enabled, is allocated on
        top of this budget (``hidden_size`` floats per slot).
        """
        explicit = getattr(self.cache_config, "kv_cache_memory_bytes", None)
        if explicit:
            return int(explicit)
        per_token = self.runner.kv_bytes_per_token()
        max_len = int(self.model_config.max_model_len)
        block = int(self.cache_config.block_size or 16)
        wanted = int(self.scheduler_config.max_num_seqs) * max_len * per_token
        floor = (max_len + block) * per_token
        return max(floor, min(wanted, DEFAULT_KV_CACHE_CAP_BYTES))

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        self.runner.initialize_kv_cache(kv_cache_config)

    def compile_or_warm_up_model(self) -> Any:
        return compat.compilation_times()

    def get_cache_block_size_bytes(self) -> int:
        return self.runner.kv_bytes_per_token() * int(self.cache_config.block_size or 16)

    def update_max_model_len(self, max_model_len: int) -> None:
        self.model_config.max_model_len = max_model_len

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    # ---- steps ----------------------------------------------------------------------------

    def execute_model(self, scheduler_output: Any) -> Any:
        return self.runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: Any = None) -> Any:
        return self.runner.sample_tokens(grammar_output)

    def take_draft_token_ids(self) -> None:
        return None

    def execute_dummy_batch(self) -> None:
        return None

    # ---- caches, adapters, teardown -------------------------------------------------------

    def reset_mm_cache(self) -> None:
        return None

    def reset_encoder_cache(self) -> None:
        return None

    def add_lora(self, lora_request: Any) -> bool:
        # A refusal, not a gap: the stage models have no adapters to apply one to.
        name = getattr(lora_request, "lora_name", lora_request)
        raise ValueError(f"lora_request {name!r}: OmniARWorker serves no LoRA adapters")

    def remove_lora(self, lora_id: int) -> bool:
        return False

    def pin_lora(self, lora_id: int) -> bool:
        return False

    def list_loras(self) -> set[int]:
        return set()

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        if self.model_runner is not None:
            self.model_runner.shutdown()
