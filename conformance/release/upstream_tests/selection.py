"""Which of the cached release's test files run: by default the scheduler tests, those that
build a scheduler (they import vLLM's ``Scheduler``/``AsyncScheduler`` or a ``create_scheduler*``
helper), the only ones a swap of scheduler classes can change."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

from conformance.release.upstream_tests.fetch import CORE_DIR, TestsUnavailable

# Helpers through which a test module builds a scheduler; importing one (or vLLM's scheduler
# classes themselves) is what makes a module one of "the scheduler tests".
SCHEDULER_NAMES = frozenset({"Scheduler", "AsyncScheduler"})
SCHEDULER_MODULES = ("vllm.v1.core.sched.scheduler", "vllm.v1.core.sched.async_scheduler")
BUILDER_PREFIX = "create_scheduler"
# Scheduler tests left out of the default selection for their cost alone: 0.33.0's randomized
# priority "blast" runs 20,000 steps per parameter set (12 sets, minutes each on a small CPU).
SLOW_MODULES = frozenset({"test_priority_scheduler_random.py"})
SCHEDULER_SELECTION = "scheduler"


def builds_scheduler(source: bytes) -> bool:
    """Whether a test module imports vLLM's scheduler classes or a ``create_scheduler*``
    helper: the tests a swap can change (the rest run identically on every subject)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name.startswith(BUILDER_PREFIX):
                    return True
                if node.module in SCHEDULER_MODULES and alias.name in SCHEDULER_NAMES:
                    return True
    return False


def select_tests(
    core: Path, requested: str | Iterable[str] | None, *, include_slow: bool = False
) -> list[Path]:
    """The test files to run: the scheduler tests (``"scheduler"`` or nothing; without
    ``SLOW_MODULES`` unless ``include_slow``), ``"all"``, or files relative to ``tests/v1/core``."""
    everything = sorted(p for p in core.rglob("test_*.py") if "__pycache__" not in p.parts)
    wanted = [requested] if isinstance(requested, str) else list(requested or ())
    if not wanted or wanted == [SCHEDULER_SELECTION]:
        return [
            p
            for p in everything
            if builds_scheduler(p.read_bytes()) and (include_slow or p.name not in SLOW_MODULES)
        ]
    if wanted == ["all"]:
        return everything
    out = []
    for name in wanted:
        path = core / name
        if not path.exists():
            known = ", ".join(p.relative_to(core).as_posix() for p in everything)
            raise TestsUnavailable(f"no test file {name!r} in {CORE_DIR}; known: {known}")
        out.append(path)
    return out
