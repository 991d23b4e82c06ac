"""AR-INV-001 (C-01..C-08): the omni runtime makes upstream vLLM's transitions at every step,
with every stage feature, in sync and async scheduling, with prefix caching on and off.

Each example is a hypothesis program in the harness's workload language (``conformance.machine``)
run by an audited lock-step session (``invariants.machines``): requests drawn from a small
vocabulary with two shared prefixes (so the prefix cache hits and, with 14 blocks of 16 tokens,
evicts), block and token budgets tight enough to preempt, aborts of random subsets of ids in
every state (waiting, running, preempted, finished-unreported, in flight under async
scheduling), stop tokens, EOS, max_tokens and the three forms of ``reset_prefix_cache``.

What can fail, and why:

* after every operation, any field of request state, queues, block pool (free count, eviction
  order, cached hashes), ``SchedulerOutput`` or ``EngineCoreOutputs`` that differs from upstream
  without a registry entry (C-01, C-02, C-05, C-07); a leaked omni id after an abort (C-04);
* the per-operation audits of AR-INV-002/003 (attributes, tensors, C-20, C-21) — they run here too
  because these are the longest programs;
* at teardown, after draining: free blocks back to the initial count and no request held (C-06),
  and the chunk ledger (C-40..C-45, C-51, C-55) for features with a downstream;
* ``test_model_parity_with_hugging_face``: greedy tokens of the real runner differ from
  ``transformers.LlamaForCausalLM`` (eager, full recompute) of the same weights (C-08), under
  chunked prefill, preemption, prefix caching on/off and both scheduling modes.

Features with ``use_worker`` run the real ``OmniARModelRunner`` on both sides (inline and
background materialization); the others run the harness's deterministic token source.
Positive controls: ``tests/mutants/runtime_mutants.py`` (``requeue_preempted_at_back``,
``free_blocks_reversed``, ``abort_keeps_omni_progress``, ...), proven by
``tests/test_mutant_selftest.py``.
"""

import pytest

from invariants.machines import (
    WorkerSubject,
    harness_config,
    machine_class,
    run_machine,
    suite_settings,
)
from invariants.strategies import FEATURES

pytestmark = [pytest.mark.invariants]

# Examples per parametrisation under the ci profile (scaled by the profile: thorough is 10x):
# the token-source features are cheap, the real-runner features cost a model forward per step.
# Together they compare well over 20,000 lock-step steps within the ci time budget.
CI_EXAMPLES = {"off": 50, "token-updates": 50}
CI_EXAMPLES_WORKER = 12


@pytest.mark.clauses(
    "C-01",
    "C-02",
    "C-04",
    "C-05",
    "C-06",
    "C-07",
    "C-10",
    "C-11",
    "C-12",
    "C-20",
    "C-21",
    "C-40",
    "C-42",
    "C-43",
    "C-44",
    "C-45",
    "C-51",
    "C-55",
)
@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "noprefix"])
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_lockstep_parity(conformance, feature, mode, prefix):
    feat = FEATURES[feature]
    cfg = harness_config(feat, mode=mode, prefix=prefix)
    subject = WorkerSubject() if conformance.subject.name == "omni" else conformance.subject
    machine = machine_class(
        conformance, cfg, feat, subject=subject, name=f"AR-INV-001-{feature}-{mode}-{prefix}"
    )
    outcome = run_machine(machine, suite_settings(CI_EXAMPLES.get(feature, CI_EXAMPLES_WORKER)))
    if outcome.error is not None:
        raise outcome.error


@pytest.mark.clauses("C-08")
@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "noprefix"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_model_parity_with_hugging_face(conformance, mode, prefix):
    pytest.importorskip("transformers")
    feat = FEATURES["hidden-inline"] if prefix else FEATURES["token-only-background"]
    cfg = harness_config(feat, mode=mode, prefix=prefix)
    machine = machine_class(
        conformance,
        cfg,
        feat,
        subject=WorkerSubject(),
        check_hf=True,
        name=f"AR-INV-001-C08-{mode}-{prefix}",
    )
    # Shorter runs: Hugging Face recomputes the whole sequence for every token.
    outcome = run_machine(machine, suite_settings(5, stateful_step_count=15))
    if outcome.error is not None:
        raise outcome.error
