"""Under the pull-request profiles each scheduler-axis cell runs under one of the subject's
features in turn; the deeper profiles cross every cell with every feature
(``conformance.plugin.SPREAD_PROFILES``, ``invariants/conftest.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cells(profile: str) -> list[tuple[str, str]]:
    """(feature, axis-mode) of every collected scheduler-axis test for the ``omni`` subject."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist",
         "invariants/test_scheduler_axes.py", "--conformance-subject", "omni",
         "--conformance-profile", profile],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ids = [line.split("[", 1)[1].rstrip("]") for line in proc.stdout.splitlines() if "[" in line]
    features = ("token-updates", "off")
    return [
        next((f, cell[len(f) + 1 :]) for f in features if cell.startswith(f + "-")) for cell in ids
    ]


def test_ci_spreads_the_axis_cells_over_the_features_and_thorough_crosses_them():
    spread, crossed = _cells("ci"), _cells("thorough")
    cells = {cell for _, cell in crossed}
    # thorough: every cell under both features; ci: every cell once, each feature in turn.
    assert Counter(cell for _, cell in crossed) == Counter({cell: 2 for cell in cells})
    assert sorted(cell for _, cell in spread) == sorted(cells)
    per_feature = Counter(feature for feature, _ in spread)
    assert set(per_feature) == {"off", "token-updates"}
    assert abs(per_feature["off"] - per_feature["token-updates"]) <= 1
    # Both modes of an axis meet both features across the axes, not one feature per mode.
    modes = {(feature, cell.rsplit("-", 1)[1]) for feature, cell in spread}
    assert modes == {(f, m) for f in ("off", "token-updates") for m in ("sync", "async")}
