"""The scheduler step's cost in instructions, counted by valgrind's callgrind.

Wall-clock step ratios on this shared 2-core machine move by 10-30 points between fresh pairs of
processes (``test_bench_scheduler.py``): one figure cannot show a 5% target met or missed.
Instruction counts do not move: the same program over the same requests executes the same
instructions, whichever process runs it and whatever else the machine does. They leave out what
instructions do not show (cache misses, branch mispredictions), so they complement the
wall-clock figure, they do not replace it.

How: one child per side runs this module under ``valgrind --tool=callgrind`` with
instrumentation off (``--instr-atstart=no``), so importing vLLM and torch and building the
scheduler run at valgrind's uninstrumented speed. The child then switches instrumentation on
with ``callgrind_control -i on`` (asked from a helper process while the child keeps running
Python, since callgrind answers only while its guest executes), and runs the counted steps
inside ``operator.call``, one call per step: ``--toggle-collect=_operator_call`` counts exactly
the instructions executed inside those calls (nothing in a scheduler step calls
``operator.call`` itself), and ``--dump-after=_operator_call`` writes each step's count to a file
of its own. The figure per side is the median step, as in the wall-clock benchmark (with chunk
transfer on, every 8th step also streams a codec chunk for every request, which the median
leaves out and the mean, reported beside it, does not).

Measured (16 counted steps after 16 warm-up steps; ``test_step_instructions_vs_upstream``):

    mode, running requests     upstream's median step     median ratio   mean ratio
    omni off, 64                   7,250,006 instructions       1.0003       1.0004
    omni off, 1,024              115,055,260 instructions       1.0003       1.0002
    chunk transfer, 64             7,253,716 instructions       1.0195       1.0916
    chunk transfer, 1,024        115,071,106 instructions       1.0179       1.0908

With chunk transfer on, an ordinary decode step costs the runtime ~2% over upstream's; the
steps that stream a codec chunk for every request (one in 8) cost ~60% more than upstream's
step (n=64: 11.8 and 13.2 million instructions against 7.25), which is the 9% of the mean.

Run as ``python benchmarks/step_instructions.py KIND N OMNI STEPS`` under valgrind (what
``count_step_instructions`` does); not collected by pytest.
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
