"""Prints how many lock-step steps the invariant suite compared (the suite's budget under the
``ci`` profile is at least 20,000).

pytest loads ``conftest.py`` of ``test*`` folders under each test path at start-up, so this hook
runs on the xdist controller too. It sums the ``steps_compared`` and ``examples`` that the
harness plugin's ``conformance`` recorder attaches to each test report (``user_properties``), so
it needs no ``--conformance-report-dir`` and works across workers. No tests live in this folder.
"""

from __future__ import annotations

from typing import Any

_PROP = "omni_conformance"
CI_STEP_BUDGET = 20_000


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    # The recorder attaches its counters when its fixture is torn down, so they ride on the
    # teardown report; keep one entry per test.
    per_test: dict[str, dict[str, Any]] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            for key, value in getattr(report, "user_properties", ()) or ():
                if key == _PROP and isinstance(value, dict):
                    per_test[report.nodeid] = value
    if not per_test:
        return
    tests = len(per_test)
    steps = sum(int(v.get("steps_compared") or 0) for v in per_test.values())
    examples = sum(int(v.get("examples") or 0) for v in per_test.values())
    terminalreporter.section("invariants: lock-step budget")
    terminalreporter.write_line(
        f"lock-step steps compared: {steps} in {examples} sessions over {tests} tests "
        f"(ci target >= {CI_STEP_BUDGET})"
    )
