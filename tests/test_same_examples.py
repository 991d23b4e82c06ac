"""The same profile runs the same examples however the invariant suite is started.

Two things made the examples (and so the per-test step counts of the compat report) depend on
how the suite was run rather than on the profile alone:

* string hashing: vLLM frees the blocks of a multi-id abort in ``set`` order. The gate runs with
  ``PYTHONHASHSEED=0``; a plain ``pytest -m invariants`` without ``-n`` hashed at random (the root
  conftest pins the seed only for the workers it starts) while the workload believed the seed
  pinned. ``invariants/conftest.py`` now starts such a process again with the seed pinned, and
  ``conformance._core.machine`` reads the seed from the interpreter, not from the environment.
* hypothesis's local constants: it draws literals from whichever of the project's modules are
  imported at the time, and that set depends on the way of running (the checkout also collects
  ``tests/``, each xdist worker imports what its own tests need). The plugin empties that pool
  (``conformance._core.hypothesis_compat``).

Where it showed: the gate as installed (its modules in site-packages, so none of their literals
in the pool) compared 4213 steps at the smoke profile, the checkout 3809, in 8 lock-step tests.

``test_local_constants_do_not_change_examples`` shows the second cause directly and quickly;
``test_same_step_counts_installed_gate_and_checkout`` (slow: two runs of part of the suite)
runs the installed gate with ``omni-conformance check -n 2`` and the checkout with
``pytest -m invariants`` in one process started without a hash seed and with an extra project
module imported, and requires identical per-test example and step counts.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, check_env

# A plain project module full of literals, like any module one way of running imports and
# another does not.
LITERALS = (
    '"""Literals only."""\n\nINTS = ('
    + ", ".join(str(i) for i in (*range(60), 64, 100, 128, 255, 256, 300, 512, 1000, 123457))
    + ")\n"
)

DRAWS = """
import sys
if "extra" in sys.argv:
    import extra_literals  # noqa: F401
from conformance._core.hypothesis_compat import freeze_local_constants
assert freeze_local_constants()
from hypothesis import given, settings, strategies as st
seen = []

@settings(derandomize=True, database=None, max_examples=100)
@given(st.integers(0, 10**6), st.floats(0, 1e6))
def prop(i, f):
    seen.append((i, f))

prop()
print(repr(seen))
"""


def _draws(tmp_path: Path, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", DRAWS, *args],
        cwd=tmp_path,
        env=check_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_local_constants_do_not_change_examples(tmp_path):
    (tmp_path / "extra_literals.py").write_text(LITERALS)
    assert _draws(tmp_path) == _draws(tmp_path, "extra")


# Part of the suite whose examples changed with the local-constant pool (measured: the lock-step
# properties without a worker), plus the lock-step machine that aborts several ids at once.
SUBSET = (
    "invariants/test_ar_inv_001_parity.py",
    "invariants/test_ar_inv_001_lockstep.py",
)
SELECT = ("-k", "not hidden and not token-only and not model_parity")
PACKAGES = ("conformance", "invariants", "omni_runtime")


def _per_test(report: dict) -> dict[str, tuple[int, int]]:
    return {
        re.sub(r"^.*?(?=invariants/)", "", t["nodeid"]): (t["examples"], t["steps_compared"])
        for t in report["tests"]
    }


@pytest.mark.slow
def test_same_step_counts_installed_gate_and_checkout(tmp_path, run_check):
    """The gate as installed (the packages in a ``site-packages`` folder, none of them "local"
    to hypothesis, ``omni-conformance check -n 2``) and the checkout (``pytest -m invariants`` in
    one process started without a hash seed, an extra project module imported) run the same
    examples: identical per-test example and step counts. Before the fixes the installed gate
    compared 4213 steps at the smoke profile where the checkout compared 3809."""
    site = tmp_path / "env" / "lib" / "python3.11" / "site-packages"
    for name in PACKAGES:
        shutil.copytree(ROOT / name, site / name, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "gate").mkdir()
    gate = run_check(
        tmp_path / "gate",
        "omni",
        workers=2,
        profile="smoke",
        tests=tuple(str(site / p) for p in SUBSET),
        pytest_args=SELECT,
        extra_env={"PYTHONPATH": str(site)},
    )
    assert gate.returncode == 0 and gate.report is not None, gate.tail()

    (tmp_path / "extra_literals.py").write_text(LITERALS)
    env = {k: v for k, v in check_env(tmp_path).items() if k != "PYTHONHASHSEED"}
    report_dir = tmp_path / "checkout"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "invariants", "-q", "-p", "extra_literals"]
        + ["-p", "no:randomly", "--conformance-profile", "smoke", *SELECT]
        + ["--conformance-report-dir", str(report_dir)]
        + ["--conformance-failures-dir", str(tmp_path / "failures"), *SUBSET],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    # The run restarted itself with a pinned seed: its output still reaches the caller.
    assert " passed" in proc.stdout, (proc.stdout + proc.stderr)[-4000:]
    checkout = json.loads((report_dir / "compat-report.json").read_text())

    for report in (gate.report, checkout):
        assert report["environment"]["hypothesis"] == gate.report["environment"]["hypothesis"]
        assert report["environment"]["hypothesis_local_constants"] == "off"
    ours, theirs = _per_test(gate.report), _per_test(checkout)
    assert len(ours) >= 8 and sum(steps for _, steps in ours.values()) > 0, ours
    assert ours == theirs, {k: (ours.get(k), theirs.get(k)) for k in ours.keys() | theirs.keys()}
