"""The vLLM releases this runtime supports, and the one-line refusal of any other.

The runtime subclasses vLLM's scheduler and worker and reads engine internals whose layout
changes between minors, so it runs only on releases it was built and tested against. The
platform plugin (``omni_runtime.platform``) is exempt: its surface is stable across vLLM
0.28-0.33 and the conformance harness relies on it on every release it supports.
"""

from __future__ import annotations

from functools import cache

SUPPORTED_VLLM: tuple[str, ...] = ("0.33.0",)


class UnsupportedVllm(RuntimeError):
    """The installed vLLM is not one this runtime supports (the message is one line)."""


@cache
def check_vllm() -> str:
    """The installed vLLM version, or ``UnsupportedVllm`` naming it and the supported ones."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("vllm")
    except PackageNotFoundError:
        raise UnsupportedVllm(
            f"vLLM is not installed; omni_runtime supports vLLM {', '.join(SUPPORTED_VLLM)}"
        ) from None
    minor = tuple(installed.split("+")[0].split(".")[:2])
    if minor not in {tuple(v.split(".")[:2]) for v in SUPPORTED_VLLM}:
        raise UnsupportedVllm(
            f"omni_runtime supports vLLM {', '.join(SUPPORTED_VLLM)}; vLLM {installed} is installed"
        )
    return installed
