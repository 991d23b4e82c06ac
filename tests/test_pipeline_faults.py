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
* A code2wav decoder fault fails only its request.
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
    assert p.is_clean(), p.leftovers()
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
    while p.orchestrator.has_work():
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
    worker = orch.engines["talker"].core.model_executor.driver_worker.worker
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
