"""AR-INV-001 (C-01, C-02, C-04, C-05, C-06, C-07): the subject's schedulers make upstream's
transitions, step for step, on generated workloads.

Hypothesis generates programs in the workload language (``conformance.machine``): requests with
shared prefixes, tight block budgets (so preemption and eviction happen), aborts of any subset of
ids in any state, stop tokens, max_tokens, and all three forms of ``reset_prefix_cache``. Each
operation is applied to upstream vLLM and to the subject in lock step; after each one, request
state, queues, the block pool, the ``SchedulerOutput`` and the ``EngineCoreOutputs`` must be equal
unless the subject's registry tolerates the field (C-02). Teardown drains the workload and checks
conservation (C-06) and that no subject-side per-request state outlives its request (C-04).

Why it can fail: any override that reorders queues, frees blocks differently, changes what is
scheduled or emitted, or keeps state after a request ends. Positive controls are the mutants in
``tests/mutants/harness_mutants.py``; ``tests/test_conformance_mutants.py`` shows each is caught.
Runs once with subject features off, then once per feature the subject declares
(``Subject.feature_configs``), in sync and in async (batch-queue) scheduling.
"""

import pytest
from hypothesis.stateful import run_state_machine_as_test

from conformance.config import HarnessConfig
from conformance.machine import machine_for

pytestmark = [pytest.mark.invariants]

TIGHT = dict(num_blocks=14, max_num_batched_tokens=48, max_num_seqs=6, max_model_len=128)


def _features(subject):
    yield "off", {}, (None,)
    for name, feat in subject.feature_configs().items():
        yield name, feat.get("additional_config", {}), tuple(feat.get("final_stages", (None,)))


@pytest.mark.clauses("C-01", "C-02", "C-04", "C-05", "C-06", "C-07")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_lockstep_parity(conformance, conformance_subject, mode):
    for feature, additional, finals in _features(conformance_subject):
        cfg = HarnessConfig(async_scheduling=mode == "async", additional_config=additional, **TIGHT)
        machine = machine_for(
            conformance, cfg, final_stages=finals, name=f"AR-INV-001-{mode}-{feature}"
        )
        run_state_machine_as_test(machine)
