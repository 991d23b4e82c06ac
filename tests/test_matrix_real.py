"""One real cell on a second vLLM release: ``pytest -m vllm_matrix`` (not in the default run).

Builds (or reuses) the environment for vLLM 0.30.0 under ``$OMNI_CONFORMANCE_ENVS`` (uv when
available; ~1.5 min and ~9 GB the first time, seconds afterwards) and runs the gate on the
``upstream`` subject there, then merges the cell. The release is overridable with
``OMNI_CONFORMANCE_SECOND_VLLM``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SECOND = os.environ.get("OMNI_CONFORMANCE_SECOND_VLLM", "0.30.0")


@pytest.mark.vllm_matrix
def test_gate_runs_on_a_second_vllm_release(tmp_path):
    out = tmp_path / "matrix"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "conformance.cli",
            "matrix",
            "--vllm",
            SECOND,
            "--subject",
            "upstream",
            "--out",
            str(out),
            "--no-upstream-tests",
        ],
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    print(proc.stdout[-4000:], proc.stderr[-2000:])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    cell = json.loads((out / "cells" / f"upstream--vllm-{SECOND}" / "cell.json").read_text())
    assert cell["status"] == "pass"
    assert cell["environment"]["vllm"] == SECOND  # ran on that release, not this interpreter's
    report = json.loads((out / "matrix-report.json").read_text())
    assert report["versions"] == [SECOND] and report["subjects"] == ["upstream"]
    for name in ("matrix-report.md", "matrix-report.junit.xml", "matrix-report.html"):
        assert (out / name).stat().st_size > 0
