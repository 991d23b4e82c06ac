"""What every stage backend must reproduce: the whole pipeline's outputs, bit for bit.

``pipeline_signature`` runs one fixed workload (three prompts, then the first again so that with
prefix caching on the second wave hits cached blocks) through ``OmniPipeline`` with the given
switches on the given backend, checks that every engine is of the backend's class and that the
pipeline is clean afterwards, and returns per request the text ids, codec ids and waveform
bytes. Backend tests compare it against the in-process run.
"""

from __future__ import annotations

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
