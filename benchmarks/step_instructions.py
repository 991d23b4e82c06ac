"""The scheduler step's cost in instructions, counted by valgrind's callgrind.

Instruction counts do not move between runs the way wall-clock ratios on a shared machine do,
so they complement ``test_bench_scheduler.py``. One child per side runs this module under
``valgrind --tool=callgrind`` with instrumentation off until set-up is done, then counts each
step inside ``operator.call`` (``--toggle-collect`` / ``--dump-after=_operator_call``), one
count per step; the figure per side is the median step, with the mean beside it.

Run as ``python benchmarks/step_instructions.py KIND N OMNI STEPS`` under valgrind (what
``count_step_instructions`` does); not collected by pytest. The method in full and the measured
counts: docs/design.md, "How the benchmarks measure".
"""

from __future__ import annotations

import operator
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Steps run before counting, so both sides count steady decode steps with warm caches (every
# 8th step streams a codec chunk with chunk transfer on: the counted steps span whole periods).
WARMUP = 16
COUNTED = 16


def _switch_instrumentation_on() -> None:
    """Ask callgrind to instrument from now on; spin (running guest code) until it has."""
    helper = subprocess.Popen(
        ["callgrind_control", "--instr=on", str(os.getpid())],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 600
    spin = 0
    while helper.poll() is None:
        spin += 1  # guest code: callgrind checks for commands between basic blocks
        if time.monotonic() > deadline:
            helper.kill()
            raise RuntimeError("callgrind_control did not answer")
    if helper.returncode != 0:
        raise RuntimeError(f"callgrind_control exited {helper.returncode}")


def _child(kind: str, n: int, omni: bool, steps: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sched_step_child import SCHEDULERS, _ready, _step

    sched = _ready(SCHEDULERS[kind], n, omni)
    for _ in range(WARMUP):
        _step(sched)
    _switch_instrumentation_on()

    for _ in range(steps):
        operator.call(_step, sched)


def count_step_instructions(kind: str, n: int, omni: bool, steps: int = COUNTED) -> list[int]:
    """Instructions (callgrind's ``Ir``) of each of ``steps`` scheduler steps of ``kind`` with
    ``n`` running requests, after ``WARMUP`` steps."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise FileNotFoundError("valgrind with callgrind is not installed")
    with tempfile.TemporaryDirectory(prefix="step-ir-") as tmp:
        out = Path(tmp) / "callgrind.out"
        cmd = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            "--collect-atstart=no",
            "--toggle-collect=_operator_call",
            "--dump-after=_operator_call",
            f"--callgrind-out-file={out}",
            sys.executable,
            __file__,
            kind,
            str(n),
            str(int(omni)),
            str(steps),
        ]
        env = dict(os.environ, PYTHONHASHSEED="0", HF_HUB_OFFLINE="1")
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{kind} n={n}: valgrind exited {done.returncode}:\n{done.stderr}")
        # One file per dump (``<out>.<n>``), then the final one with what followed the last step.
        dumps = sorted(
            Path(tmp).glob("callgrind.out.*"), key=lambda p: int(p.name.rsplit(".", 1)[1])
        )
        counts = [_total_ir(p.read_text()) for p in dumps]
        if len(counts) != steps:
            raise RuntimeError(f"{kind} n={n}: {len(counts)} step dumps for {steps} steps")
        return counts


def _total_ir(profile: str) -> int:
    match = re.search(r"^(?:summary|totals):\s+(\d+)", profile, re.MULTILINE)
    if match is None:
        raise RuntimeError("callgrind wrote no instruction total")
    return int(match.group(1))


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]), bool(int(sys.argv[3])), int(sys.argv[4]))
