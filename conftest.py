"""Opt-in lanes, and one fixed string hash for every test process.

String hashing: the seed (``conformance._core.hash_seed``) is fixed here for every child, before
pytest-xdist starts its workers (which inherit it), so the README's ``pytest -n 2`` runs the
examples ``omni-conformance check`` runs; a run without ``-n`` restarts itself under the seed
(``invariants/conftest.py``).

Opt-in lanes: tests that need environments beyond the installed vLLM.

``vllm_matrix`` tests build an environment for another vLLM release (gigabytes, minutes) and
``vllm_omni`` tests need a vLLM + vllm-omni environment; ``ray_cluster`` tests start a two-node
Ray cluster on this machine (the Ray lane). They are deselected (reported as such
by pytest, never silently skipped) unless the ``-m`` expression names their marker, e.g.
``pytest -m vllm_matrix``; the default test command and ``-m "not slow"`` leave them out.
"""

from __future__ import annotations

import pytest

from conformance._core import hash_seed

hash_seed.pin_for_children()

OPT_IN = ("vllm_matrix", "vllm_omni", "ray_cluster")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    expression = config.getoption("markexpr", "") or ""
    wanted = {m for m in OPT_IN if m in expression}
    keep, drop = [], []
    for item in items:
        marks = {m for m in OPT_IN if item.get_closest_marker(m)}
        (drop if marks - wanted else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
