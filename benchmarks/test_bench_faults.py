"""Fault campaign with figures: one table row per fault case (C-61, C-62).

    case | requests | affected | expected | exactly one outcome | blocks in use | omni leftovers | s

The long cases are ``kv-exhaustion`` (``OMNI_FAULT_KV_REQUESTS`` requests into stages of
``KV_BLOCKS`` blocks: nothing may fail) and ``abort-storm`` (``OMNI_FAULT_STORM_REQUESTS``
requests, up to ``STORM_IN_FLIGHT`` at a time in ``STORM_BLOCKS`` blocks, half aborted at random
steps, the states hit in ``extra_info``). The quick cases are the tests of
``tests/test_fault_campaign.py``, run once more by ``test_bench_fault_campaign_quick_cases``.

What each column means and what each case expects: docs/design.md, "How the benchmarks
measure"; the faults themselves: docs/design.md, "Faults and signals". Run::

    pytest benchmarks/test_bench_faults.py -o addopts="" --benchmark-enable -p no:cacheprovider -s
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from omni_runtime.engine import OmniPipeline
from omni_runtime.engine.graph import default_pipeline_path
from omni_runtime.engine.orchestrator import RequestResult

N_KV = int(os.environ.get("OMNI_FAULT_KV_REQUESTS", "300"))
N_STORM = int(os.environ.get("OMNI_FAULT_STORM_REQUESTS", "1000"))
KV_BLOCKS = 8
STORM_BLOCKS = 12
STORM_IN_FLIGHT = 48
# A victim is aborted at admission (before any step) with probability ABORT_AT_ADMISSION, else
# after a number of orchestrator steps drawn from [1, ABORT_WITHIN]: spread over the thinker,
# the talker and audio streaming; a victim that finishes first is simply not aborted.
ABORT_AT_ADMISSION = 0.1
ABORT_WITHIN = 60
WORDS = "the quick brown fox jumps over a lazy dog while omni stages stream speech".split()

MODES = [(False, "inline"), (True, "background")]
MODE_IDS = ["sync-inline", "async-background"]

HEADER = (
    f"{'case':<68} {'requests':>8} {'affected':>8} {'expected':>8} {'one outcome':>11} "
    f"{'blocks':>6} {'omni left':>9} {'seconds':>8}"
)
ROWS: list[str] = []


def row(case: str, fig: dict[str, Any]) -> str:
    line = (
        f"{case:<68} {fig['requests']:>8} {len(fig['affected']):>8} {len(fig['expected']):>8} "
        f"{fig['exactly_one']:>11} {fig['blocks_in_use']:>6} {fig['omni_leftovers']:>9} "
        f"{fig['seconds']:>8.2f}"
    )
    ROWS.append(line)
    print(f"\n{HEADER}\n{line}")
    return line


@pytest.fixture(scope="module", autouse=True)
def fault_table() -> Iterator[None]:
    yield
    if ROWS:
        print("\n\nfault campaign\n" + HEADER + "\n" + "\n".join(ROWS))


def nonempty(leftovers: Any) -> int:
    if isinstance(leftovers, dict):
        return sum(nonempty(v) for v in leftovers.values())
    return 1 if leftovers else 0


def small_kv_config(tmp_path: Path, blocks: int) -> Path:
    """The default pipeline with ``blocks`` KV blocks per LM stage; ``max_model_len`` shrinks
    to what they hold (vLLM refuses a stage that cannot hold one whole request)."""
    raw = json.loads(default_pipeline_path().read_text())
    for stage in raw["stages"]:
        if stage["kind"] == "ar":
            stage["num_blocks"] = blocks
            stage["max_model_len"] = (blocks - 1) * stage["block_size"]
    path = tmp_path / f"pipeline-{blocks}-blocks.json"
    path.write_text(json.dumps(raw))
    return path


def prompt_pool(n: int, seed: int) -> list[tuple[str, int, int]]:
    """``n`` distinct (prompt, max text tokens, max codec tokens) combinations."""
    rng = random.Random(seed)
    pool = []
    for i in range(n):
        words = " ".join(rng.sample(WORDS, rng.randint(1, 6)))
        pool.append((f"{i} {words}", rng.randint(2, 8), rng.randint(4, 40)))
    return pool


def references(p: OmniPipeline, pool: list[tuple[str, int, int]]) -> list[RequestResult]:
    """Each combination run alone: the outputs nothing may change."""
    out = []
    for i, (prompt, text, codec) in enumerate(pool):
        [r] = p.generate(
            [prompt], max_text_tokens=text, max_codec_tokens=codec, request_ids=[f"ref-{i}"]
        )
        assert r.ok
        out.append(r)
    return out


def same(a: RequestResult, b: RequestResult) -> bool:
    from tests.test_fault_campaign import same_output

    return same_output(a, b)


def count_preemptions(p: OmniPipeline, monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts vLLM's preemptions per stage (wrapping the scheduler's own ``_preempt_request``)."""
    counts: Counter[str] = Counter()
    for sid, engine in p.orchestrator.engines.items():
        sched = engine.scheduler
        real = getattr(sched, "_preempt_request", None)
        if real is None:
            continue

        def preempt(*args: Any, _real: Callable[..., Any] = real, _sid: str = sid, **kw: Any):
            counts[_sid] += 1
            return _real(*args, **kw)

        monkeypatch.setattr(sched, "_preempt_request", preempt)
    return counts


def figures(
    p: OmniPipeline,
    terminal: Counter[str],
    affected: set[str],
    expected: set[str],
    seconds: float,
) -> dict[str, Any]:
    leftovers = p.leftovers()
    return {
        "requests": len(terminal),
        "affected": sorted(affected),
        "expected": sorted(expected),
        "exactly_one": sum(1 for n in terminal.values() if n == 1),
        "blocks_in_use": sum(leftovers[sid]["blocks_in_use"] for sid in p.orchestrator.engines),
        "omni_leftovers": nonempty(leftovers),
        "seconds": seconds,
    }


def record(benchmark: Any, case: str, fig: dict[str, Any], **extra: Any) -> None:
    benchmark.extra_info.update(
        {
            "case": case,
            "requests": fig["requests"],
            "affected": len(fig["affected"]),
            "expected_affected": len(fig["expected"]),
            "exactly_one_outcome": fig["exactly_one"],
            "blocks_in_use_after": fig["blocks_in_use"],
            "omni_leftovers_after": fig["omni_leftovers"],
            "seconds": round(fig["seconds"], 2),
            **extra,
        }
    )
    row(case, fig)


def assert_figures(fig: dict[str, Any], n: int) -> None:
    assert fig["requests"] == n == fig["exactly_one"], fig["exactly_one"]
    assert fig["affected"] == fig["expected"]
    assert fig["blocks_in_use"] == 0 and fig["omni_leftovers"] == 0


# ---- KV exhaustion under overload ---------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling,materialization", MODES, ids=MODE_IDS)
def test_bench_kv_exhaustion(
    benchmark, tmp_path, monkeypatch, async_scheduling, materialization
) -> None:
    pool = prompt_pool(12, seed=1)
    with OmniPipeline(
        small_kv_config(tmp_path, KV_BLOCKS),
        async_scheduling=async_scheduling,
        materialization=materialization,
    ) as p:
        refs = references(p, pool)
        preemptions = count_preemptions(p, monkeypatch)
        terminal: Counter[str] = Counter()
        results: dict[str, RequestResult] = {}
        which = {f"kv-{i}": i % len(pool) for i in range(N_KV)}

        def run() -> None:
            # All at once: hundreds of requests into a handful of blocks.
            for rid, k in which.items():
                prompt, text, codec = pool[k]
                p.submit([prompt], max_text_tokens=text, max_codec_tokens=codec, request_ids=[rid])
            while p.has_work():
                for ev in p.step():
                    if ev.kind == "finished":
                        terminal[ev.request_id] += 1
                        results[ev.request_id] = ev.result

        start = time.perf_counter()
        benchmark.pedantic(run, rounds=1, iterations=1)
        seconds = time.perf_counter() - start
        p.drain()
        affected = {rid for rid, r in results.items() if not r.ok}
        fig = figures(p, terminal, affected, set(), seconds)
        monkeypatch.undo()
        differ = [rid for rid, r in results.items() if r.ok and not same(r, refs[which[rid]])]
        initial = {sid: e.initial_free_blocks for sid, e in p.orchestrator.engines.items()}
    record(
        benchmark,
        f"kv-exhaustion {N_KV} into {KV_BLOCKS} blocks ({MODE_IDS[int(async_scheduling)]})",
        fig,
        blocks_per_stage=initial,
        preemptions=dict(preemptions),
        outcomes=dict(Counter(r.finish_reason for r in results.values())),
        outputs_differing_from_reference=len(differ),
    )
    print(f"preemptions {dict(preemptions)}; outcomes {benchmark.extra_info['outcomes']}")
    assert_figures(fig, N_KV)
    assert sum(preemptions.values()) > 0, "the overload must make vLLM preempt"
    assert differ == []


# ---- abort storm -------------------------------------------------------------------------------


def request_state(p: OmniPipeline, rid: str) -> str:
    """Where ``rid`` is: its stage and vLLM status there, and whether audio already streamed."""
    track = p.orchestrator._tracks[rid]
    engine = p.orchestrator.engines.get(track.stage)
    request = engine.scheduler.requests.get(rid) if engine is not None else None
    status = request.status.name.lower() if request is not None else "between stages"
    return f"{track.stage}: {status}" + (", audio streamed" if track.audio else "")


@pytest.mark.parametrize("async_scheduling,materialization", MODES, ids=MODE_IDS)
def test_bench_abort_storm(
    benchmark, tmp_path, monkeypatch, async_scheduling, materialization
) -> None:
    rng = random.Random(7)
    pool = prompt_pool(16, seed=2)
    with OmniPipeline(
        small_kv_config(tmp_path, STORM_BLOCKS),
        async_scheduling=async_scheduling,
        materialization=materialization,
    ) as p:
        refs = references(p, pool)
        preemptions = count_preemptions(p, monkeypatch)
        which = {f"storm-{i}": rng.randrange(len(pool)) for i in range(N_STORM)}
        victims = set(rng.sample(sorted(which), N_STORM // 2))
        abort_after = {
            rid: 0 if rng.random() < ABORT_AT_ADMISSION else rng.randint(1, ABORT_WITHIN)
            for rid in sorted(victims)
        }
        due: dict[str, int] = {}
        terminal: Counter[str] = Counter()
        results: dict[str, RequestResult] = {}
        aborted: set[str] = set()
        states: Counter[str] = Counter()
        pending = list(which)
        live: set[str] = set()

        def abort(rid: str, state: str) -> None:
            got = p.abort([rid])
            if got:
                aborted.update(got)
                states[state] += 1

        def run() -> None:
            while pending or p.has_work():
                while pending and len(live) < STORM_IN_FLIGHT:
                    rid = pending.pop(0)
                    prompt, text, codec = pool[which[rid]]
                    p.submit(
                        [prompt], max_text_tokens=text, max_codec_tokens=codec, request_ids=[rid]
                    )
                    live.add(rid)
                    if rid in victims:
                        if abort_after[rid] == 0:
                            abort(rid, "admitted, never stepped")
                        else:
                            due[rid] = p.orchestrator.steps + abort_after[rid]
                for rid in sorted(due):
                    if due[rid] <= p.orchestrator.steps:
                        del due[rid]
                        if rid in p.orchestrator._tracks:
                            abort(rid, request_state(p, rid))
                for ev in p.step():
                    if ev.kind == "finished":
                        terminal[ev.request_id] += 1
                        results[ev.request_id] = ev.result
                        live.discard(ev.request_id)

        start = time.perf_counter()
        benchmark.pedantic(run, rounds=1, iterations=1)
        seconds = time.perf_counter() - start
        p.drain()
        affected = {rid for rid, r in results.items() if not r.ok}
        fig = figures(p, terminal, affected, aborted, seconds)
        monkeypatch.undo()
        differ = [rid for rid, r in results.items() if r.ok and not same(r, refs[which[rid]])]
        wrong_reason = [rid for rid in affected if results[rid].finish_reason != "abort"]
    record(
        benchmark,
        f"abort-storm {N_STORM}, half victims ({MODE_IDS[int(async_scheduling)]})",
        fig,
        victims=len(victims),
        victims_finished_before_abort=len(victims - aborted),
        states_at_abort=dict(sorted(states.items())),
        preemptions=dict(preemptions),
        outputs_differing_from_reference=len(differ),
    )
    print(f"states at abort: {dict(sorted(states.items()))}; preemptions {dict(preemptions)}")
    assert_figures(fig, N_STORM)
    assert wrong_reason == [] and differ == []
    hit = {s.split(",")[0] for s in states}
    for state in ("admitted", "thinker: waiting", "thinker: running", "talker: running"):
        assert any(h.startswith(state) for h in hit), (state, states)
    assert any("audio streamed" in s for s in states), states


# ---- the quick cases, once more for the table ---------------------------------------------------


def test_bench_fault_campaign_quick_cases(benchmark) -> None:
    """Every quick case of ``tests/test_fault_campaign.py`` (asserting as there), one row each."""
    from tests import test_fault_campaign as campaign

    cases: list[tuple[str, Callable[[OmniPipeline, pytest.MonkeyPatch, Any], None]]] = []
    for stage in ("thinker", "talker"):
        for when in campaign.WHEN:
            cases.append(
                (
                    f"processor raises, {stage}, {when} step",
                    lambda p, mp, s=stage, w=when: (
                        campaign.test_processor_fault_fails_only_its_request(p, s, w)
                    ),
                )
            )
    for edge in ("thinker", "talker"):
        for exc, name in (
            (ConnectionError("link down"), "raises"),
            (TimeoutError("slow"), "times out"),
        ):
            for when in ("first", "terminal"):
                cases.append(
                    (
                        f"connector send {name}, {edge}, {when} chunk",
                        lambda p, mp, e=edge, x=exc, w=when: (
                            campaign.test_connector_send_fault_fails_only_its_request(p, e, x, w)
                        ),
                    )
                )
    for persistent in (True, False):
        cases.append(
            (
                f"builder raises, {'persistent' if persistent else 'one-off'}",
                lambda p, mp, ps=persistent: campaign.test_builder_fault_fails_only_its_request(
                    p, ps, mp
                ),
            )
        )
    for when in campaign.WHEN:
        cases.append(
            (
                f"decoder raises, {when} chunk",
                lambda p, mp, w=when: campaign.test_decoder_fault_fails_only_its_request(p, w, mp),
            )
        )
    relay_cases = [
        (
            f"relay child {how}, {edge} edge",
            lambda p, mp, e=edge, h=how: (
                campaign.test_relay_child_lost_mid_stream_fails_only_what_it_held(p, e, h, mp)
            ),
        )
        for edge in ("thinker", "talker")
        for how in ("killed", "stalled")
    ]

    def run_all() -> None:
        for async_scheduling, materialization in MODES:
            mode = MODE_IDS[int(async_scheduling)]
            for connector, table in ((None, cases), ("pipe", relay_cases)):
                with OmniPipeline(
                    async_scheduling=async_scheduling,
                    materialization=materialization,
                    connector=connector,
                ) as p:
                    for case, fn in table:
                        before = len(campaign.FIGURES)
                        with pytest.MonkeyPatch.context() as mp:
                            fn(p, mp)
                        for fig in campaign.FIGURES[before:]:
                            row(f"{case} ({mode})", fig)

    benchmark.pedantic(run_all, rounds=1, iterations=1)
    benchmark.extra_info["rows"] = list(ROWS)
