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
import time
from collections.abc import Iterator

import pytest
import torch

from omni_runtime.adapters.shm_wire import (
    ShmChunkWriter,
    ShmEngineCoreOutputs,
    live_segments,
    read_chunks,
    release_descriptors,
)
from omni_runtime.engine.backends import make_stage_engine
from omni_runtime.engine.config import EngineOptions
from omni_runtime.engine.mp_stage import MPStageEngine
from omni_runtime.engine.stage import StageEngine
from omni_runtime.payload import StageChunk, StagePayload
from tests.backend_parity import (
    CONFIG,
    PROMPTS,
    SWITCHES,
    THINKER,
    abort_signature,
    assert_same_as_inprocess,
    check_abort_mid_stream,
    check_bad_input_refused,
    check_killed_fails_held,
    check_refused_chunk,
    chunk_key,
    chunks_by_request,
    fault_outcomes,
    pipeline_signature,
    run_stage,
    settled_clean,
    stage_inputs,
)


def _our_segments() -> list[str]:
    return live_segments(f"omni-{os.getpid()}-")


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
    assert [chunk_key(c) for c in back] == [chunk_key(c) for c in chunks]
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
            results[backend] = run_stage(engine, stage_inputs())
            assert not any(settled_clean(engine).values()), engine.leftovers()
        finally:
            engine.shutdown()
    ref, mp = results["inprocess"], results["multiprocess"]
    assert isinstance(ref["ids"], dict) and len(ref["ids"]) == len(PROMPTS)
    assert mp["ids"] == ref["ids"]
    assert mp["reasons"] == ref["reasons"]
    # Every output of a request carries the tracing context its client sent, on both backends.
    sent = {i.request_id: {tuple(sorted(i.trace_headers.items()))} for i in stage_inputs()}
    assert ref["traces"] == sent and mp["traces"] == sent
    assert chunks_by_request(mp["chunks"]) == chunks_by_request(ref["chunks"])
    # The comparison has teeth: payload tensors did cross (or, token-only, none did).
    with_rows = [
        c for c in ref["chunks"] if isinstance(c.data, dict) and c.data["hidden"] is not None
    ]
    assert bool(with_rows) == include_hidden
    assert {c.request_id for c in ref["chunks"]} == {"r0", "r1", "r3", "r4"}


def test_a_request_of_another_client_is_served_as_in_process():
    """A stage input from a second API client (``client_index`` 1) is served by a stage process
    as by an in-process stage. Before, its outputs were routed to a client socket the stage
    process does not have, and the stage never finished the request."""
    items = [dataclasses.replace(i, client_index=1) for i in stage_inputs(n=2)]
    results = {}
    for backend in ("inprocess", "multiprocess"):
        engine = make_stage_engine(
            THINKER, CONFIG.stage_ids, EngineOptions(async_scheduling=False, backend=backend)
        )
        try:
            results[backend] = run_stage(engine, items, timeout=60.0)
        finally:
            engine.shutdown()
    ref, mp = results["inprocess"], results["multiprocess"]
    assert set(ref["ids"]) == {"r0", "r1"}
    assert mp["ids"] == ref["ids"] and mp["reasons"] == ref["reasons"]


def test_bad_input_is_refused_before_it_crosses(mp_thinker):
    check_bad_input_refused(mp_thinker)


# ---- abort, connector fault, death -----------------------------------------------------------


def test_abort_mid_stream_releases_everything(mp_thinker):
    check_abort_mid_stream(mp_thinker)


def test_a_refused_chunk_fails_only_its_request(mp_thinker):
    check_refused_chunk(mp_thinker)


def test_killed_process_fails_exactly_its_requests_then_serves_again(mp_thinker):
    check_killed_fails_held(mp_thinker)


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
        ref = fault_outcomes(ref_engine, stage_inputs(n=4), times, where)
        ref_after = run_stage(ref_engine, stage_inputs(n=2))
    finally:
        ref_engine.shutdown()
    engine = MPStageEngine(THINKER, CONFIG.stage_ids, options)
    try:
        pid = engine.pid
        got = fault_outcomes(engine, stage_inputs(n=4), times, where)
        after = run_stage(engine, stage_inputs(n=2))
        assert engine.pid == pid and engine.restarts == 0  # contained: no process died
        assert not any(settled_clean(engine).values())
    finally:
        engine.shutdown()
    assert got == ref
    assert (after["ids"], after["reasons"]) == (ref_after["ids"], ref_after["reasons"])
    assert chunks_by_request(after["chunks"]) == chunks_by_request(ref_after["chunks"])
    failed = {rid for rid, (reason, _, _) in got.items() if reason == "error"}
    if where == "model":
        assert failed == ({"r3"} if times is None else set())
    else:
        assert "r3" in failed  # the step's requests, whichever shared it
    injected = "InjectedModelFault" if where == "model" else "InjectedStageFault"
    for rid in failed:
        assert "thinker" in got[rid][1] and injected in got[rid][1]


def test_pipeline_abort_mid_audio_leaves_survivors_as_in_process() -> None:
    """Two of four requests aborted while their audio streams: they end "abort", the others
    are byte-identical to in-process, and nothing is left in any stage."""
    ref = abort_signature("inprocess")
    got = abort_signature("multiprocess")
    assert got == ref
    assert sorted(v for v in got.values() if isinstance(v, str)) == ["abort", "abort"]
