"""AR-INV-001 (C-01..C-08): the subject makes upstream vLLM's transitions at every step, with
every feature it declares, in sync and async scheduling, with prefix caching on and off.

Each example is a hypothesis program in the workload language run by an audited lock-step
session (``invariants.machines``). It fails on any field that differs from upstream without a
registry entry (C-01, C-02, C-05, C-07), a leaked id (C-04), a second or missing terminal
outcome (C-62), a declared AR-INV-002/003 audit, and at teardown on conservation (C-06) and the
chunk ledger (C-40..C-45, C-51, C-55).

* ``test_lockstep_parity_speculative`` — the same under speculative decoding (sync), drafts
  from the token source (``SPEC_DRAFTS`` per step);
* ``test_model_parity_with_reference`` — greedy tokens of the real worker against the subject's
  model reference (C-08).

Clauses and mutants: docs/contracts.md; the programs: docs/design.md, "How the suite checks".
"""

import pytest

from conformance._core.needs import features_of, require, require_worker
from conformance.plugin import covers
from invariants.machines import (
    check_machine,
    lockstep_run,
    raise_failure,
    run_machine,
    suite_settings,
)

pytestmark = [pytest.mark.invariants]

# Examples per parametrisation under the ci profile (scaled by the profile: thorough is 10x):
# token-source features are cheap, real-worker features cost a model forward per step.
# Together they compare well over 20,000 lock-step steps within the ci time budget.
CI_EXAMPLES = 50
CI_EXAMPLES_WORKER = 12
# Draft tokens per step, and examples per token-source feature, under speculative decoding.
SPEC_DRAFTS = 3
CI_EXAMPLES_SPEC = 25


# The audit clauses (C-10..C-12, C-21, C-30..C-55) are credited only when the subject declared
# what they need: the run reports the clauses its sessions really checked.
@pytest.mark.clauses("C-01", "C-02", "C-04", "C-05", "C-06", "C-07", "C-20", "C-62")
@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "noprefix"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_lockstep_parity(request, conformance, conformance_subject, feature, mode, prefix):
    name = f"AR-INV-001-{feature.name}-{mode}-{prefix}"
    run = lockstep_run(conformance, conformance_subject, feature, name, mode=mode, prefix=prefix)
    budget = CI_EXAMPLES_WORKER if feature.use_worker else CI_EXAMPLES
    outcome = run_machine(run, suite_settings(budget))
    covers(request.node, run.clauses)
    raise_failure(outcome, run)


@pytest.mark.clauses("C-01", "C-02", "C-04", "C-05", "C-06", "C-07", "C-20", "C-62")
@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "noprefix"])
def test_lockstep_parity_speculative(request, conformance, conformance_subject, prefix):
    """Every token-source feature (a real worker drafts nothing) under speculative decoding."""
    clauses: set[str] = set()
    for feature in features_of(conformance_subject, worker=False):
        name = f"AR-INV-001-{feature.name}-spec{SPEC_DRAFTS}-{prefix}"
        run = lockstep_run(
            conformance,
            conformance_subject,
            feature,
            name,
            mode="sync",
            prefix=prefix,
            speculative=SPEC_DRAFTS,
        )
        outcome = run_machine(run, suite_settings(CI_EXAMPLES_SPEC))
        clauses |= set(run.clauses)
        raise_failure(outcome, run)
    covers(request.node, clauses)


@pytest.mark.clauses("C-08")
@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "noprefix"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_model_parity_with_reference(conformance, conformance_subject, mode, prefix):
    require_worker(conformance_subject)
    reference = require(conformance_subject, "model_reference", "independent model reference")
    features = {f.name: f for f in features_of(conformance_subject, worker=True)}
    # Prefix caching on runs the reference's first feature, off its last.
    feature = features[reference.features[0 if prefix else -1]]
    run = lockstep_run(
        conformance,
        conformance_subject,
        feature,
        f"AR-INV-001-C08-{mode}-{prefix}",
        mode=mode,
        prefix=prefix,
        check_reference=True,
    )
    # Shorter runs: the reference recomputes the whole sequence for every token.
    check_machine(run, suite_settings(5, stateful_step_count=15))
