"""Process-wide pins for benchmark runs (same as ``tests/conftest.py``): offline hub, the V1
model-runner flavour, and our CPU platform for engines built in-process."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from omni_runtime.platform import install_for_process  # noqa: E402

install_for_process()
