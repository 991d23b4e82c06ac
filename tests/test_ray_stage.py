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

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")

from omni_runtime.adapters.input import RequestRejected  # noqa: E402
from omni_runtime.adapters.shm_wire import live_segments  # noqa: E402
from omni_runtime.engine.config import EngineOptions  # noqa: E402
from omni_runtime.engine.graph import (  # noqa: E402
    PipelineConfig,
    PipelineConfigError,
    RayResources,
    load_pipeline_config,
)
from omni_runtime.engine.ray_stage import RayStageEngine, actor_env  # noqa: E402
from omni_runtime.engine.stage import StageEngine  # noqa: E402
from omni_runtime.payload import StageChunk  # noqa: E402
from omni_runtime.sched.transfer import OutboxSink  # noqa: E402
from tests.backend_parity import (  # noqa: E402
    SWITCHES,
    abort_signature,
    assert_same_as_inprocess,
    pipeline_signature,
)
from tests.test_mp_stage import _by_request, _inputs, _run, _settled_clean  # noqa: E402

CONFIG = load_pipeline_config()
THINKER = CONFIG.ar_stages[0]
ROOT = Path(__file__).resolve().parents[1]


def _our_segments() -> list[str]:
    return live_segments(f"omni-ray-{os.getpid()}-")


def _gone(pids: set[int], timeout: float = 20.0) -> set[int]:
    """The pids among ``pids`` still alive after ``timeout``."""
    deadline = time.monotonic() + timeout
    alive = {p for p in pids if psutil.pid_exists(p)}
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = {p for p in alive if psutil.pid_exists(p) and not _zombie(p)}
    return alive


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


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
    assert not _gone(pids), "an actor process outlived its engine"
    assert not live_segments(engine.shm_prefix)


def _reference(items: list[Any]) -> dict[str, Any]:
    ref = StageEngine(THINKER, CONFIG.stage_ids, EngineOptions(async_scheduling=False))
    try:
        return _run(ref, items)
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
    bad = _inputs(n=1)[0]
    bad.prompt_token_ids = [10**9]
    with pytest.raises(RequestRejected, match="prompt_token_ids"):
        ray_thinker.add(bad)
    assert not ray_thinker.has_work()
    assert not any(ray_thinker.leftovers().values())


def test_outputs_and_chunks_equal_in_process(ray_thinker: RayStageEngine) -> None:
    items = _inputs()
    got = _run(ray_thinker, items)
    ref = _reference(_inputs())
    assert got["ids"] == ref["ids"] and got["reasons"] == ref["reasons"]
    assert _by_request(got["chunks"]) == _by_request(ref["chunks"])
    assert ray_thinker.uses_shared_memory  # same host: descriptors, not pickled tensors
    assert not any(_settled_clean(ray_thinker).values())


def test_abort_mid_stream_releases_everything(ray_thinker: RayStageEngine) -> None:
    sink = OutboxSink()
    ray_thinker.set_sink(sink)
    items = _inputs(max_tokens=200, n=4)
    for item in items:
        item.sampling_params.stop_token_ids = []
        ray_thinker.add(item)
    seen: set[str] = set()
    deadline = time.monotonic() + 60
    while len(seen) < 4:
        assert time.monotonic() < deadline
        seen |= {o.request_id for o in ray_thinker.step().outputs if o.new_token_ids}
    assert ray_thinker.abort(["r0", "r3", "nope"]) == ["r0", "r3"]
    reasons: dict[str, str] = {}
    while ray_thinker.has_work():
        assert time.monotonic() < deadline
        for out in ray_thinker.step().outputs:
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
        sink.drain()
    assert reasons == {"r1": "length", "r2": "length"}
    left = _settled_clean(ray_thinker)
    assert not any(left.values()), left


def test_a_refused_chunk_fails_only_its_request(ray_thinker: RayStageEngine) -> None:
    class Refusing(OutboxSink):
        def send(self, chunk: StageChunk) -> None:
            if chunk.request_id == "r1":
                raise OSError("connector down")
            super().send(chunk)

    sink = Refusing()
    ray_thinker.set_sink(sink)
    for item in _inputs(n=4):
        ray_thinker.add(item)
    outcome: dict[str, tuple[str, str | None]] = {}
    while ray_thinker.has_work():
        for out in ray_thinker.step().outputs:
            if out.finish_reason is not None:
                outcome.setdefault(out.request_id, (out.finish_reason, out.error))
    assert outcome["r1"][0] == "error" and "connector down" in (outcome["r1"][1] or "")
    assert {rid for rid, (reason, _) in outcome.items() if reason == "error"} == {"r1"}
    assert {c.request_id for c in sink.drain()} == {"r0", "r3"}
    assert not any(_settled_clean(ray_thinker).values())


def test_killed_actor_fails_exactly_its_requests_then_serves_again(
    ray_thinker: RayStageEngine,
) -> None:
    ray_thinker.set_sink(OutboxSink())
    for item in _inputs(max_tokens=400, n=3):
        item.sampling_params.stop_token_ids = []
        ray_thinker.add(item)
    short = _inputs(max_tokens=2, n=1)[0]
    short.request_id = "short"
    ray_thinker.add(short)
    deadline = time.monotonic() + 120
    done_before: set[str] = set()
    while "short" not in done_before:
        assert time.monotonic() < deadline
        done_before |= {o.request_id for o in ray_thinker.step().outputs if o.finish_reason}
    assert done_before == {"short"}
    old_pid, restarts = ray_thinker.pid, ray_thinker.restarts
    os.kill(old_pid, signal.SIGKILL)
    failed: dict[str, str | None] = {}
    finished_ok: set[str] = set()
    while ray_thinker.has_work():
        assert time.monotonic() < deadline
        for out in ray_thinker.step().outputs:
            if out.finish_reason == "error":
                failed[out.request_id] = out.error
            elif out.finish_reason is not None:
                finished_ok.add(out.request_id)
    # Exactly the requests the actor held: not the one that had finished before the kill.
    assert sorted(failed) == ["r0", "r1", "r2"] and not finished_ok
    assert all("thinker" in (e or "") and "died" in (e or "") for e in failed.values())
    assert ray_thinker.restarts == restarts + 1 and ray_thinker.pid != old_pid
    assert not _gone({old_pid})

    new = _inputs(n=1)[0]
    new.request_id = "after"
    again = _run(ray_thinker, [new])
    ref = _reference([dataclasses.replace(new, sampling_params=new.sampling_params.clone())])
    assert again["ids"] == ref["ids"] and again["reasons"] == ref["reasons"]
    assert _by_request(again["chunks"]) == _by_request(ref["chunks"])
    assert not any(_settled_clean(ray_thinker).values())


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
        ref = parity.fault_outcomes(ref_engine, _inputs(n=4), times, where)
    finally:
        ref_engine.shutdown()
    ray_thinker.set_sink(OutboxSink())
    restarts = ray_thinker.restarts
    got = parity.fault_outcomes(ray_thinker, _inputs(n=4), times, where)
    assert got == ref and ray_thinker.restarts == restarts
    failed = {rid for rid, (reason, _, _) in got.items() if reason == "error"}
    if where == "model":
        assert failed == ({"r3"} if times is None else set())
    else:
        assert "r3" in failed
    assert not any(_settled_clean(ray_thinker).values())


def test_pipeline_abort_mid_audio_leaves_survivors_as_in_process(local_ray: None) -> None:
    """Two of four requests aborted while their audio streams: they end "abort", the others
    are byte-identical to in-process, and nothing is left in any stage."""
    ref = abort_signature("inprocess")
    got = abort_signature("ray")
    assert got == ref
    assert sorted(v for v in got.values() if isinstance(v, str)) == ["abort", "abort"]
