"""A stage in its own process (``MPStageEngine``) against the in-process ``StageEngine``.

What these tests prove, and how each can fail:

* Parity — the thinker driven through its own process gives the same sampled ids and the same
  chunks, payload tensors compared byte for byte, as in process, under sync and async scheduling
  and with hidden rows on and off (token-only). A chunk lost, reordered, re-sequenced or with
  one bit of a row changed on the shared-memory path fails it; so does a batch admitted in
  pieces (the rows' last bits depend on the batch shape).
* The whole pipeline with every AR stage in its own process gives the in-process text ids,
  codec ids and waveform bytes (``tests.backend_parity``, shared with the Ray backend's tests).
* Abort mid-stream: the aborted requests leave the engine process, the others finish, and no
  shared-memory segment and no request state is left.
* Death: killing the engine process fails exactly the requests it held, with reason "error"
  and a message naming the stage; the stage restarts and a new request completes with the
  in-process result. The old process is reaped and its segments swept.
* A sink (connector) that refuses one request's chunk fails only that request (C-61).
* Afterwards no process this test started is alive and nothing of ours is in /dev/shm.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from vllm import SamplingParams

from omni_runtime.adapters.input import RequestRejected, StageInput
from omni_runtime.adapters.shm_wire import (
    ShmChunkWriter,
    ShmEngineCoreOutputs,
    live_segments,
    read_chunks,
    release_descriptors,
)
from omni_runtime.engine.backends import make_stage_engine
from omni_runtime.engine.config import EngineOptions
from omni_runtime.engine.graph import load_pipeline_config
from omni_runtime.engine.mp_stage import MPStageEngine
from omni_runtime.engine.stage import StageEngine
from omni_runtime.payload import StageChunk, StagePayload
from omni_runtime.sched.transfer import OutboxSink
from tests.backend_parity import (
    SWITCHES,
    abort_signature,
    assert_same_as_inprocess,
    fault_outcomes,
    pipeline_signature,
)

CONFIG = load_pipeline_config()
THINKER = CONFIG.ar_stages[0]
PROMPTS = [[3 + i] * (5 + 7 * i) for i in range(4)] + [[9, 8, 7, 6, 5, 4, 3, 2, 1, 11]]


def _inputs(max_tokens: int = 6, n: int = len(PROMPTS)) -> list[StageInput]:
    # Alternate final stages: requests that end at the thinker make no chunks (C-42).
    return [
        StageInput(
            request_id=f"r{i}",
            sampling_params=SamplingParams(
                max_tokens=max_tokens, temperature=0.0, stop_token_ids=[2], detokenize=False
            ),
            prompt_token_ids=PROMPTS[i % len(PROMPTS)],
            final_stage_id="thinker" if i % 3 == 2 else "code2wav",
        )
        for i in range(n)
    ]


def _canon(value: Any) -> Any:
    """A comparable form of chunk data: tensors as (dtype, shape, bytes)."""
    if isinstance(value, torch.Tensor):
        raw = value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return ("tensor", str(value.dtype), tuple(value.shape), raw)
    if isinstance(value, StagePayload):
        return (
            "payload",
            value.request_id,
            value.start,
            value.num_tokens,
            _canon(value.hidden),
            _canon(value.conditioning),
            sorted((k, _canon(v)) for k, v in value.multimodal.items()),
        )
    if isinstance(value, dict):
        return ("dict", sorted((k, _canon(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return (type(value).__name__, [_canon(v) for v in value])
    return value


def _chunk_key(c: StageChunk) -> tuple[Any, ...]:
    return (
        c.request_id,
        c.source_stage,
        c.seq,
        c.token_ids,
        c.is_final,
        c.finish_reason,
        _canon(c.payload),
        _canon(c.data),
    )


def _run(engine: Any, items: list[StageInput], timeout: float = 60.0) -> dict[str, Any]:
    sink = OutboxSink()
    if engine.spec.downstream:
        engine.set_sink(sink)
    for item in items:
        engine.add(item)
    ids: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    chunks: list[StageChunk] = []
    deadline = time.monotonic() + timeout
    while engine.has_work():
        assert time.monotonic() < deadline, "stage did not finish"
        for out in engine.step().outputs:
            ids.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
        chunks.extend(sink.drain())
    return {"ids": ids, "reasons": reasons, "chunks": chunks}


def _by_request(chunks: list[StageChunk]) -> dict[str, list[tuple[Any, ...]]]:
    out: dict[str, list[tuple[Any, ...]]] = {}
    for c in chunks:
        out.setdefault(c.request_id, []).append(_chunk_key(c))
    return out


def _our_segments() -> list[str]:
    return live_segments(f"omni-{os.getpid()}-")


def _settled_clean(engine: Any, timeout: float = 5.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    left = engine.leftovers()
    while any(left.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
        left = engine.leftovers()
    return left


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Every engine process this test started is gone afterwards, and so are our segments."""
    before = {p.pid for p in multiprocessing.active_children()}
    yield
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        extra = [p for p in multiprocessing.active_children() if p.pid not in before]
        if not extra:
            break
        time.sleep(0.1)
    assert not extra, f"processes left running: {extra}"
    assert not _our_segments()


@pytest.fixture
def mp_thinker() -> Iterator[MPStageEngine]:
    engine = MPStageEngine(THINKER, CONFIG.stage_ids, EngineOptions(async_scheduling=False))
    try:
        yield engine
    finally:
        engine.shutdown()


# ---- the wire ---------------------------------------------------------------------------------


def test_shm_wire_round_trip_copies_once_and_releases():
    writer = ShmChunkWriter(f"omni-{os.getpid()}-wire")
    hidden = torch.randn(3, 8)[:, ::2]  # not contiguous
    payload = StagePayload("a", 4, 3, hidden, {"mm": torch.arange(6, dtype=torch.int16)}, None)
    chunks = [
        StageChunk("a", "thinker", 0, (1, 2), payload, payload, False),
        StageChunk(
            "a",
            "thinker",
            1,
            (),
            None,
            {"x": (torch.ones(2, dtype=torch.bfloat16), [1, 2.5, None]), "e": torch.empty(0, 4)},
            True,
            "stop",
        ),
        StageChunk("b", "thinker", 0, (), None, None, True, "abort"),
    ]
    for c in chunks:
        writer.send(c)
    descriptors = writer.flush()
    assert len({d.segment for d in descriptors if d.segment}) == 1  # one segment per step
    assert live_segments(writer.prefix)
    back = read_chunks(ShmEngineCoreOutputs(omni_chunks=descriptors).omni_chunks or [])
    assert not live_segments(writer.prefix)
    assert [_chunk_key(c) for c in back] == [_chunk_key(c) for c in chunks]
    assert back[0].data is back[0].payload  # identity of "data is the payload" survives
    assert isinstance(back[1].data["x"], tuple)


def test_shm_wire_refuses_what_cannot_cross_and_drops_cleanly():
    writer = ShmChunkWriter(f"omni-{os.getpid()}-wire")
    with pytest.raises(TypeError, match="cannot cross"):
        writer.send(StageChunk("a", "thinker", 0, (), None, object(), False))
    writer.send(StageChunk("a", "thinker", 0, (), None, torch.ones(3), False))
    writer.discard()
    assert writer.flush() == []
    writer.send(StageChunk("a", "thinker", 0, (), None, torch.ones(3), False))
    release_descriptors(writer.flush())  # a message nobody reads
    assert not live_segments(writer.prefix)


# ---- parity ----------------------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("include_hidden", [True, False], ids=["hidden", "token-only"])
def test_thinker_outputs_and_chunks_are_bit_identical(async_scheduling, include_hidden):
    spec = dataclasses.replace(THINKER, include_hidden=include_hidden)
    options = EngineOptions(async_scheduling=async_scheduling)
    results = {}
    for backend in ("inprocess", "multiprocess"):
        engine = make_stage_engine(
            spec, CONFIG.stage_ids, dataclasses.replace(options, backend=backend)
        )
        try:
            results[backend] = _run(engine, _inputs())
            assert not any(_settled_clean(engine).values()), engine.leftovers()
        finally:
            engine.shutdown()
    ref, mp = results["inprocess"], results["multiprocess"]
    assert isinstance(ref["ids"], dict) and len(ref["ids"]) == len(PROMPTS)
    assert mp["ids"] == ref["ids"]
    assert mp["reasons"] == ref["reasons"]
    assert _by_request(mp["chunks"]) == _by_request(ref["chunks"])
    # The comparison has teeth: payload tensors did cross (or, token-only, none did).
    with_rows = [
        c for c in ref["chunks"] if isinstance(c.data, dict) and c.data["hidden"] is not None
    ]
    assert bool(with_rows) == include_hidden
    assert {c.request_id for c in ref["chunks"]} == {"r0", "r1", "r3", "r4"}


def test_bad_input_is_refused_before_it_crosses(mp_thinker):
    bad = _inputs(n=1)[0]
    bad.prompt_token_ids = [10**9]
    with pytest.raises(RequestRejected, match="prompt_token_ids"):
        mp_thinker.add(bad)
    assert not mp_thinker.has_work()
    assert not any(mp_thinker.leftovers().values())


# ---- abort, connector fault, death -----------------------------------------------------------


def test_abort_mid_stream_releases_everything(mp_thinker):
    sink = OutboxSink()
    mp_thinker.set_sink(sink)
    items = _inputs(max_tokens=200, n=4)
    for item in items:
        item.sampling_params.stop_token_ids = []
        mp_thinker.add(item)
    seen: set[str] = set()
    deadline = time.monotonic() + 30
    while len({c.request_id for c in sink.drain()} | seen) < 2 or not seen:
        assert time.monotonic() < deadline
        seen |= {o.request_id for o in mp_thinker.step().outputs if o.new_token_ids}
    assert mp_thinker.abort(["r0", "r3", "nope"]) == ["r0", "r3"]
    reasons: dict[str, str] = {}
    while mp_thinker.has_work():
        assert time.monotonic() < deadline
        for out in mp_thinker.step().outputs:
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
        sink.drain()
    assert reasons == {"r1": "length", "r2": "length"}
    left = _settled_clean(mp_thinker)
    assert not any(left.values()), left
    assert not live_segments(mp_thinker.shm_prefix)


def test_a_refused_chunk_fails_only_its_request(mp_thinker):
    class Refusing(OutboxSink):
        def send(self, chunk: StageChunk) -> None:
            if chunk.request_id == "r1":
                raise OSError("connector down")
            super().send(chunk)

    sink = Refusing()
    mp_thinker.set_sink(sink)
    for item in _inputs(n=4):
        mp_thinker.add(item)
    outcome: dict[str, tuple[str, str | None]] = {}
    while mp_thinker.has_work():
        for out in mp_thinker.step().outputs:
            if out.finish_reason is not None:
                outcome.setdefault(out.request_id, (out.finish_reason, out.error))
    assert outcome["r1"][0] == "error" and "thinker" in (outcome["r1"][1] or "")
    assert {rid for rid, (reason, _) in outcome.items() if reason == "error"} == {"r1"}
    assert {c.request_id for c in sink.drain()} == {"r0", "r3"}
    assert not any(_settled_clean(mp_thinker).values())


def test_killed_process_fails_exactly_its_requests_then_serves_again(mp_thinker):
    sink = OutboxSink()
    mp_thinker.set_sink(sink)
    items = _inputs(max_tokens=400, n=3)
    for item in items:
        item.sampling_params.stop_token_ids = []
        mp_thinker.add(item)
    short = _inputs(max_tokens=2, n=1)[0]
    short.request_id = "short"
    mp_thinker.add(short)
    deadline = time.monotonic() + 30
    done_before: set[str] = set()
    while "short" not in done_before:
        assert time.monotonic() < deadline
        done_before |= {o.request_id for o in mp_thinker.step().outputs if o.finish_reason}
    assert done_before == {"short"}
    old_pid, old_prefix = mp_thinker.pid, mp_thinker.shm_prefix
    assert old_pid is not None
    os.kill(old_pid, signal.SIGKILL)
    failed: dict[str, str | None] = {}
    finished_ok: set[str] = set()
    while mp_thinker.has_work():
        assert time.monotonic() < deadline
        for out in mp_thinker.step().outputs:
            if out.finish_reason == "error":
                failed[out.request_id] = out.error
            elif out.finish_reason is not None:
                finished_ok.add(out.request_id)
    # Exactly the requests the process held: not the one that had finished before the kill.
    assert sorted(failed) == ["r0", "r1", "r2"] and not finished_ok
    assert all("thinker" in (e or "") and "died" in (e or "") for e in failed.values())
    assert mp_thinker.restarts == 1 and mp_thinker.pid not in (None, old_pid)
    assert not live_segments(old_prefix)
    assert old_pid not in {p.pid for p in multiprocessing.active_children()}

    # The restarted stage serves a new request, with the in-process result.
    new = _inputs(n=1)[0]
    new.request_id = "after"
    again = _run(mp_thinker, [new])
    ref_engine = StageEngine(THINKER, CONFIG.stage_ids, EngineOptions(async_scheduling=False))
    try:
        ref = _run(
            ref_engine, [dataclasses.replace(new, sampling_params=new.sampling_params.clone())]
        )
    finally:
        ref_engine.shutdown()
    assert again["ids"] == ref["ids"] and again["reasons"] == ref["reasons"]
    assert _by_request(again["chunks"]) == _by_request(ref["chunks"])
    assert not any(_settled_clean(mp_thinker).values())


# ---- the whole pipeline ----------------------------------------------------------------------


@pytest.mark.parametrize("switches", SWITCHES)
def test_pipeline_is_bit_identical_with_every_stage_in_its_own_process(switches):
    ref = pipeline_signature(switches, "inprocess")
    assert_same_as_inprocess(ref, pipeline_signature(switches, "multiprocess"))


# ---- worker faults ---------------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("times", [None, 1], ids=["persistent", "one-off"])
@pytest.mark.parametrize("where", ["model", "step"])
def test_worker_faults_are_contained_as_in_process(where, times, async_scheduling, monkeypatch):
    """``model``: a fault the runner recovers from in the engine process. ``step``: a fault
    outside the runner, which vLLM's engine loop would treat as fatal (the whole process and
    every request it holds); ``FaultContainingExecutor`` fails just the step's requests, as in
    process, and the process keeps serving."""
    # vLLM pickles a callable for its collective_rpc only when allowed; the child inherits it.
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    options = EngineOptions(async_scheduling=async_scheduling)
    ref_engine = StageEngine(THINKER, CONFIG.stage_ids, options)
    try:
        ref = fault_outcomes(ref_engine, _inputs(n=4), times, where)
        ref_after = _run(ref_engine, _inputs(n=2))
    finally:
        ref_engine.shutdown()
    engine = MPStageEngine(THINKER, CONFIG.stage_ids, options)
    try:
        pid = engine.pid
        got = fault_outcomes(engine, _inputs(n=4), times, where)
        after = _run(engine, _inputs(n=2))
        assert engine.pid == pid and engine.restarts == 0  # contained: no process died
        assert not any(_settled_clean(engine).values())
    finally:
        engine.shutdown()
    assert got == ref
    assert (after["ids"], after["reasons"]) == (ref_after["ids"], ref_after["reasons"])
    assert _by_request(after["chunks"]) == _by_request(ref_after["chunks"])
    failed = {rid for rid, (reason, _, _) in got.items() if reason == "error"}
    if where == "model":
        assert failed == ({"r3"} if times is None else set())
    else:
        assert "r3" in failed  # the step's requests, whichever shared it
    for rid in failed:
        assert "thinker" in got[rid][1] and "InjectedStageFault" in got[rid][1]


def test_pipeline_abort_mid_audio_leaves_survivors_as_in_process() -> None:
    """Two of four requests aborted while their audio streams: they end "abort", the others
    are byte-identical to in-process, and nothing is left in any stage."""
    ref = abort_signature("inprocess")
    got = abort_signature("multiprocess")
    assert got == ref
    assert sorted(v for v in got.values() if isinstance(v, str)) == ["abort", "abort"]
