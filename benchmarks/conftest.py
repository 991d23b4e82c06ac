"""Process-wide pins for benchmark runs (same as ``tests/conftest.py``): offline hub, the V1
model-runner flavour, and our CPU platform for engines built in-process."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from omni_runtime.platform import install_for_process  # noqa: E402

install_for_process()

# One intra-op thread unless told otherwise: the stage models are tiny and the benchmark host
# has 2 shared cores, where OpenMP spin-waits of a second thread dominate small kernels.
torch.set_num_threads(int(os.environ.get("OMNI_BENCH_TORCH_THREADS", "1")))
