"""What every stage backend must reproduce: the whole pipeline's outputs, bit for bit.

``pipeline_signature`` runs one fixed workload (three prompts, then the first again so that with
prefix caching on the second wave hits cached blocks) through ``OmniPipeline`` with the given
switches on the given backend, checks that every engine is of the backend's class and that the
pipeline is clean afterwards, and returns per request the text ids, codec ids and waveform
bytes. Backend tests compare it against the in-process run.

``fault_outcomes`` plants a model fault in a stage's worker wherever it runs (``call_worker``,
vLLM's ``collective_rpc``) and returns every request's outcome, so a backend's fault handling can
be compared with the in-process one's.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from typing import Any

import psutil
import pytest
import torch
from vllm import SamplingParams

from omni_runtime.adapters.input import RequestRejected, StageInput
from omni_runtime.adapters.shm_wire import live_segments
from omni_runtime.engine.config import EngineOptions
from omni_runtime.engine.graph import load_pipeline_config
from omni_runtime.engine.stage import StageEngine
from omni_runtime.payload import StageChunk, StagePayload
from omni_runtime.sched.transfer import OutboxSink

SWITCHES = [
    pytest.param({"async_scheduling": False}, id="sync"),
    pytest.param({"async_scheduling": True}, id="async", marks=pytest.mark.slow),
    pytest.param(
        {"async_scheduling": True, "materialization": "background", "prefix_caching": False},
        id="async-background-nocache",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        {"async_scheduling": False, "materialization": "background", "connector": "pipe"},
        id="sync-background-pipe",
        marks=pytest.mark.slow,
    ),
]

_ENGINE_CLASS = {
    "inprocess": "StageEngine",
    "multiprocess": "MPStageEngine",
    "ray": "RayStageEngine",
}


CONFIG = load_pipeline_config()
THINKER = CONFIG.ar_stages[0]
PROMPTS = [[3 + i] * (5 + 7 * i) for i in range(4)] + [[9, 8, 7, 6, 5, 4, 3, 2, 1, 11]]


def stage_inputs(max_tokens: int = 6, n: int = len(PROMPTS)) -> list[StageInput]:
    # Alternate final stages: requests that end at the thinker make no chunks (C-42).
    return [
        StageInput(
            request_id=f"r{i}",
            sampling_params=SamplingParams(
                max_tokens=max_tokens, temperature=0.0, stop_token_ids=[2], detokenize=False
            ),
            prompt_token_ids=PROMPTS[i % len(PROMPTS)],
            final_stage_id="thinker" if i % 3 == 2 else "code2wav",
            # A client's tracing context: vLLM hands it back on every output of the request.
            trace_headers={"traceparent": f"00-{i + 1:032x}-{i + 1:016x}-01"},
        )
        for i in range(n)
    ]


def canon(value: Any) -> Any:
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
            canon(value.hidden),
            canon(value.conditioning),
            sorted((k, canon(v)) for k, v in value.multimodal.items()),
        )
    if isinstance(value, dict):
        return ("dict", sorted((k, canon(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return (type(value).__name__, [canon(v) for v in value])
    return value


def chunk_key(c: StageChunk) -> tuple[Any, ...]:
    return (
        c.request_id,
        c.source_stage,
        c.seq,
        c.token_ids,
        c.is_final,
        c.finish_reason,
        canon(c.payload),
        canon(c.data),
    )


def run_stage(engine: Any, items: list[StageInput], timeout: float = 60.0) -> dict[str, Any]:
    sink = OutboxSink()
    if engine.spec.downstream:
        engine.set_sink(sink)
    for item in items:
        engine.add(item)
    ids: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    traces: dict[str, set[Any]] = {}
    chunks: list[StageChunk] = []
    deadline = time.monotonic() + timeout
    while engine.has_work():
        assert time.monotonic() < deadline, "stage did not finish"
        for out in engine.step().outputs:
            ids.setdefault(out.request_id, []).extend(out.new_token_ids)
            headers = out.trace_headers
            traces.setdefault(out.request_id, set()).add(
                None if headers is None else tuple(sorted(headers.items()))
            )
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
        chunks.extend(sink.drain())
    return {"ids": ids, "reasons": reasons, "traces": traces, "chunks": chunks}


def chunks_by_request(chunks: list[StageChunk]) -> dict[str, list[tuple[Any, ...]]]:
    out: dict[str, list[tuple[Any, ...]]] = {}
    for c in chunks:
        out.setdefault(c.request_id, []).append(chunk_key(c))
    return out


def settled_clean(engine: Any, timeout: float = 5.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    left = engine.leftovers()
    while any(left.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
        left = engine.leftovers()
    return left


def pipeline_signature(switches: dict[str, Any], backend: str, **kwargs: Any) -> list[Any]:
    from omni_runtime.engine import OmniPipeline

    prefix = "The quick brown fox jumps over the lazy dog. "
    prompts = [prefix + "Hello", "short", prefix + "Goodbye now"]
    with OmniPipeline(**switches, backend=backend, **kwargs) as p:  # type: ignore[arg-type]
        kinds = {type(e).__name__ for e in p.orchestrator.engines.values()}
        assert kinds == {_ENGINE_CLASS[backend]}
        results = p.generate(prompts, max_text_tokens=6, max_codec_tokens=24)
        results += p.generate(prompts[:1], max_text_tokens=6, max_codec_tokens=24)
        p.drain()
        deadline = time.monotonic() + 10
        while not p.orchestrator.is_clean() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.orchestrator.is_clean(), p.orchestrator.leftovers()
    assert all(r.ok for r in results), [(r.finish_reason, r.error) for r in results]
    return [(r.text_token_ids, r.codec_token_ids, r.waveform.numpy().tobytes()) for r in results]


def assert_same_as_inprocess(ref: list[Any], other: list[Any]) -> None:
    assert other == ref
    assert ref[0] == ref[3]  # the same prompt twice (the second from the prefix cache)
    assert len({tuple(r[0]) for r in ref[:3]}) == 3  # different prompts differ


# ---- worker faults, wherever the worker runs ------------------------------------------------

POISON = 300  # a token id none of the backend tests' prompts use


class InjectedStageFault(RuntimeError):
    """Raised by the planted step fault (outside the model runner)."""


def plant_poison(worker: Any, poison: int, times: int | None) -> None:
    """Runs on the worker (``call_worker``): the gate's C-61 poison hook (``poisoned`` from
    ``invariants.test_reliability``) planted in the worker's token embedding, kept until
    ``clear_poison``. Replaces an earlier planting."""
    from invariants.test_reliability import poisoned

    clear_poison(worker)
    embedding = worker.get_model().get_input_embeddings()
    planted = poisoned(embedding, poison, times)
    planted.__enter__()
    embedding._omni_test_poison = planted


def clear_poison(worker: Any) -> None:
    embedding = worker.get_model().get_input_embeddings()
    planted = getattr(embedding, "_omni_test_poison", None)
    if planted is not None:
        del embedding._omni_test_poison
        planted.__exit__(None, None, None)


def plant_step_fault(wrapper: Any, request_id: str, times: int | None) -> None:
    """Runs on the worker (``call_worker``): the worker's ``execute_model`` (outside the model
    runner and its own recovery) raises for steps that schedule ``request_id`` (at most
    ``times`` times; None: always)."""
    worker = wrapper.worker
    clear_step_fault(wrapper)
    original = worker.execute_model
    raised = [0]

    def execute_model(scheduler_output: Any) -> Any:
        if request_id in scheduler_output.num_scheduled_tokens and (
            times is None or raised[0] < times
        ):
            raised[0] += 1
            raise InjectedStageFault(f"step fault outside the runner with {request_id}")
        return original(scheduler_output)

    worker.execute_model = execute_model
    worker._omni_test_step_fault = original


def clear_step_fault(wrapper: Any) -> None:
    worker = wrapper.worker
    if worker.__dict__.pop("_omni_test_step_fault", None) is not None:
        del worker.execute_model  # the class's method again


def fault_outcomes(
    engine: Any, items: list[Any], times: int | None, where: str = "model"
) -> dict[str, Any]:
    """Every request's (finish reason, error, sampled ids) with a fault planted in ``engine``'s
    worker against the last item: ``where="model"`` poisons the token embedding (the runner
    recovers), ``"step"`` makes the worker's ``execute_model`` raise (outside the runner)."""
    items = [dataclasses.replace(i, sampling_params=i.sampling_params.clone()) for i in items]
    target = items[-1]
    if where == "model":
        target.prompt_token_ids = [*target.prompt_token_ids, POISON]
        engine.call_worker(plant_poison, POISON, times)
    else:
        engine.call_worker(plant_step_fault, target.request_id, times)
    try:
        for item in items:
            engine.add(item)
        ids: dict[str, list[int]] = {}
        outcome: dict[str, Any] = {}
        deadline = time.monotonic() + 120
        while engine.has_work():
            assert time.monotonic() < deadline, "stage did not finish"
            for out in engine.step().outputs:
                ids.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    outcome[out.request_id] = (out.finish_reason, out.error)
    finally:
        engine.call_worker(clear_poison if where == "model" else clear_step_fault)
    return {rid: (*outcome[rid], ids.get(rid, [])) for rid in sorted(outcome)}


def abort_signature(backend: str, **kwargs: Any) -> dict[str, Any]:
    """Four requests; once every one has audio, two are aborted and the rest run to the end.
    Returns each request's outcome, and for the survivors their text ids, codec ids and
    waveform bytes; the pipeline must be clean afterwards."""
    from omni_runtime.engine import OmniPipeline

    prompts = [f"abort parity {i}: keep talking about {i}" for i in range(4)]
    with OmniPipeline(async_scheduling=False, backend=backend, **kwargs) as p:  # type: ignore[arg-type]
        ids = p.submit(prompts, max_text_tokens=8, max_codec_tokens=48)
        victims = {ids[1], ids[2]}
        heard: set[str] = set()
        finished: dict[str, Any] = {}
        deadline = time.monotonic() + 120
        while heard < set(ids) and len(finished) < len(ids):
            assert time.monotonic() < deadline, "no audio from every request"
            for event in p.step():
                if event.kind == "audio":
                    heard.add(event.request_id)
                elif event.kind == "finished":
                    finished[event.request_id] = event.result
        assert not finished, f"finished before the abort: {sorted(finished)}"
        assert sorted(p.abort(sorted(victims))) == sorted(victims)
        for event in p.drain():
            if event.kind == "finished":
                finished[event.request_id] = event.result
        deadline = time.monotonic() + 10
        while not p.orchestrator.is_clean() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.orchestrator.is_clean(), p.orchestrator.leftovers()
    assert sorted(finished) == sorted(ids)
    out: dict[str, Any] = {}
    for rid, result in finished.items():
        if rid in victims:
            out[rid] = result.finish_reason
        else:
            assert result.ok, (rid, result.finish_reason, result.error)
            wave = result.waveform.numpy().tobytes()
            out[rid] = (result.text_token_ids, result.codec_token_ids, wave)
    return out


# ---- one stage, any backend -------------------------------------------------------------------


def check_bad_input_refused(engine: Any) -> None:
    """A bad prompt is refused by the engine's own adapter before anything is sent."""
    bad = stage_inputs(n=1)[0]
    bad.prompt_token_ids = [10**9]
    with pytest.raises(RequestRejected, match="prompt_token_ids"):
        engine.add(bad)
    assert not engine.has_work()
    assert not any(engine.leftovers().values())


def check_abort_mid_stream(engine: Any) -> None:
    """Two of four streaming requests aborted: they leave the stage, the others finish, and
    nothing (request state, blocks, segments) is left."""
    sink = OutboxSink()
    engine.set_sink(sink)
    for item in stage_inputs(max_tokens=200, n=4):
        item.sampling_params.stop_token_ids = []
        engine.add(item)
    seen: set[str] = set()
    deadline = time.monotonic() + 60
    while len(seen) < 4:
        assert time.monotonic() < deadline
        seen |= {o.request_id for o in engine.step().outputs if o.new_token_ids}
        sink.drain()
    assert engine.abort(["r0", "r3", "nope"]) == ["r0", "r3"]
    reasons: dict[str, str] = {}
    while engine.has_work():
        assert time.monotonic() < deadline
        for out in engine.step().outputs:
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
        sink.drain()
    assert reasons == {"r1": "length", "r2": "length"}
    left = settled_clean(engine)
    assert not any(left.values()), left
    assert not live_segments(engine.shm_prefix)


def check_refused_chunk(engine: Any) -> None:
    """A connector that refuses one request's chunk fails only that request (C-61)."""

    class Refusing(OutboxSink):
        def send(self, chunk: StageChunk) -> None:
            if chunk.request_id == "r1":
                raise OSError("connector down")
            super().send(chunk)

    sink = Refusing()
    engine.set_sink(sink)
    for item in stage_inputs(n=4):
        engine.add(item)
    outcome: dict[str, tuple[str, str | None]] = {}
    while engine.has_work():
        for out in engine.step().outputs:
            if out.finish_reason is not None:
                outcome.setdefault(out.request_id, (out.finish_reason, out.error))
    error = outcome["r1"][1] or ""
    assert outcome["r1"][0] == "error" and "thinker" in error and "connector down" in error
    assert {rid for rid, (reason, _) in outcome.items() if reason == "error"} == {"r1"}
    assert {c.request_id for c in sink.drain()} == {"r0", "r3"}
    assert not any(settled_clean(engine).values())


def check_killed_fails_held(engine: Any) -> None:
    """Killing the stage's process fails exactly the requests it held (not one that finished
    before), naming the stage; its process is gone and its segments swept; a fresh process
    serves the next request with the in-process result."""
    engine.set_sink(OutboxSink())
    for item in stage_inputs(max_tokens=400, n=3):
        item.sampling_params.stop_token_ids = []
        engine.add(item)
    short = stage_inputs(max_tokens=2, n=1)[0]
    short.request_id = "short"
    engine.add(short)
    deadline = time.monotonic() + 120
    done_before: set[str] = set()
    while "short" not in done_before:
        assert time.monotonic() < deadline
        done_before |= {o.request_id for o in engine.step().outputs if o.finish_reason}
    assert done_before == {"short"}
    old_pid, old_prefix, restarts = engine.pid, engine.shm_prefix, engine.restarts
    assert old_pid is not None
    os.kill(old_pid, signal.SIGKILL)
    failed: dict[str, str | None] = {}
    finished_ok: set[str] = set()
    while engine.has_work():
        assert time.monotonic() < deadline
        for out in engine.step().outputs:
            if out.finish_reason == "error":
                failed[out.request_id] = out.error
            elif out.finish_reason is not None:
                finished_ok.add(out.request_id)
    assert sorted(failed) == ["r0", "r1", "r2"] and not finished_ok
    assert all("thinker" in (e or "") and "died" in (e or "") for e in failed.values())
    assert engine.restarts == restarts + 1 and engine.pid not in (None, old_pid)
    assert not still_running({old_pid})
    assert not live_segments(old_prefix)

    new = stage_inputs(n=1)[0]
    new.request_id = "after"
    again = run_stage(engine, [new])
    ref_engine = StageEngine(THINKER, CONFIG.stage_ids, EngineOptions(async_scheduling=False))
    try:
        ref = run_stage(
            ref_engine, [dataclasses.replace(new, sampling_params=new.sampling_params.clone())]
        )
    finally:
        ref_engine.shutdown()
    assert again["ids"] == ref["ids"] and again["reasons"] == ref["reasons"]
    assert chunks_by_request(again["chunks"]) == chunks_by_request(ref["chunks"])
    assert not any(settled_clean(engine).values())


def still_running(pids: set[int], timeout: float = 20.0) -> set[int]:
    """The pids among ``pids`` still alive (zombies count as gone) after ``timeout``."""

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout
    left = {p for p in pids if alive(p)}
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = {p for p in left if alive(p)}
    return left
