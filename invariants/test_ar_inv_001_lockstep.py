"""AR-INV-001 (C-01, C-02, C-04, C-05, C-06, C-07): the subject's schedulers make upstream's
transitions, step for step, on generated workloads — the harness's plain machine, no audits.

Hypothesis generates programs in the workload language (``conformance._core.machine``): requests with
shared prefixes, tight block budgets (so preemption and eviction happen), aborts of any subset of
ids in any state, stop tokens, max_tokens, and all three forms of ``reset_prefix_cache``. Each
operation is applied to upstream vLLM and to the subject in lock step; after each one, request
state, queues, the block pool, the ``SchedulerOutput`` and the ``EngineCoreOutputs`` must be equal
unless the subject's registry tolerates the field (C-02). Teardown drains the workload and checks
conservation (C-06) and that no subject-side per-request state outlives its request (C-04).

Why it can fail: any override that reorders queues, frees blocks differently, changes what is
scheduled or emitted, or keeps state after a request ends. Positive controls are the mutants in
``tests/mutants/harness_mutants.py``; ``tests/test_conformance_mutants.py`` shows each is caught.
Runs with subject features off and with each token-source feature the subject declares, in sync
and async (batch-queue) scheduling.
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
