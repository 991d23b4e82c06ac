"""The CPU platform plugin: vLLM's config and engine work with no GPU; a GPU host is untouched."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from omni_runtime import platform as plat

PROBE = """
import json
from vllm.platforms import current_platform
from vllm.config import VllmConfig
c = VllmConfig()
print(json.dumps({"platform": type(current_platform).__name__, "device": str(c.device_config.device),
                  "async": c.scheduler_config.async_scheduling,
                  "worker": c.parallel_config.worker_cls,
                  "executor": c.parallel_config.distributed_executor_backend}))
"""


def _probe(env_extra: dict[str, str]) -> dict:
    env = {**os.environ, **env_extra}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=180
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_entry_point_makes_default_vllm_config_work_on_cpu():
    got = _probe({})
    assert got == {
        "platform": "OmniCpuPlatform",
        "device": "cpu",
        "async": True,
        "worker": "omni_runtime.worker.OmniARWorker",
        "executor": "uni",
    }


def test_switch_off_leaves_vllm_alone():
    env = {"OMNI_RUNTIME_PLATFORM": "0"}
    PROBE_PLATFORM = (
        "from vllm.platforms import current_platform; print(type(current_platform).__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", PROBE_PLATFORM],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=180,
    )
    assert out.stdout.strip().splitlines()[-1] == "UnspecifiedPlatform"


def test_abstains_when_an_accelerator_is_present(monkeypatch):
    from vllm import platforms

    monkeypatch.setitem(
        platforms.builtin_platform_plugins, "cuda", lambda: "vllm.platforms.cuda.CudaPlatform"
    )
    assert plat.register() is None
    monkeypatch.setitem(platforms.builtin_platform_plugins, "cuda", lambda: None)
    assert plat.register() == plat.PLATFORM_QUALNAME


@pytest.mark.parametrize("probe", ["rocm", "xpu", "tpu"])
def test_abstains_for_every_accelerator_probe(monkeypatch, probe):
    from vllm import platforms

    monkeypatch.setitem(platforms.builtin_platform_plugins, probe, lambda: "x.Y")
    assert plat.register() is None
