"""AR-INV-001 (C-01, C-02, C-04, C-05, C-06, C-07): the subject's schedulers make upstream's
transitions, step for step, on generated workloads — the harness's plain machine, no audits.

Hypothesis generates programs in the workload language (``conformance._core.machine``), applied
to upstream vLLM and the subject in lock step; after each operation request state, queues, the
block pool, the ``SchedulerOutput`` and the ``EngineCoreOutputs`` must be equal unless the
subject's registry tolerates the field (C-02); teardown checks conservation (C-06) and that no
subject state outlives its request (C-04). Runs with subject features off and with each
token-source feature the subject declares, in sync and async scheduling.

Clauses and their mutants (``tests/mutants/harness_mutants.py``): docs/contracts.md; how the
programs are drawn: docs/design.md, "How the suite checks".
"""

import pytest
from hypothesis.stateful import run_state_machine_as_test

from conformance._core.machine import machine_for
from invariants.machines import harness_config

pytestmark = [pytest.mark.invariants]


@pytest.mark.clauses("C-01", "C-02", "C-04", "C-05", "C-06", "C-07")
@pytest.mark.features(worker=False)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_lockstep_parity(conformance, mode, feature):
    cfg = harness_config(feature, mode=mode, prefix=True)
    machine = machine_for(
        conformance,
        cfg,
        final_stages=feature.final_stages,
        plain_requests=feature.plain_requests,
        name=f"AR-INV-001-{mode}-{feature.name}",
    )
    run_state_machine_as_test(machine)
