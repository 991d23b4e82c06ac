"""Pipeline throughput and time to first audio chunk: streaming code2wav vs waiting.

Eight concurrent requests go through thinker -> talker -> code2wav. "streaming" decodes each
codec chunk as the talker produces it; "full" holds the codec ids until the talker finished
and decodes them at once (same waveforms). Figures go to ``benchmark.extra_info`` and stdout.

Run: ``pytest benchmarks/test_bench_pipeline.py -o addopts="" --benchmark-enable -p no:cacheprovider -s``
"""

from __future__ import annotations

import statistics

import pytest

from omni_runtime.engine import OmniPipeline

N_REQUESTS = 8
MAX_TEXT = 16
MAX_CODEC = 64
PROMPTS = [f"request {i}: say something about the number {i}" for i in range(N_REQUESTS)]


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def async_scheduling(request) -> bool:
    return request.param


@pytest.mark.parametrize("stream_audio", [True, False], ids=["streaming", "full"])
def test_bench_pipeline(benchmark, async_scheduling, stream_audio) -> None:
    # torch_threads=None: benchmarks/conftest.py sets the thread count (OMNI_BENCH_TORCH_THREADS).
    with OmniPipeline(
        async_scheduling=async_scheduling, stream_audio=stream_audio, torch_threads=None
    ) as p:
        p.generate(PROMPTS[:2], max_text_tokens=2, max_codec_tokens=2)  # warm-up
        runs: list[list] = []

        def run() -> None:
            runs.append(p.generate(PROMPTS, max_text_tokens=MAX_TEXT, max_codec_tokens=MAX_CODEC))

        benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)
        assert p.is_clean() or not p.drain() and p.is_clean()
    results = [r for batch in runs for r in batch]
    assert all(r.ok for r in results)
    wall = [max(r.total_time for r in batch) for batch in runs]
    ttfa = [r.time_to_first_audio_chunk for r in results]
    ttft = [r.time_to_first_text_token for r in results]
    info = {
        "mode": "streaming" if stream_audio else "full",
        "scheduling": "async" if async_scheduling else "sync",
        "requests": N_REQUESTS,
        "requests_per_s": N_REQUESTS / statistics.median(wall),
        "ttfa_median_ms": 1000 * statistics.median(ttfa),
        "ttfa_p90_ms": 1000 * sorted(ttfa)[int(0.9 * (len(ttfa) - 1))],
        "ttft_median_ms": 1000 * statistics.median(ttft),
        "audio_chunks_per_request": statistics.mean(r.num_audio_chunks for r in results),
        "codec_tokens_per_request": statistics.mean(len(r.codec_token_ids) for r in results),
    }
    benchmark.extra_info.update(info)
    print(
        "\n"
        + " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items())
    )
