"""A scripted lock-step comparison of upstream vLLM and the omni schedulers.

The canonical workload (``conformance._core.scenarios``) runs shared prefixes under a tight block
budget (preemption), aborts in every state (waiting, running, preempted, finished but not yet
reported, in flight under async scheduling), stop tokens, EOS, max_tokens and all three forms of
``reset_prefix_cache``, in sync and in async (batch-queue) scheduling. After every operation the
omni scheduler's request state, queues, block pool, SchedulerOutput and EngineCoreOutputs must
equal upstream's, except fields a registry entry tolerates.

* omni features off (no ``omni_stage``): no difference at all, nothing tolerated (C-01).
* a stage with a downstream consumer and a ``requires_token_updates = True`` chunk processor:
  the only differences are the extra output fields, and OMNI-OUT-001 is what tolerates them
  (C-02); without that entry the same run fails (C-03: the entry is still needed).
Each run also asserts the workload really hit every situation, so a script that silently stopped
preempting or aborting cannot pass for the wrong reason.
"""

from __future__ import annotations

import pytest

from conformance._core.differences import Registry
from conformance._core.machine import TIGHT
from conformance._core.scenarios import run_canonical
from omni_runtime.conformance_subject import OmniSubject

pytestmark = pytest.mark.clauses("C-01", "C-02", "C-04", "C-05", "C-06", "C-07")

FEATURE = "token-updates"


def _feature():
    feat = OmniSubject().feature_configs()[FEATURE]
    return feat["additional_config"], tuple(feat["final_stages"])


def _assert_exercised(session, mode):
    st = session.stats
    assert st["prefix_hits"] >= 3, st
    assert st["preemptions"] >= 2, st
    assert st["resumed"] >= 1, st
    assert st["abort_waiting"] >= 1, st
    assert st["abort_preempted"] >= 1, st
    assert st["abort_finished_unreported"] >= 1, st
    if mode == "async":
        assert st["abort_in_flight"] >= 1, st
        assert st["stale_in_flight"] >= 1, st
    else:
        assert st["abort_running"] >= 1, st
    assert st["stop_stop_token"] >= 1 and st["stop_eos"] >= 1, st
    assert st["max_tokens"] >= 1, st
    for form in ("plain", "running", "connector"):
        assert st[f"reset_{form}"] >= 1, st
    assert (
        1 <= st["reset_succeeded"] < st["reset_plain"] + st["reset_running"] + st["reset_connector"]
    ), st  # at least one refused reset (blocks held) and one that went through
    assert session.steps_compared >= 25


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_parity_with_omni_features_off(mode):
    session = run_canonical(TIGHT.with_(async_scheduling=mode == "async"), OmniSubject())
    assert session.failure is None, session.failure.headline()
    assert dict(session.tolerated) == {}
    assert session.conservation_problems() == []
    _assert_exercised(session, mode)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_parity_with_downstream_and_token_updates(mode):
    additional, finals = _feature()
    cfg = TIGHT.with_(async_scheduling=mode == "async", additional_config=additional)
    session = run_canonical(cfg, OmniSubject(), final_stages=finals)
    assert session.failure is None, session.failure.headline()
    # The extra output fields really happened, and OMNI-OUT-001 alone tolerated them.
    assert set(session.tolerated) == {"OMNI-OUT-001"}
    assert session.tolerated["OMNI-OUT-001"] >= 5
    assert session.sub.chunks, "the downstream outbox received no chunk"
    assert session.conservation_problems() == []
    _assert_exercised(session, mode)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_omni_out_001_is_still_needed(mode):
    additional, finals = _feature()
    cfg = TIGHT.with_(async_scheduling=mode == "async", additional_config=additional)
    registry = Registry(OmniSubject().differences()).without({"OMNI-OUT-001"})
    session = run_canonical(cfg, OmniSubject(), final_stages=finals, registry=registry)
    assert session.failure is not None
    assert session.failure.path.rsplit(".", 1)[-1] in ("omni_chunk_refs", "omni_eof", "__type__")
