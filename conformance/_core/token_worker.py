"""``DeterministicTokenWorker``: a vLLM ``WorkerBase`` that samples the harness's token stream.

It lets vLLM's real ``EngineCore`` (uni executor, ``ParallelConfig(worker_cls=...)``) drive any
scheduler class with no model and no accelerator, so a subject's schedulers can be shown to plug
into the engine — sync ``step`` and async ``step_with_batch_queue`` — before a real worker exists.
It answers every call the engine makes of a worker (start-up: ``init_device``, ``load_model``,
``get_kv_cache_spec``, ``get_supported_kv_cache_layouts``, ``determine_available_memory``,
``initialize_from_config``, ``compile_or_warm_up_model``; per step: ``execute_model`` then
``sample_tokens``; ``shutdown``), and samples with ``conformance._core.tokens``, reading only the
``SchedulerOutput`` as any worker must.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from conformance._core import vllm_compat as vc
from conformance._core.tokens import DeterministicTokenSource

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from vllm.v1.outputs import ModelRunnerOutput

    from conformance._core.config import HarnessConfig

QUALNAME = "conformance._core.token_worker.DeterministicTokenWorker"


def start_worker(worker_cls: str | type, cfg: HarnessConfig) -> WorkerBase:
    """A worker of ``worker_cls``, started in the order vLLM's engine starts one.

    Used by the harness's worker mode, where the lock-step drivers call the worker directly
    (``execute_model`` / ``sample_tokens``) instead of through an executor.
    """
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from conformance._core.config import build_kv_cache_config, build_vllm_config

    cls = resolve_obj_by_qualname(worker_cls) if isinstance(worker_cls, str) else worker_cls
    vllm_config = build_vllm_config(cfg)
    worker = cls(
        vllm_config=vllm_config,
        local_rank=0,
        rank=0,
        distributed_init_method="tcp://127.0.0.1:0",
        is_driver_worker=True,
    )
    worker.init_device()
    worker.load_model()
    worker.get_kv_cache_spec()
    worker.initialize_from_config(build_kv_cache_config(cfg))
    worker.compile_or_warm_up_model()
    return worker


class DeterministicTokenWorker(WorkerBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # The uni executor also passes a lock for shared workers; this worker has nothing to share.
        kwargs.pop("shared_worker_lock", None)
        super().__init__(*args, **kwargs)
        hf = self.model_config.hf_config
        vocab = int(getattr(hf, "vocab_size", 512))
        # Sampling masks and routed experts too, when the engine's configuration asks for them.
        self.source = DeterministicTokenSource(
            vocab=vocab, aux=vc.aux_runner(self.vllm_config, vocab)
        )
        self._pending: SchedulerOutput | None = None
        self.kv_cache_config: KVCacheConfig | None = None

    def init_device(self) -> None:
        self.device = torch.device("cpu")

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        return None

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        hf = self.model_config.hf_config
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        spec = FullAttentionSpec(
            block_size=self.cache_config.block_size,
            num_kv_heads=hf.num_key_value_heads,
            head_size=head_dim,
            dtype=torch.float32,
        )
        return {f"model.layers.{i}.self_attn.attn": spec for i in range(hf.num_hidden_layers)}

    def get_supported_kv_cache_layouts(self) -> list[str]:
        # The base class asks the attention backends, which need a real platform; we have none.
        return ["LBNHC"]

    def determine_available_memory(self) -> int:
        specs = self.get_kv_cache_spec()
        per_block = sum(s.page_size_bytes for s in specs.values())
        # Enough for every sequence at max_model_len twice over; a block override then pins it.
        need = self.scheduler_config.max_num_seqs * (
            self.model_config.max_model_len // self.cache_config.block_size + 1
        )
        blocks = max(need * 2, self.cache_config.num_gpu_blocks_override or 0)
        return per_block * blocks

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.kv_cache_config = kv_cache_config

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        if scheduler_output.total_num_scheduled_tokens == 0:
            # An empty step still carries finished ids; it must return an output right away.
            return self.source.execute(scheduler_output)
        self._pending = scheduler_output
        return None

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        so, self._pending = self._pending, None
        assert so is not None, "sample_tokens without a pending execute_model"
        return self.source.execute(so)

    def get_cache_block_size_bytes(self) -> int:
        return sum(s.page_size_bytes for s in self.get_kv_cache_spec().values())

    def shutdown(self) -> None:
        self._pending = None
