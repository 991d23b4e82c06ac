"""In-process vs multiprocess stage engines: what a stage in its own process costs or gains.

Two workloads, each under sync and async scheduling:

* ``thinker`` — 8 and 32 concurrent requests (32 new tokens each, mixed prompt lengths, hidden
  rows on, so every step ships a payload chunk) through one thinker stage, driven the way the
  orchestrator drives it (``add`` all, then ``step`` until idle, chunks drained each step).
  In-process is ``StageEngine``; multiprocess is ``MPStageEngine`` (vLLM's ``SyncMPClient``,
  chunks through shared memory).
* ``pipeline`` — 8 requests through thinker -> talker -> code2wav with every AR stage on the
  given backend (the orchestrator's engine class swapped for ``make_stage_engine``, as it will
  be wired), where two stage processes can overlap.

Engine start-up is outside the timed region. Seconds per run (median of the rounds) and
requests/s go to ``benchmark.extra_info`` and stdout; the multiprocess/in-process ratio is the
number that picks ``EngineOptions.backend``'s default.

Run: ``OMP_NUM_THREADS=1 pytest benchmarks/test_bench_backends.py -o addopts="" --benchmark-enable -p no:cacheprovider -s``
"""

from __future__ import annotations

import dataclasses
import inspect
import statistics
import time
from typing import Any

import pytest
from vllm import SamplingParams

from omni_runtime.adapters.input import StageInput
from omni_runtime.engine.backends import make_stage_engine
from omni_runtime.engine.config import EngineOptions
from omni_runtime.engine.graph import load_pipeline_config
from omni_runtime.sched.transfer import OutboxSink

CONFIG = load_pipeline_config()
THINKER = CONFIG.ar_stages[0]
NEW_TOKENS = 32
ROUNDS = 3
_MEDIANS: dict[tuple[str, str, int], float] = {}


def _inputs(n: int, wave: int) -> list[StageInput]:
    return [
        StageInput(
            request_id=f"w{wave}-r{i}",
            sampling_params=SamplingParams(
                max_tokens=NEW_TOKENS, temperature=0.0, stop_token_ids=[], detokenize=False
            ),
            prompt_token_ids=[(7 * i + k) % 400 + 3 for k in range(8 + (i * 13) % 48)],
            final_stage_id="code2wav",
        )
        for i in range(n)
    ]


def _drive(engine: Any, sink: OutboxSink, items: list[StageInput]) -> int:
    for item in items:
        engine.add(item)
    finished = 0
    while engine.has_work():
        finished += sum(o.finish_reason is not None for o in engine.step().outputs)
        sink.drain()
    return finished


def _report(benchmark: Any, key: tuple[str, str, int], seconds: list[float]) -> None:
    workload, scheduling, n = key[0], key[1], key[2]
    backend = benchmark.extra_info["backend"]
    median = statistics.median(seconds)
    _MEDIANS[(backend, f"{workload}-{scheduling}", n)] = median
    benchmark.extra_info.update(
        {"workload": workload, "scheduling": scheduling, "requests": n, "seconds": median}
    )
    other = "inprocess" if backend == "multiprocess" else "multiprocess"
    base = _MEDIANS.get((other, f"{workload}-{scheduling}", n))
    ratio = "" if base is None else "  multiprocess/inprocess = "
    if base is not None:
        mp, ip = (median, base) if backend == "multiprocess" else (base, median)
        ratio += f"{mp / ip:.2f}"
    print(
        f"\n{workload:8s} {scheduling:5s} {backend:12s} {n:3d} requests: "
        f"{median:.3f} s ({n / median:.1f} req/s){ratio}"
    )


@pytest.mark.parametrize("backend", ["inprocess", "multiprocess"])
@pytest.mark.parametrize("n", [8, 32])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_bench_thinker_backend(benchmark, async_scheduling, n, backend) -> None:
    options = EngineOptions(async_scheduling=async_scheduling, backend=backend)
    engine = make_stage_engine(THINKER, CONFIG.stage_ids, options)
    sink = OutboxSink()
    engine.set_sink(sink)
    waves = iter(range(1000))
    seconds: list[float] = []
    try:
        _drive(engine, sink, _inputs(2, next(waves)))  # warm-up

        def run() -> None:
            t0 = time.perf_counter()
            assert _drive(engine, sink, _inputs(n, next(waves))) == n
            seconds.append(time.perf_counter() - t0)

        benchmark.extra_info["backend"] = backend
        benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    finally:
        engine.shutdown()
    _report(benchmark, ("thinker", "async" if async_scheduling else "sync", n), seconds)


@pytest.mark.parametrize("backend", ["inprocess", "multiprocess"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_bench_pipeline_backend(benchmark, async_scheduling, backend, monkeypatch) -> None:
    from omni_runtime.engine import OmniPipeline
    from omni_runtime.engine import orchestrator as orch

    kwargs: dict[str, Any] = {}
    if "backend" in inspect.signature(OmniPipeline).parameters:
        kwargs["backend"] = backend
    else:
        # Until the orchestrator builds its engines with make_stage_engine.
        def factory(spec: Any, stages: tuple[str, ...], options: EngineOptions) -> Any:
            return make_stage_engine(spec, stages, dataclasses.replace(options, backend=backend))

        monkeypatch.setattr(orch, "StageEngine", factory)
    prompts = [f"request {i}: say something about the number {i}" for i in range(8)]
    seconds: list[float] = []
    with OmniPipeline(async_scheduling=async_scheduling, torch_threads=None, **kwargs) as p:
        p.generate(prompts[:2], max_text_tokens=2, max_codec_tokens=2)  # warm-up

        def run() -> None:
            t0 = time.perf_counter()
            results = p.generate(prompts, max_text_tokens=16, max_codec_tokens=64)
            seconds.append(time.perf_counter() - t0)
            assert all(r.ok for r in results)

        benchmark.extra_info["backend"] = backend
        benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    _report(benchmark, ("pipeline", "async" if async_scheduling else "sync", 8), seconds)
