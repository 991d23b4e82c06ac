"""The thinker -> talker -> code2wav pipeline on vLLM's ``EngineCore``, end to end.

What these tests prove, and how each can fail:

* C-22 / C-52 — every combination of sync/async scheduling, inline/background materialization
  and prefix caching on/off gives the same text ids, codec ids and waveform bytes. Prompts
  share a 45-byte prefix and repeat in a second wave, so with caching on the thinker hits its
  prefix cache and must still hand the talker the rows of cached positions (C-55); a switch that
  changes any hidden row, routing order or chunking shows up as a different talker input.
  Positive control: different prompts do give different outputs (the comparison can fail).
* Streaming — the waveform assembled from streamed code2wav chunks equals decoding the whole
  codec sequence at once, and audio arrives in several chunks before the request finishes
  (i.e. while the talker is still generating).
* C-42 — text-only requests end at the thinker: the talker never admits them and the thinker's
  connector carries nothing for them.
* The cross-process connector (a spawned relay child; chunks serialised) gives the same
  outputs as the in-process one.
* C-60 — bad input is rejected at admission, names the request and field, and disturbs nobody.
* Every run leaves every stage clean: no request in any scheduler or runner, free blocks back to
  their initial count, empty transfer progress, processor buffers, outboxes and connectors.
"""

from __future__ import annotations

import itertools
import json
import os

import pytest
import torch

from omni_runtime import text
from omni_runtime.adapters.input import RequestRejected
from omni_runtime.engine import OmniPipeline
from omni_runtime.engine.connectors import PipeConnector, decode_chunk, encode_chunk
from omni_runtime.engine.graph import PipelineConfig, PipelineConfigError, load_pipeline_config
from omni_runtime.payload import StageChunk, StagePayload

MAX_TEXT = 6
MAX_CODEC = 24
PREFIX = "The quick brown fox jumps over the lazy dog. "
PROMPTS = [PREFIX + "Hello", PREFIX + "Goodbye now", "short", PREFIX + "Hello"]
COMBOS = list(itertools.product([False, True], ["inline", "background"], [True, False]))


def signature(results) -> list[tuple[list[int], list[int], bytes]]:
    return [(r.text_token_ids, r.codec_token_ids, r.waveform.numpy().tobytes()) for r in results]


def run_workload(p: OmniPipeline):
    first = p.generate(PROMPTS, max_text_tokens=MAX_TEXT, max_codec_tokens=MAX_CODEC)
    # A second wave: with prefix caching on, these hit blocks the first wave left cached.
    second = p.generate(PROMPTS[:2], max_text_tokens=MAX_TEXT, max_codec_tokens=MAX_CODEC)
    p.drain()
    return first + second


@pytest.fixture(scope="module")
def reference():
    with OmniPipeline(async_scheduling=False, materialization="inline", prefix_caching=True) as p:
        results = run_workload(p)
        assert p.is_clean(), p.leftovers()
        yield p, results


def test_reference_run_is_complete(reference) -> None:
    p, results = reference
    hop = p.orchestrator.code2wav.hop_length
    for r in results:
        assert r.finish_reason in ("stop", "length"), (r.request_id, r.error)
        assert r.stages == ["thinker", "talker", "code2wav"]
        assert 1 <= len(r.text_token_ids) <= MAX_TEXT
        assert 1 <= len(r.codec_token_ids) <= MAX_CODEC
        assert r.waveform is not None and r.waveform.numel() == len(r.audio_codes) * hop
        assert r.sample_rate == p.sample_rate
        assert r.text == text.decode(r.text_token_ids)
        assert 0 < r.time_to_first_text_token <= r.time_to_first_audio_chunk <= r.total_time
    sig = signature(results)
    # Identical prompts give identical outputs; different prompts different ones (control).
    assert sig[0] == sig[3] == sig[4]
    assert sig[0] != sig[1] and sig[0] != sig[2]


@pytest.mark.parametrize(
    "async_scheduling,materialization,prefix_caching",
    COMBOS,
    ids=[f"{'async' if a else 'sync'}-{m}-{'pc' if c else 'nopc'}" for a, m, c in COMBOS],
)
def test_switches_do_not_change_outputs(
    reference, async_scheduling, materialization, prefix_caching
) -> None:
    _, expected = reference
    with OmniPipeline(
        async_scheduling=async_scheduling,
        materialization=materialization,
        prefix_caching=prefix_caching,
    ) as p:
        results = run_workload(p)
        assert p.is_clean(), p.leftovers()
    # With caching on, the repeated prompts really hit the thinker's and the talker's prefix
    # caches (so the equality above covers C-55's merge path); with caching off nothing does.
    second_wave = results[len(PROMPTS) :]
    for stage in ("thinker", "talker"):
        hits = [r.cached_prompt_tokens.get(stage, 0) for r in second_wave]
        assert (min(hits) >= 16) if prefix_caching else (max(hits) == 0), (stage, hits)
    assert signature(results) == signature(expected)


def test_streamed_audio_equals_whole_decode(reference) -> None:
    p, _ = reference
    events = list(p.stream([PREFIX + "stream me"], max_text_tokens=4, max_codec_tokens=40))
    audio = [e.audio for e in events if e.kind == "audio"]
    finished = [e for e in events if e.kind == "finished"]
    assert len(finished) == 1 and events[-1] is finished[0]
    result = finished[0].result
    assert result.ok
    # Several chunks, each produced before the request's outcome (talker still running).
    assert len(audio) >= 3
    assert [a.seq for a in audio] == list(range(len(audio)))
    streamed = torch.cat([a.samples for a in audio])
    assert torch.equal(streamed, result.waveform)
    whole = p.orchestrator.code2wav.decode(result.audio_codes)
    torch.testing.assert_close(streamed, whole, atol=1e-6, rtol=0)
    codes = torch.cat([a.codes for a in audio]).tolist()
    assert codes == result.audio_codes == [c for c in result.codec_token_ids if c < 256]
    p.drain()
    assert p.is_clean(), p.leftovers()


def test_text_only_requests_never_reach_the_talker(reference, monkeypatch) -> None:
    p, _ = reference
    orch = p.orchestrator
    admitted: list[str] = []
    talker = orch.engines["talker"]
    original_add = talker.add

    def spy(item):
        admitted.append(item.request_id)
        return original_add(item)

    monkeypatch.setattr(talker, "add", spy)
    sent_before = orch.connectors["thinker"].sent
    results = p.generate([PREFIX + "Hello", "just text"], max_text_tokens=5, text_only=True)
    assert admitted == []
    assert orch.connectors["thinker"].sent == sent_before
    for r in results:
        assert r.ok and r.stages == ["thinker"] and r.final_stage == "thinker"
        assert r.waveform is None and r.codec_token_ids == [] and r.num_audio_chunks == 0
        assert len(r.text_token_ids) >= 1
    # Positive control: a full request in the same pipeline does reach the talker.
    full = p.generate(["to the talker"], max_text_tokens=3, max_codec_tokens=4)
    assert admitted == [full[0].request_id]
    p.drain()
    assert p.is_clean(), p.leftovers()


def test_bad_input_is_rejected_without_disturbing_others(reference) -> None:
    p, _ = reference
    ok_ids = p.submit(["fine"], max_text_tokens=3, max_codec_tokens=4, request_ids=["ok"])
    with pytest.raises(RequestRejected, match="empty prompt"):
        p.submit([[]], request_ids=["empty"])
    with pytest.raises(RequestRejected, match=r"long.*exceed max_model_len|exceed max_model_len"):
        p.submit(["x" * 600], request_ids=["long"])
    with pytest.raises(RequestRejected, match="duplicate"):
        p.submit(["again"], request_ids=["ok"])
    with pytest.raises(RequestRejected, match=r"prompt_token_ids\[1\]"):
        p.submit([[1, 9999]], request_ids=["oov"])
    assert p.abort(["no-such-request"]) == []
    # All or nothing: a batch with one bad prompt admits none of them.
    with pytest.raises(RequestRejected, match="empty prompt"):
        p.submit(["fine too", []], request_ids=["batch-ok", "batch-bad"])
    events = p.drain()
    outcomes = [e.result for e in events if e.kind == "finished"]
    assert [r.request_id for r in outcomes] == ok_ids
    assert outcomes[0].ok
    assert p.is_clean(), p.leftovers()


def test_pipe_connector_crosses_a_process_and_matches(reference) -> None:
    _, expected = reference
    with OmniPipeline(async_scheduling=True, connector="pipe") as p:
        conns = p.orchestrator.connectors
        assert all(isinstance(c, PipeConnector) for c in conns.values())
        pids = {c.child_pid for c in conns.values()}
        assert os.getpid() not in pids and all(c.process.is_alive() for c in conns.values())
        results = run_workload(p)
        assert all(c.sent == c.received > 0 for c in conns.values())
        assert p.is_clean(), p.leftovers()
        processes = [c.process for c in conns.values()]
    assert signature(results) == signature(expected)
    assert not any(proc.is_alive() for proc in processes)


def test_chunk_serialisation_round_trip() -> None:
    payload = StagePayload(
        "r",
        3,
        2,
        hidden=torch.randn(2, 4),
        conditioning=torch.randn(4),
        multimodal={"m": torch.arange(6, dtype=torch.int32).reshape(2, 3)},
    )
    chunk = StageChunk(
        "r",
        "thinker",
        1,
        (5, 6),
        payload,
        {"hidden": payload.hidden, "start": 3, "x": torch.ones(2, dtype=torch.bfloat16)},
        True,
        "stop",
    )
    back = decode_chunk(encode_chunk(chunk))
    assert (back.request_id, back.seq, back.token_ids, back.is_final, back.finish_reason) == (
        "r",
        1,
        (5, 6),
        True,
        "stop",
    )
    assert torch.equal(back.payload.hidden, payload.hidden)
    assert torch.equal(back.payload.multimodal["m"], payload.multimodal["m"])
    assert back.data["x"].dtype == torch.bfloat16 and back.data["start"] == 3


def test_default_graph_and_override(tmp_path) -> None:
    cfg = load_pipeline_config()
    assert cfg.stage_ids == ("thinker", "talker", "code2wav")
    assert cfg.downstream_of("thinker") == "talker" and cfg.downstream_of("talker") == "code2wav"
    raw = json.loads(open(cfg.source).read())
    raw["stages"][1]["downstream"] = []
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(raw))
    with pytest.raises(PipelineConfigError, match=r"talker.*downstream"):
        PipelineConfig.load(bad)
    raw = json.loads(open(cfg.source).read())
    raw["defaults"]["max_codec_tokens"] = 5
    good = tmp_path / "good.json"
    good.write_text(json.dumps(raw))
    assert PipelineConfig.load(good).defaults["max_codec_tokens"] == 5


def test_pipeline_equals_cacheless_reference(reference) -> None:
    """The whole pipeline against a full-recompute torch reference with no vLLM in it.

    Reference: thinker greedy ids; the thinker's final-normed hidden states of prompt and
    generated positions (all but the last sampled token) followed by the talker's embedding of
    its start token form the talker prompt; talker greedy codec ids; whole-sequence decode.
    """
    from omni_runtime.models import CODEC_BOS_ID, CODEC_EOS_ID, load_model, reference_attention

    p, results = reference
    thinker, talker, c2w = (load_model(n) for n in ("thinker", "talker", "code2wav"))
    for r in results[:3]:
        prompt = torch.tensor(r.prompt_token_ids)
        with torch.no_grad():
            ids = thinker.greedy_generate(prompt, MAX_TEXT, stop_at_eos=True).tolist()
            assert ids == r.text_token_ids
            seq = torch.cat((prompt, torch.tensor(ids[:-1], dtype=torch.long)))
            hidden = thinker.forward_layers(
                thinker.embed(seq),
                torch.arange(seq.numel()),
                lambda _, q, k, v: reference_attention(q, k, v),
            )
            embeds = torch.cat((hidden, talker.embed(torch.tensor([CODEC_BOS_ID]))))
            codec = talker.greedy_generate_from_embeds(
                embeds, MAX_CODEC, stop_at_eos=True, eos_token_id=CODEC_EOS_ID
            ).tolist()
        assert codec == r.codec_token_ids
        audio = [c for c in codec if c < 256]
        torch.testing.assert_close(r.waveform, c2w.decode(audio), atol=1e-6, rtol=0)


def test_generate_alongside_earlier_requests_keeps_their_events(reference) -> None:
    """Events of requests a ``generate`` call did not start are held for ``step``/``drain``:
    every request still gets exactly one outcome."""
    p, _ = reference
    [early] = p.submit([PREFIX + "early"], max_text_tokens=MAX_TEXT, max_codec_tokens=MAX_CODEC)
    first = p.step()
    assert {e.request_id for e in first} <= {early}
    [mine] = p.generate(["mine"], max_text_tokens=2, max_codec_tokens=4)
    assert mine.ok and mine.request_id != early
    rest = p.drain()
    outcomes = [e for e in first + rest if e.kind == "finished"]
    assert [e.request_id for e in outcomes] == [early] and outcomes[0].result.ok
    texts = [tid for e in first + rest if e.kind == "text" for tid in e.token_ids]
    assert texts == outcomes[0].result.text_token_ids
    assert p.is_clean(), p.leftovers()
