"""The out-of-tree vLLM platform that lets vLLM's engine run on a machine with no accelerator.

vLLM 0.33's CUDA wheel resolves to ``UnspecifiedPlatform`` on a CPU-only host, where
``VllmConfig()`` cannot infer a device and ``vllm.LLM`` refuses to start. vLLM's own
``CpuPlatform`` (``VLLM_TARGET_DEVICE=cpu``) works but forces sync scheduling and the
multiprocess executor, which hides exactly the async code paths this project must exercise.
This platform keeps the uni executor and async scheduling, and registers only when no built-in
accelerator platform would activate, so on a GPU host it changes nothing.

Registered through the ``vllm.platform_plugins`` entry-point group (see ``pyproject.toml``).
Set ``OMNI_RUNTIME_PLATFORM=0`` to switch it off.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch
from vllm.platforms.interface import Platform, PlatformEnum

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

PLATFORM_QUALNAME = "omni_runtime.platform.OmniCpuPlatform"
DEFAULT_WORKER = "omni_runtime.worker.OmniARWorker"

# Built-in probes that mean "a real accelerator is here": our plugin must then stay out of the way.
_ACCELERATOR_PROBES = ("cuda", "rocm", "xpu", "tpu")


def _accelerator_present() -> bool:
    from vllm import platforms

    for name in _ACCELERATOR_PROBES:
        probe = platforms.builtin_platform_plugins.get(name)
        if probe is None:
            continue
        try:
            if probe() is not None:
                return True
        except Exception:  # a failing probe means that accelerator is not usable here
            logger.debug("platform probe %s failed", name, exc_info=True)
    return False


def register() -> str | None:
    """Entry point for ``vllm.platform_plugins``: our platform's qualname, or None to abstain."""
    if os.environ.get("OMNI_RUNTIME_PLATFORM", "1").lower() in ("0", "false", "off", "no"):
        return None
    if _accelerator_present():
        return None
    return PLATFORM_QUALNAME


class OmniCpuPlatform(Platform):
    """A CPU device for vLLM's v1 engine that keeps the uni executor and async scheduling."""

    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"
    simple_compile_backend = "eager"

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "cpu"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        import psutil

        return int(psutil.virtual_memory().total)

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        # One CPU device: nothing to select.
        return None

    @classmethod
    def get_current_memory_usage(cls, device: torch.types.Device | None = None) -> float:
        import psutil

        return float(psutil.Process().memory_info().rss)

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        parallel = vllm_config.parallel_config
        if parallel.worker_cls == "auto":
            parallel.worker_cls = DEFAULT_WORKER
        if parallel.distributed_executor_backend in (None, "auto"):
            parallel.distributed_executor_backend = "uni"
        compilation = vllm_config.compilation_config
        # Our runner executes eagerly on CPU: no CUDA graphs, no torch.compile of vLLM models.
        try:
            from vllm.config import CompilationMode, CUDAGraphMode

            compilation.mode = CompilationMode.NONE
            compilation.cudagraph_mode = CUDAGraphMode.NONE
        except ImportError:  # names moved between releases; defaults are then left alone
            pass
        cache = vllm_config.cache_config
        if cache.block_size is None:
            cache.block_size = 16

    @classmethod
    def get_attn_backend_cls(cls, *args, **kwargs) -> str:
        # Our runner implements its own paged attention; vLLM's backends are not used.
        return "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"


def install_for_process() -> None:
    """Make this platform current in this process even when the entry point is not installed.

    Tests and tools run from a source tree call this before anything reads
    ``vllm.platforms.current_platform``; it does nothing when another platform already won.
    """
    from vllm import platforms

    if platforms._current_platform is None and register() is not None:
        platforms._current_platform = OmniCpuPlatform()  # type: ignore[assignment]
