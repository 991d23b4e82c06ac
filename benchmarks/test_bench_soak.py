"""Soak: thousands of requests through thinker -> talker -> code2wav, with random aborts.

A long run finds what short tests cannot: state that grows a little per request. ``N_REQUESTS``
prompts of mixed lengths (``OMNI_SOAK_REQUESTS``), at most ``IN_FLIGHT`` at a time, with random
aborts; every ``SAMPLE_EVERY`` finished requests it samples resident memory, file descriptors,
threads and each stage's free KV blocks. It fails when a request lacks exactly one terminal
outcome (C-62), a stage is not empty with its initial free blocks at the end (C-06), descriptors
or threads do not end where they started, or memory grows over the second half (slope per
finished request above ``MAX_RSS_SLOPE``).

The figures go to ``benchmark.extra_info`` and stdout; the checks in full: docs/design.md, "How
the benchmarks measure". Run::

    pytest benchmarks/test_bench_soak.py -o addopts="" --benchmark-enable -p no:cacheprovider -s
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest

from omni_runtime.engine import OmniPipeline

N_REQUESTS = int(os.environ.get("OMNI_SOAK_REQUESTS", "2000"))
IN_FLIGHT = 32
SAMPLE_EVERY = 100
ABORT_PROBABILITY = 0.06  # per step: about a fifth of the requests end aborted
MAX_RSS_SLOPE = 2048.0  # bytes per finished request over the second half
WORDS = "the quick brown fox jumps over a lazy dog while omni stages stream speech".split()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return 0.0 if den == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den


@dataclass
class Soak:
    pipeline: OmniPipeline
    rng: random.Random
    outcomes: Counter[str] = field(default_factory=Counter)
    terminal: Counter[str] = field(default_factory=Counter)
    samples: list[dict[str, float]] = field(default_factory=list)
    submitted: int = 0
    live: set[str] = field(default_factory=set)
    steps: int = 0

    def sample(self) -> None:
        free = {sid: e.num_free_blocks() for sid, e in self.pipeline.orchestrator.engines.items()}
        self.samples.append(
            {
                "finished": float(sum(self.terminal.values())),
                "rss": float(_rss_bytes()),
                "fds": float(_open_fds()),
                "threads": float(threading.active_count()),
                **{f"free_blocks_{sid}": float(n) for sid, n in free.items()},
            }
        )

    def submit_more(self) -> None:
        while len(self.live) < IN_FLIGHT and self.submitted < N_REQUESTS:
            words = self.rng.sample(WORDS, self.rng.randint(1, 8))
            rid = f"soak-{self.submitted}"
            self.pipeline.submit(
                [" ".join(words)],
                max_text_tokens=self.rng.randint(1, 12),
                max_codec_tokens=self.rng.randint(2, 40),
                request_ids=[rid],
            )
            self.live.add(rid)
            self.submitted += 1

    def run(self) -> None:
        self.sample()
        next_sample = SAMPLE_EVERY
        while self.submitted < N_REQUESTS or self.live or self.pipeline.has_work():
            self.submit_more()
            if self.live and self.rng.random() < ABORT_PROBABILITY:
                self.pipeline.abort(self.rng.choice(sorted(self.live)))
            for ev in self.pipeline.step():
                if ev.kind != "finished":
                    continue
                self.terminal[ev.request_id] += 1
                self.live.discard(ev.request_id)
                result = ev.result
                self.outcomes["ok" if result.ok else result.finish_reason] += 1
            self.steps += 1
            if sum(self.terminal.values()) >= next_sample:
                self.sample()
                next_sample += SAMPLE_EVERY
        self.sample()


@pytest.mark.parametrize(
    "async_scheduling,materialization",
    [(True, "background"), (False, "inline")],
    ids=["async-background", "sync-inline"],
)
def test_bench_soak(benchmark, async_scheduling, materialization) -> None:
    with OmniPipeline(
        async_scheduling=async_scheduling, materialization=materialization, torch_threads=None
    ) as p:
        p.generate(["warm up"], max_text_tokens=2, max_codec_tokens=4)
        fds0, threads0 = _open_fds(), threading.active_count()
        soak = Soak(p, random.Random(0))
        start = time.perf_counter()
        benchmark.pedantic(soak.run, rounds=1, iterations=1)
        seconds = time.perf_counter() - start
        p.drain()
        fds1, threads1 = _open_fds(), threading.active_count()
        clean, leftovers = p.is_clean(), p.leftovers()
        initial = {sid: e.initial_free_blocks for sid, e in p.orchestrator.engines.items()}
        final = {sid: e.num_free_blocks() for sid, e in p.orchestrator.engines.items()}
    half = soak.samples[len(soak.samples) // 2 :]
    xs = [s["finished"] for s in half]
    slopes = {key: _slope(xs, [s[key] for s in half]) for key in half[0] if key != "finished"}
    first, last = soak.samples[0], soak.samples[-1]
    info = {
        "requests": N_REQUESTS,
        "steps": soak.steps,
        "seconds": round(seconds, 1),
        "requests_per_second": round(N_REQUESTS / seconds, 1),
        "outcomes": dict(soak.outcomes),
        "samples": len(soak.samples),
        "rss_mib_first_last": (round(first["rss"] / 2**20, 1), round(last["rss"] / 2**20, 1)),
        "rss_slope_bytes_per_request": round(slopes["rss"], 1),
        "fds_first_last": (first["fds"], last["fds"]),
        "threads_first_last": (first["threads"], last["threads"]),
        "slopes_second_half": {k: round(v, 4) for k, v in slopes.items()},
    }
    benchmark.extra_info.update(info)
    print(f"\nsoak {async_scheduling=} {materialization=}: {info}")

    # Every request accounted for exactly once, and nothing left behind.
    assert sum(soak.terminal.values()) == N_REQUESTS == len(soak.terminal)
    assert max(soak.terminal.values()) == 1
    assert set(soak.outcomes) <= {"ok", "abort"}, soak.outcomes
    assert clean, leftovers
    assert final == initial
    assert (fds1, threads1) == (fds0, threads0), info
    assert slopes["rss"] < MAX_RSS_SLOPE, info
