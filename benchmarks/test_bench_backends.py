"""In-process vs multiprocess vs Ray stage engines: what a stage outside the caller costs or gains.

Two workloads, 8 and 32 concurrent requests, sync and async scheduling: ``thinker`` (one thinker
stage with hidden rows on, driven as the orchestrator drives it: ``StageEngine`` against
``MPStageEngine``) and ``pipeline`` (thinker -> talker -> code2wav with every AR stage on each
backend, ``OmniPipeline(backend=...)``, run in turn within each round). Reported per backend:
seconds per wave, requests/s, the median time to first audio chunk, and ratios to in-process
from the same round. Engine and Ray start-up are outside the timed region.

The results and what they decided: docs/design.md, "A stage in its own process, or on another
machine". Run: ``OMP_NUM_THREADS=1 pytest benchmarks/test_bench_backends.py -o addopts=""
--benchmark-enable -p no:cacheprovider -s``
"""

from __future__ import annotations

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
    base = _MEDIANS.get(("inprocess", f"{workload}-{scheduling}", n))
    ratio = "" if base is None or backend == "inprocess" else f"  {backend}/inprocess = "
    if ratio:
        ratio += f"{median / base:.2f}"
    print(
        f"\n{workload:8s} {scheduling:5s} {backend:12s} {n:3d} requests: "
        f"{median:.3f} s ({n / median:.1f} req/s){ratio}"
    )


@pytest.mark.parametrize("backend", ["inprocess", "multiprocess", "ray"])
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


BACKENDS = ("inprocess", "multiprocess", "ray")


@pytest.mark.parametrize("n", [8, 32])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_bench_pipeline_backends(benchmark, async_scheduling, n) -> None:
    """Throughput and time to first audio, every backend in the same run, rounds interleaved."""
    from omni_runtime.engine import OmniPipeline

    prompts = [f"request {i}: say something about the number {i}" for i in range(n)]
    pipelines: dict[str, Any] = {}
    wall: dict[str, list[float]] = {b: [] for b in BACKENDS}
    ttfa: dict[str, list[float]] = {b: [] for b in BACKENDS}
    try:
        for backend in BACKENDS:
            p = OmniPipeline(async_scheduling=async_scheduling, backend=backend)
            pipelines[backend] = p
            p.generate(prompts[:2], max_text_tokens=2, max_codec_tokens=2)  # warm-up

        def one_round() -> None:
            # Each backend in turn within a round: drift on the machine hits all of them.
            for backend, p in pipelines.items():
                t0 = time.perf_counter()
                results = p.generate(prompts, max_text_tokens=16, max_codec_tokens=64)
                wall[backend].append(time.perf_counter() - t0)
                assert all(r.ok for r in results), [r.error for r in results if not r.ok]
                firsts = [r.time_to_first_audio_chunk for r in results]
                assert all(t is not None for t in firsts)
                ttfa[backend].append(statistics.median(t for t in firsts if t is not None))

        benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    finally:
        for p in pipelines.values():
            p.close()
    scheduling = "async" if async_scheduling else "sync"
    base_wall = statistics.median(wall["inprocess"])
    base_ttfa = statistics.median(ttfa["inprocess"])
    rows = {}
    for backend in BACKENDS:
        w, f = statistics.median(wall[backend]), statistics.median(ttfa[backend])
        rows[backend] = {
            "seconds": round(w, 3),
            "requests_per_s": round(n / w, 2),
            "ttfa_median_s": round(f, 3),
            "throughput_vs_inprocess": round(base_wall / w, 2),
            "ttfa_vs_inprocess": round(f / base_ttfa, 2),
        }
        print(
            f"\npipeline {scheduling:5s} {n:3d} requests {backend:12s}: {w:.2f} s, "
            f"{n / w:.1f} req/s ({base_wall / w:.2f}x in-process), time to first audio "
            f"{f:.3f} s ({f / base_ttfa:.2f}x in-process)"
        )
    benchmark.extra_info.update(scheduling=scheduling, requests=n, backends=rows)
