"""Worker step faults lose no healthy request (C-61, C-62; ``omni_runtime.worker.recovery``).

* A fault that a retry clears fails nobody: every output equals an undisturbed run.
* A fault that keeps recurring for one request is pinned on it by splitting the batch: that
  request alone ends with an error naming the stage and the cause; the others equal an
  undisturbed run; every stage is clean afterwards.
* Blocks the failed request never wrote serve no prefix hit: the same prompt afterwards equals
  a clean run; a request that already hit them in the same step fails with it, naming it
  (positive control: without that check it would "complete" with tokens computed from garbage).
Each runs in the thinker and in the talker, under sync scheduling with inline payloads and
async scheduling with background payloads (steps in flight when the fault lands).
"""

from __future__ import annotations

from collections import Counter

import pytest

from omni_runtime.engine import OmniPipeline
from omni_runtime.worker.recovery import PoisonedBlocks, StepJournal, bisect
from tests.test_fault_campaign import same_output
from tests.test_pipeline_faults import IDS, MODES, assert_clean, terminal_counts

LIMITS = dict(max_text_tokens=5, max_codec_tokens=16)
PROMPTS = ["first healthy one", "the bad one", "second healthy one", "third, a bit longer"]
RIDS = ["h1", "bad", "h2", "h3"]


@pytest.fixture(scope="module", params=MODES, ids=IDS)
def pipeline(request):
    async_scheduling, materialization = request.param
    with OmniPipeline(async_scheduling=async_scheduling, materialization=materialization) as p:
        yield p


def reset_caches(p: OmniPipeline) -> None:
    for engine in p.orchestrator.engines.values():
        assert engine.scheduler.reset_prefix_cache()


def run(p: OmniPipeline, prompts, rids):
    reset_caches(p)
    events = list(p.drain()) if p.has_work() else []
    p.submit(prompts, **LIMITS, request_ids=rids)
    events.extend(p.drain())
    assert terminal_counts(events) == Counter(rids)  # exactly one outcome each (C-62)
    return {e.request_id: e.result for e in events if e.kind == "finished"}


def same(a, b) -> bool:
    """Both completed, with identical text ids, codec ids and waveform."""
    return a.ok and b.ok and same_output(a, b)


def inject(monkeypatch, p: OmniPipeline, stage: str, should_fail) -> list[int]:
    """Make the stage's forward raise whenever ``should_fail(req_ids)``; returns the count."""
    runner = p.orchestrator.engines[stage].runner
    real = runner._forward
    faults = [0]

    def forward(inputs):
        if should_fail(inputs.req_ids):
            faults[0] += 1
            raise RuntimeError(f"injected forward fault in {stage}")
        return real(inputs)

    monkeypatch.setattr(runner, "_forward", forward)
    return faults


@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_a_fault_a_retry_clears_fails_nobody(pipeline, monkeypatch, stage) -> None:
    p = pipeline
    clean = run(p, PROMPTS, [f"c-{r}" for r in RIDS])
    armed = [True]

    def once(req_ids):
        if armed[0] and "bad" in req_ids:
            armed[0] = False
            return True
        return False

    faults = inject(monkeypatch, p, stage, once)
    got = run(p, PROMPTS, RIDS)
    monkeypatch.undo()
    assert faults[0] == 1
    for rid in RIDS:
        assert same(got[rid], clean[f"c-{rid}"]), rid
    assert_clean(p)


@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_a_persistent_fault_fails_its_request_alone(pipeline, monkeypatch, stage) -> None:
    p = pipeline
    clean = run(p, PROMPTS, [f"c-{r}" for r in RIDS])
    faults = inject(monkeypatch, p, stage, lambda ids: "bad" in ids)
    got = run(p, PROMPTS, RIDS)
    monkeypatch.undo()
    assert faults[0] >= 3  # the step, its retries, and the isolating runs
    bad = got["bad"]
    assert bad.finish_reason == "error"
    assert f"{stage}: RuntimeError: injected forward fault in {stage}" in bad.error
    for rid in ("h1", "h2", "h3"):
        assert same(got[rid], clean[f"c-{rid}"]), rid
    assert_clean(p)
    # Its blocks serve no prefix hit: the same prompt, fault gone, equals a clean run.
    again = run(p, [PROMPTS[1]], ["bad-again"])
    assert same(again["bad-again"], clean["c-bad"])
    assert_clean(p)


LONG = "shared prefix, four full blocks long, then a tail " * 2  # > 64 prompt tokens


def test_a_same_step_prefix_hit_on_unwritten_kv_fails_with_the_writer(pipeline, monkeypatch):
    """Two identical prompts in one step: vLLM lets the second hit the blocks the first is
    computing. When the first's steps keep faulting, those blocks are never written, so the
    second fails too, naming the first; an unrelated request completes."""
    p = pipeline
    clean = run(p, [LONG, "unrelated"], ["c-long", "c-other"])
    inject(monkeypatch, p, "thinker", lambda ids: "writer" in ids)
    got = run(p, [LONG, LONG, "unrelated"], ["writer", "reader", "other"])
    monkeypatch.undo()
    assert got["writer"].finish_reason == "error"
    assert got["reader"].finish_reason == "error"
    assert "'writer' never wrote" in got["reader"].error
    assert same(got["other"], clean["c-other"])
    assert_clean(p)
    again = run(p, [LONG], ["long-again"])
    assert same(again["long-again"], clean["c-long"])
    assert_clean(p)


def test_without_the_reader_check_the_hit_reads_garbage(pipeline, monkeypatch):
    """Positive control for the test above: with ``PoisonedBlocks.read_by`` blinded, the
    reader "completes" with tokens that differ from a clean run."""
    p = pipeline
    clean = run(p, [LONG], ["c-long"])
    monkeypatch.setattr(PoisonedBlocks, "read_by", lambda self, blocks, n: None)
    inject(monkeypatch, p, "thinker", lambda ids: "writer" in ids)
    got = run(p, [LONG, LONG], ["writer", "reader"])
    monkeypatch.undo()
    assert got["writer"].finish_reason == "error"
    assert got["reader"].ok and not same(got["reader"], clean["c-long"])
    assert_clean(p)


# ---- the pieces ------------------------------------------------------------------------------


def test_bisect_pins_each_persistent_fault_and_keeps_order() -> None:
    succeeded: list[str] = []
    flaky = {"e": 1}  # fails once when alone, then succeeds: a retry must save it

    def run_part(part: list[str]) -> None:
        if "b" in part or "g" in part:
            raise ValueError("persistent")
        if "e" in part and (len(part) > 1 or flaky["e"]):
            flaky["e"] -= len(part) == 1
            raise ValueError("e")
        succeeded.extend(part)

    failed = bisect(list("abcdefgh"), run_part, retries=2)
    assert sorted(failed) == ["b", "g"] and str(failed["b"]) == "persistent"
    # Every healthy request succeeded exactly once, in scheduler order.
    assert "".join(succeeded) == "acdefh"


def test_journal_rollback_restores_states_and_slots() -> None:
    from omni_runtime.worker.runner import RequestState
    from omni_runtime.worker.sampler import SamplingState

    def state(rid: str) -> RequestState:
        return RequestState(rid, [1, 2, 3], 2, None, None, [7], 2, SamplingState.create(None, 0))

    a = state("a")
    requests = {"a": a, "gone": state("gone")}
    journal = StepJournal(requests)
    journal.save_slot("gone")
    del requests["gone"]
    journal.save_slot("new")
    requests["new"] = state("new")
    journal.save(a)
    a.num_computed_tokens = 3
    a.token_ids.append(9)
    a.block_ids.extend([8, 9])
    mark = journal.mark()
    journal.save(a)
    a.token_ids = [5]
    a.conditioning_sent = True
    journal.rollback(mark)
    assert a.token_ids == [1, 2, 3, 9] and not a.conditioning_sent
    journal.rollback()
    assert (a.token_ids, a.block_ids, a.num_computed_tokens) == ([1, 2, 3], [7], 2)
    assert sorted(requests) == ["a", "gone"]


def test_without_the_undo_a_retried_step_is_not_the_same_step(pipeline, monkeypatch) -> None:
    """Positive control for the journal: a one-off fault in the thinker's inline payload build,
    on a step that gave a running request a new KV block. With the undo blinded, the retry
    appends that block to the runner's table a second time, so later positions are written to
    and read from the wrong slots: the outputs differ from a clean run. With the undo they are
    equal (the tests above)."""
    from omni_runtime.worker import vllm_compat as worker_compat

    p = pipeline
    if p.options.materialization != "inline":
        pytest.skip("the inline build is the part of the step that is retried")
    long_limits = dict(max_text_tokens=40, max_codec_tokens=16)
    clean = p.generate(["grow past a block"], **long_limits, request_ids=["c-grow"])[0]
    monkeypatch.setattr(StepJournal, "rollback", lambda self, to=0: None)
    runner = p.orchestrator.engines["thinker"].runner
    real = runner._finish_payloads
    armed = [True]

    def finish(output, step, *, inline=False):
        so = runner._step_so
        grows = any(
            u.req_id == "grow" and not u.resumed and u.new_block_ids and u.new_block_ids[0]
            for u in worker_compat.cached_request_updates(so)
        )
        if armed[0] and grows:
            armed[0] = False
            raise RuntimeError("one-off build fault")
        return real(output, step, inline=inline)

    monkeypatch.setattr(runner, "_finish_payloads", finish)
    [got] = p.generate(["grow past a block"], **long_limits, request_ids=["grow"])
    monkeypatch.undo()
    assert not armed[0]
    assert not same(got, clean)
    assert_clean(p)
