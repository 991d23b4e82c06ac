"""AR stages in Ray actors (``RayStageEngine``) against the in-process ``StageEngine``.

What these tests prove, and how each can fail:

* Parity — the whole pipeline with every AR stage in a Ray actor gives the in-process text ids,
  codec ids and waveform bytes under the same switch combinations as the multiprocess backend
  (``tests.backend_parity``). A chunk lost, reordered or with one bit changed on the way back
  from the actor fails it; so does an actor computing with a different thread count.
* Two machines: ``tests/test_ray_cluster.py`` (its own module: it needs its own Ray cluster).
* Bad input is refused in the driver before anything is sent; abort mid-stream releases
  everything in the actor; a connector that refuses one request's chunk fails only that
  request (C-61).
* Death: killing the actor's process fails exactly the requests it held, with reason "error" and
  a message naming the stage; a fresh actor serves the next request with the in-process result.
* Nothing is left: every actor process this module started is gone after shutdown, and no
  shared-memory segment of ours remains.
* ``omni-runtime run --backend ray`` and ``--backend multiprocess`` write the same WAV bytes as
  the in-process run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")

from omni_runtime.adapters.shm_wire import live_segments  # noqa: E402
from omni_runtime.engine.config import EngineOptions  # noqa: E402
from omni_runtime.engine.graph import (  # noqa: E402
    PipelineConfig,
    PipelineConfigError,
    RayResources,
)
from omni_runtime.engine.ray_stage import RayStageEngine, actor_env  # noqa: E402
from omni_runtime.engine.stage import StageEngine  # noqa: E402
from omni_runtime.sched.transfer import OutboxSink  # noqa: E402
from tests.backend_parity import (  # noqa: E402
    CONFIG,
    SWITCHES,
    THINKER,
    abort_signature,
    assert_same_as_inprocess,
    check_abort_mid_stream,
    check_bad_input_refused,
    check_killed_fails_held,
    check_refused_chunk,
    chunks_by_request,
    pipeline_signature,
    run_stage,
    settled_clean,
    stage_inputs,
    still_running,
)

ROOT = Path(__file__).resolve().parents[1]


def _our_segments() -> list[str]:
    return live_segments(f"omni-ray-{os.getpid()}-")


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """One local Ray instance for the module (each engine would otherwise start its own)."""
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=256 * 1024 * 1024,
        runtime_env={"env_vars": actor_env()},
    )
    try:
        yield
    finally:
        ray.shutdown()
    assert not _our_segments()


@pytest.fixture(scope="module")
def ray_thinker(local_ray: None) -> Iterator[RayStageEngine]:
    engine = RayStageEngine(THINKER, CONFIG.stage_ids, EngineOptions(async_scheduling=False))
    pids = {engine.pid}
    try:
        yield engine
        pids.add(engine.pid)
    finally:
        engine.shutdown()
    assert not still_running(pids), "an actor process outlived its engine"
    assert not live_segments(engine.shm_prefix)


def _reference(items: list[Any]) -> dict[str, Any]:
    ref = StageEngine(THINKER, CONFIG.stage_ids, EngineOptions(async_scheduling=False))
    try:
        return run_stage(ref, items)
    finally:
        ref.shutdown()


# ---- the pipeline file -------------------------------------------------------------------------


def test_ray_resources_are_read_and_checked() -> None:
    raw = {
        "stages": [
            {
                "id": "thinker",
                "model": "thinker",
                "ray_resources": {"num_cpus": 0.5, "resources": {"thinker_host": 1}},
            }
        ]
    }
    spec = PipelineConfig.from_dict(raw).ar_stages[0]
    assert spec.ray_resources == RayResources(0.5, 0.0, None, (("thinker_host", 1.0),))
    assert spec.ray_resources.actor_options() == {
        "num_cpus": 0.5,
        "num_gpus": 0.0,
        "resources": {"thinker_host": 1.0},
    }
    assert PipelineConfig.from_dict({"stages": [raw["stages"][0] | {"ray_resources": {}}]})
    for bad, words in [
        ({"cpus": 1}, "unknown keys ['cpus']"),
        ({"num_cpus": -1}, "num_cpus: expected a number >= 0"),
        ({"num_gpus": True}, "num_gpus: expected a number >= 0"),
        ({"resources": {"x": "1"}}, "resources: expected an object"),
        ([1], "expected an object"),
    ]:
        stage = raw["stages"][0] | {"ray_resources": bad}
        with pytest.raises(PipelineConfigError, match="ray_resources") as info:
            PipelineConfig.from_dict({"stages": [stage]})
        assert words in str(info.value)


# ---- one stage ---------------------------------------------------------------------------------


def test_bad_input_is_refused_before_it_is_sent(ray_thinker: RayStageEngine) -> None:
    check_bad_input_refused(ray_thinker)


def test_outputs_and_chunks_equal_in_process(ray_thinker: RayStageEngine) -> None:
    items = stage_inputs()
    got = run_stage(ray_thinker, items)
    ref = _reference(stage_inputs())
    assert got["ids"] == ref["ids"] and got["reasons"] == ref["reasons"]
    assert got["traces"] == ref["traces"]  # the clients' tracing context comes back too
    assert chunks_by_request(got["chunks"]) == chunks_by_request(ref["chunks"])
    assert ray_thinker.uses_shared_memory  # same host: descriptors, not pickled tensors
    assert not any(settled_clean(ray_thinker).values())


def test_abort_mid_stream_releases_everything(ray_thinker: RayStageEngine) -> None:
    check_abort_mid_stream(ray_thinker)


def test_a_refused_chunk_fails_only_its_request(ray_thinker: RayStageEngine) -> None:
    check_refused_chunk(ray_thinker)


def test_killed_actor_fails_exactly_its_requests_then_serves_again(
    ray_thinker: RayStageEngine,
) -> None:
    check_killed_fails_held(ray_thinker)


# ---- the whole pipeline ------------------------------------------------------------------------


@pytest.mark.parametrize("switches", SWITCHES)
def test_pipeline_is_bit_identical_with_every_stage_in_a_ray_actor(
    switches: dict[str, Any], local_ray: None
) -> None:
    ref = pipeline_signature(switches, "inprocess")
    assert_same_as_inprocess(ref, pipeline_signature(switches, "ray"))


# ---- the command -------------------------------------------------------------------------------


@pytest.mark.slow
def test_run_writes_the_same_wav_bytes_on_every_backend(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    # Ray's own files (and its processes' command lines) under a folder of this test's: a
    # short one, as Ray's socket paths must fit 107 bytes.
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    env.update(HF_HUB_OFFLINE="1", PYTHONHASHSEED="0", RAY_TMPDIR=ray_tmp)
    wavs: dict[str, list[bytes]] = {}
    for backend in ("inprocess", "multiprocess", "ray"):
        out = tmp_path / backend / "out.wav"
        proc = subprocess.run(
            [sys.executable, "-m", "omni_runtime.cli", "run", "--backend", backend,
             "--prompt", "Hello there", "--prompt", "a second prompt", "--out", str(out),
             "--no-progress", "--max-codec-tokens", "24"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        files = sorted(out.parent.glob("*.wav"))
        assert len(files) == 2, files
        wavs[backend] = [f.read_bytes() for f in files]
    assert wavs["multiprocess"] == wavs["inprocess"]
    assert wavs["ray"] == wavs["inprocess"]
    # The local Ray instance the command started went with it: no raylet, GCS or actor left.
    left = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if any(ray_tmp in part for part in p.info["cmdline"] or ())
    ]
    assert not left, f"Ray processes outlived the command: {left}"
    shutil.rmtree(ray_tmp, ignore_errors=True)


# ---- worker faults -----------------------------------------------------------------------------


@pytest.mark.parametrize("times", [None, 1], ids=["persistent", "one-off"])
@pytest.mark.parametrize("where", ["model", "step"])
def test_worker_faults_are_contained_as_in_process(
    where: str, times: int | None, ray_thinker: RayStageEngine
) -> None:
    import tests.backend_parity as parity

    # The actor's process imports nothing from this checkout's tests: ship the hook by value.
    ray.cloudpickle.register_pickle_by_value(parity)
    ref_engine = StageEngine(THINKER, CONFIG.stage_ids, EngineOptions(async_scheduling=False))
    try:
        ref = parity.fault_outcomes(ref_engine, stage_inputs(n=4), times, where)
    finally:
        ref_engine.shutdown()
    ray_thinker.set_sink(OutboxSink())
    restarts = ray_thinker.restarts
    got = parity.fault_outcomes(ray_thinker, stage_inputs(n=4), times, where)
    assert got == ref and ray_thinker.restarts == restarts
    failed = {rid for rid, (reason, _, _) in got.items() if reason == "error"}
    if where == "model":
        assert failed == ({"r3"} if times is None else set())
    else:
        assert "r3" in failed
    assert not any(settled_clean(ray_thinker).values())


def test_pipeline_abort_mid_audio_leaves_survivors_as_in_process(local_ray: None) -> None:
    """Two of four requests aborted while their audio streams: they end "abort", the others
    are byte-identical to in-process, and nothing is left in any stage."""
    ref = abort_signature("inprocess")
    got = abort_signature("ray")
    assert got == ref
    assert sorted(v for v in got.values() if isinstance(v, str)) == ["abort", "abort"]
