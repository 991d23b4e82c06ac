"""Process-wide pins for the test run: offline hub, V1 runner flavour, our CPU platform."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Two xdist workers on two cores: more than one torch thread each oversubscribes the machine and
# makes tiny ops ~100x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

from omni_runtime.platform import install_for_process  # noqa: E402

install_for_process()
