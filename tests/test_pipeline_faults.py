"""Abort and fault handling across the pipeline's stages (C-04, C-06, C-61, C-62).

* Abort in the middle of streaming (request in the talker, audio already delivered), in the
  thinker, and before the first step: the client sees exactly one terminal outcome ("abort")
  per request, the other requests complete unchanged, and afterwards every stage is empty:
  no request in any scheduler, runner or batch queue, free blocks back to the initial count,
  no transfer progress, processor buffers, outboxes, connector backlog or decoder state.
* A connector whose send raises for one request fails that request only ("error"); the
  others complete with the same outputs as in a clean run.
* A worker fault (the talker worker raising after a step that touched one request) fails only
  that request; a request still in the thinker at that time completes.
* A code2wav decoder fault fails only its request; a talker input its adapter rejects ends
  its request with an error naming the limit.
* A worker fault before the forward leaves hashed-but-unwritten blocks: they are evicted, so a
  retry of the same prompt equals a clean run (positive control: without the eviction the
  retry reads garbage KV and its tokens differ).
* Random aborts at random steps keep one outcome per request and leave survivors unchanged.
Each runs under sync and async scheduling (async with background materialization, the case
with steps in flight when the fault or abort lands).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from omni_runtime.engine import OmniPipeline
from omni_runtime.engine.connectors import InProcessConnector

MODES = [(False, "inline"), (True, "background")]
IDS = ["sync-inline", "async-background"]


@pytest.fixture(scope="module", params=MODES, ids=IDS)
def pipeline(request):
    async_scheduling, materialization = request.param
    with OmniPipeline(async_scheduling=async_scheduling, materialization=materialization) as p:
        yield p


def terminal_counts(events) -> Counter[str]:
    return Counter(e.request_id for e in events if e.kind == "finished")


def assert_clean(p: OmniPipeline) -> None:
    p.drain()
    assert p.is_clean(), repr(p.leftovers())
    for engine in p.orchestrator.engines.values():
        assert engine.num_free_blocks() == engine.initial_free_blocks


def test_abort_mid_stream_leaves_nothing_behind(pipeline) -> None:
    p = pipeline
    ids = p.submit(
        ["abort me in the talker", "keep me", "abort me early"],
        max_text_tokens=6,
        max_codec_tokens=40,
        request_ids=["a-talk", "keep", "a-think"],
    )
    events = []
    aborted_talk = aborted_think = False
    while p.has_work():
        step_events = p.step()
        events.extend(step_events)
        if not aborted_think:
            # Still in the thinker after its first step.
            assert p.orchestrator._tracks["a-think"].stage == "thinker"
            assert p.abort("a-think") == ["a-think"]
            aborted_think = True
        if not aborted_talk and any(
            e.kind == "audio" and e.request_id == "a-talk" for e in step_events
        ):
            # Audio already streamed, talker still generating: abort across all stages.
            assert p.orchestrator._tracks["a-talk"].stage == "talker"
            assert "a-talk" in p.orchestrator.engines["talker"].scheduler.requests
            assert p.abort(["a-talk"]) == ["a-talk"]
            assert p.abort(["a-talk"]) == []  # a second abort is a no-op
            aborted_talk = True
    assert aborted_talk and aborted_think
    assert terminal_counts(events) == Counter(ids)  # exactly one outcome each (C-62)
    outcome = {e.request_id: e.result for e in events if e.kind == "finished"}
    assert outcome["a-talk"].finish_reason == "abort" and outcome["a-talk"].waveform is None
    assert outcome["a-think"].finish_reason == "abort"
    assert outcome["a-think"].stages == ["thinker"]
    assert outcome["keep"].ok
    # The survivor is unaffected by its neighbours' aborts.
    again = p.generate(["keep me"], max_text_tokens=6, max_codec_tokens=40)[0]
    assert again.codec_token_ids == outcome["keep"].codec_token_ids
    assert torch.equal(again.waveform, outcome["keep"].waveform)
    assert_clean(p)


def test_abort_before_first_step_and_stream_close(pipeline) -> None:
    p = pipeline
    [rid] = p.submit(["never stepped"], max_text_tokens=4, max_codec_tokens=8)
    assert p.abort([rid]) == [rid]
    events = p.drain()
    assert [(e.request_id, e.result.finish_reason) for e in events if e.kind == "finished"] == [
        (rid, "abort")
    ]
    assert_clean(p)
    # Closing a stream early aborts what it started.
    stream = p.stream(["closed early"], max_text_tokens=4, max_codec_tokens=40)
    for ev in stream:
        if ev.kind == "audio":
            break
    stream.close()
    assert_clean(p)


class FaultyConnector(InProcessConnector):
    def __init__(self, bad: str) -> None:
        super().__init__("faulty")
        self.bad = bad

    def send(self, chunk) -> None:
        if chunk.request_id == self.bad and not chunk.is_final:
            raise ConnectionError(f"link down for {chunk.request_id}")
        super().send(chunk)


@pytest.mark.parametrize("edge", ["thinker", "talker"])
def test_connector_fault_fails_only_its_request(pipeline, edge) -> None:
    p = pipeline
    orch = p.orchestrator
    clean = {
        r.request_id: r
        for r in p.generate(
            ["good one", "good two"],
            max_text_tokens=5,
            max_codec_tokens=24,
            request_ids=["g1-ref", "g2-ref"],
        )
    }
    original = orch.connectors[edge]
    faulty = FaultyConnector("bad")
    orch.connectors[edge] = faulty
    orch.engines[edge].set_sink(faulty)
    try:
        p.submit(
            ["good one", "bad", "good two"],
            max_text_tokens=5,
            max_codec_tokens=24,
            request_ids=["g1", "bad", "g2"],
        )
        events = p.drain()
    finally:
        orch.connectors[edge] = original
        orch.engines[edge].set_sink(original)
    assert terminal_counts(events) == Counter(["g1", "bad", "g2"])
    outcome = {e.request_id: e.result for e in events if e.kind == "finished"}
    assert outcome["bad"].finish_reason == "error"
    for rid in ("g1", "g2"):
        got, ref = outcome[rid], clean[f"{rid}-ref"]
        assert got.ok
        assert got.codec_token_ids == ref.codec_token_ids
        assert torch.equal(got.waveform, ref.waveform)
    assert_clean(p)


def test_worker_fault_fails_only_the_requests_it_touched(pipeline, monkeypatch) -> None:
    p = pipeline
    orch = p.orchestrator
    worker = orch.engines["talker"].worker
    real_sample = worker.sample_tokens

    def faulty_sample(grammar_output=None):
        out = real_sample(grammar_output)
        # A sync step has a plain output; async background steps return a deferred one.
        req_ids = out.req_ids if hasattr(out, "req_ids") else out._output.req_ids
        if "bad" in req_ids:
            raise RuntimeError("injected worker fault")
        return out

    monkeypatch.setattr(worker, "sample_tokens", faulty_sample)
    p.submit(["the bad one"], max_text_tokens=2, max_codec_tokens=30, request_ids=["bad"])
    events = []
    for _ in range(2):
        events.extend(p.step())
    # "late" enters while "bad" is in the thinker; it reaches the talker only after "bad" died.
    p.submit(["a later, longer one"], max_text_tokens=12, max_codec_tokens=10, request_ids=["late"])
    events.extend(p.drain())
    monkeypatch.undo()
    assert terminal_counts(events) == Counter(["bad", "late"])
    outcome = {e.request_id: e.result for e in events if e.kind == "finished"}
    assert outcome["bad"].finish_reason == "error"
    assert "injected worker fault" in outcome["bad"].error
    assert outcome["late"].ok and outcome["late"].stages == ["thinker", "talker", "code2wav"]
    assert_clean(p)
    # The stage keeps serving after the fault.
    assert p.generate(["after"], max_text_tokens=3, max_codec_tokens=8)[0].ok
    assert_clean(p)


def test_decoder_fault_fails_only_its_request(pipeline, monkeypatch) -> None:
    p = pipeline
    c2w = p.orchestrator.code2wav
    real_push = c2w.push

    def push(chunk):
        if chunk.request_id == "bad":
            raise ValueError("injected decoder fault")
        return real_push(chunk)

    monkeypatch.setattr(c2w, "push", push)
    results = p.generate(
        ["x", "y"], max_text_tokens=3, max_codec_tokens=20, request_ids=["bad", "good"]
    )
    monkeypatch.undo()
    assert results[0].finish_reason == "error" and "decoder fault" in results[0].error
    assert results[1].ok
    assert_clean(p)


def test_downstream_rejection_is_an_error_outcome(tmp_path) -> None:
    """A talker input its adapter refuses (prompt over the talker's max_model_len) ends that
    request with an error naming the stage, field and limit; the others complete."""
    import json

    from omni_runtime.engine.graph import default_pipeline_path

    raw = json.loads(default_pipeline_path().read_text())
    raw["stages"][1]["max_model_len"] = 48
    path = tmp_path / "small_talker.json"
    path.write_text(json.dumps(raw))
    with OmniPipeline(path, async_scheduling=False) as p:
        results = p.generate(["x" * 60, "short"], max_text_tokens=3, max_codec_tokens=8)
        assert results[0].finish_reason == "error"
        assert "thinker -> talker" in results[0].error and "max_model_len 48" in results[0].error
        assert results[0].stages == ["thinker"] and len(results[0].text_token_ids) == 3
        assert results[1].ok
        assert_clean(p)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_aborts_keep_every_invariant(pipeline, seed) -> None:
    """Aborts at random steps, of requests in random stages: one outcome per request, the
    survivors' outputs equal an undisturbed run, and nothing is left behind."""
    import random

    p = pipeline
    rng = random.Random(seed)
    prompts = [f"random abort {seed} request {i}" for i in range(6)]
    limits = dict(max_text_tokens=5, max_codec_tokens=20)
    undisturbed = {
        i: r
        for i, r in enumerate(
            p.generate(prompts, **limits, request_ids=[f"u{seed}-{i}" for i in range(6)])
        )
    }
    ids = p.submit(prompts, **limits, request_ids=[f"r{seed}-{i}" for i in range(6)])
    victims = set(rng.sample(ids, 3))
    events = []
    while p.has_work():
        events.extend(p.step())
        live = [rid for rid in victims if rid in p.orchestrator._tracks]
        if live and rng.random() < 0.3:
            p.abort([rng.choice(live)])
    assert terminal_counts(events) == Counter(ids)
    outcome = {e.request_id: e.result for e in events if e.kind == "finished"}
    assert any(r.finish_reason == "abort" for r in outcome.values())  # the test did abort
    for i, rid in enumerate(ids):
        r = outcome[rid]
        if r.finish_reason == "abort":
            assert rid in victims
            continue
        ref = undisturbed[i]
        assert r.ok
        assert (r.text_token_ids, r.codec_token_ids) == (ref.text_token_ids, ref.codec_token_ids)
        assert torch.equal(r.waveform, ref.waveform)
    assert_clean(p)


def test_fault_before_the_worker_ran_does_not_poison_the_prefix_cache(pipeline, monkeypatch):
    """The worker raises before computing a prefill: the blocks the scheduler already hashed
    for it hold no KV. A retry of the same prompt must not hit them (it must equal a clean
    run), and the finished ids the failed step carried still reach the runner."""
    p = pipeline
    prompt = "poisoned prefix? " * 4  # 68 bytes: four full 16-token blocks
    [clean] = p.generate([prompt], max_text_tokens=4, max_codec_tokens=8)
    assert p.orchestrator.engines["thinker"].scheduler.reset_prefix_cache()
    worker = p.orchestrator.engines["thinker"].worker
    real_execute = worker.execute_model

    def faulty_execute(so):
        if any(r.req_id == "bad" for r in so.scheduled_new_reqs):
            raise RuntimeError("injected fault before the forward")
        return real_execute(so)

    monkeypatch.setattr(worker, "execute_model", faulty_execute)
    [bad] = p.generate([prompt], max_text_tokens=4, max_codec_tokens=8, request_ids=["bad"])
    monkeypatch.undo()
    assert bad.finish_reason == "error" and "before the forward" in bad.error
    [retry] = p.generate([prompt], max_text_tokens=4, max_codec_tokens=8)
    assert retry.ok
    assert (retry.text_token_ids, retry.codec_token_ids) == (
        clean.text_token_ids,
        clean.codec_token_ids,
    )
    assert_clean(p)
