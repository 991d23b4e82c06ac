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
import time
from typing import Any

import pytest

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
    """Raised by the planted hook: a fault in the model's forward."""


def plant_poison(worker: Any, poison: int, times: int | None) -> None:
    """Runs on the worker (``call_worker``): its token embedding raises when its input holds
    ``poison`` (at most ``times`` times; None: always). Replaces an earlier planting."""
    import torch

    embedding = worker.get_model().get_input_embeddings()
    clear_poison(worker)
    raised = [0]

    def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        ids = args[0] if args else None
        if not isinstance(ids, torch.Tensor) or not bool((ids == poison).any()):
            return
        if times is not None and raised[0] >= times:
            return
        raised[0] += 1
        raise InjectedStageFault(f"poison token {poison} in the forward")

    embedding._omni_test_poison = embedding.register_forward_pre_hook(hook)


def clear_poison(worker: Any) -> None:
    embedding = worker.get_model().get_input_embeddings()
    handle = getattr(embedding, "_omni_test_poison", None)
    if handle is not None:
        handle.remove()
        del embedding._omni_test_poison


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
