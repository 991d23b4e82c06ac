"""C-09 with AR-INV-001's clauses: the audited lock-step machine on each part of vLLM's
scheduler that plain decoding never reaches.

Each axis (``conformance._core.axes``) changes the suite's configuration (statistics and KV
events, speculative decoding sync and async, the priority policy, a deeper batch queue) and may
draw per-request fields; the machine compares both sides after every operation as the plain
lock-step does, statistics, request events and published KV events included, and runs the
audits the subject declared. A statistics difference is reported after the run rather than at
once (``DEFERRED_SECTIONS``), so the axis's other fields are compared past it. Each axis has a
test per mode it runs in; one the installed vLLM cannot drive is not applicable with its reason.

Each axis's positive control is a named mutant in ``tests/mutants/runtime_mutants.py``.
"""

import pytest

from conformance._core.axes import AXES, DEFERRED_SECTIONS
from conformance._core.capabilities import NotApplicable
from conformance.plugin import covers
from invariants.machines import (
    MachineRun,
    axis_machine,
    harness_config,
    raise_failure,
    run_machine,
    suite_settings,
)

pytestmark = [pytest.mark.invariants]

CI_EXAMPLES = 12


@pytest.mark.clauses("C-01", "C-02", "C-04", "C-05", "C-06", "C-07", "C-09", "C-62")
@pytest.mark.features(
    worker=False,
    # Only the modes an axis has: pipeline parallelism (and the chunked Mamba connector axis
    # built on vLLM's sync engine) has no async scheduling to check, so no cell is made for it.
    # Under ci the cells take the subject's features in turn: the features change the chunk
    # path, which no axis drives, so crossing them would repeat each axis's scheduler states.
    spread=(("axis", "mode"), [((a, mode), f"{a.name}-{mode}") for a in AXES for mode in a.modes]),
)
def test_scheduler_axis(request, conformance, conformance_subject, axis, mode, feature):
    why = axis.unavailable(mode)
    if why is not None:
        raise NotApplicable(f"scheduler axis {axis.name}: {why}")
    cfg = axis.config(harness_config(feature, mode=mode, prefix=True))
    name = f"AR-INV-001-{axis.name}-{mode}-{feature.name}"
    run = MachineRun(
        conformance,
        conformance_subject,
        feature,
        cfg,
        name,
        request_values=axis.request_values,
        defer=DEFERRED_SECTIONS,
    )
    outcome = run_machine(run, suite_settings(CI_EXAMPLES), axis_machine(axis))
    covers(request.node, run.clauses | {"C-09"})
    raise_failure(outcome, run)
