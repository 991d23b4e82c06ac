"""One side of the scheduler step benchmark, hosted in a process of its own.

``test_bench_scheduler.py`` starts one ``StepChild`` per side (upstream ``Scheduler`` with vLLM
``Request`` objects, ``OmniARScheduler`` with the requests of its mode) and asks them for timed
steps in turn; each child builds and runs only its one scheduler over one request type, as a
production process does. Children are forked from a ``forkserver`` that has imported vLLM, torch
and the runtime but never built a scheduler. ``StepChild.profile`` runs cProfile over steps
inside a child.

Not collected by pytest (no ``test_`` prefix); the test imports it from ``benchmarks/``, which
pytest puts on ``sys.path``, and each child inherits that path. Why a process per side:
docs/design.md, "How the benchmarks measure".
"""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, NoReturn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine import EngineCoreRequest  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from conformance._core.config import HarnessConfig, block_hasher, build_scheduler  # noqa: E402
from omni_runtime.adapters import InputAdapter, StageInput  # noqa: E402
from omni_runtime.config import OmniStageConfig, stage_additional_config  # noqa: E402
from omni_runtime.conformance_subject import talker_stage  # noqa: E402
from omni_runtime.platform import install_for_process  # noqa: E402
from omni_runtime.sched import OmniARScheduler  # noqa: E402

# Same pin as benchmarks/conftest.py: a child may be forked before anything read the platform.
install_for_process()

ROUNDS = 300
# The same talker stage the gate's omni subject runs.
TALKER = OmniStageConfig.from_dict(talker_stage())
SCHEDULERS = {"upstream": Scheduler, "omni": OmniARScheduler}


def _ready(cls, n: int, omni: bool):
    cfg = HarnessConfig(
        num_blocks=n * 24 + 8,
        max_num_seqs=n,
        max_num_batched_tokens=max(256, n * 16),
        max_model_len=512,
        additional_config=stage_additional_config(TALKER) if omni else {},
    )
    sched = build_scheduler(cls, cfg)
    h = block_hasher(cfg.block_size)
    sp = SamplingParams(max_tokens=ROUNDS + 50, ignore_eos=True)
    req: Request
    # Each side admits its requests the way its engine does: upstream's EngineCore rebuilds a
    # ``Request`` from the client's ``EngineCoreRequest``; an omni stage engine validates a
    # ``StageInput`` with its one input adapter (``engine.stage``). Both leave the message
    # object behind as garbage between requests, as in a server.
    adapter = InputAdapter(TALKER, max_model_len=512, block_hasher=h, live_ids=sched.requests)
    for i in range(n):
        prompt = [7 + (i * 13 + j) % 400 for j in range(16)]
        if omni:
            req = adapter.build(StageInput(f"r{i}", sp, prompt_token_ids=prompt, arrival_time=0.0))
        else:
            # As vLLM's EngineCore admits a request: from the client's EngineCoreRequest.
            message = EngineCoreRequest(
                request_id=f"r{i}",
                prompt_token_ids=prompt,
                mm_features=None,
                sampling_params=sp,
                pooling_params=None,
                arrival_time=0.0,
                lora_request=None,
                cache_salt=None,
                data_parallel_rank=None,
            )
            req = Request.from_engine_core_request(message, h)
        sched.add_request(req)
    _step(sched)  # prefill every request: from here on each step is N decodes
    return sched


def _step(sched) -> None:
    so = sched.schedule()
    ids = list(so.num_scheduled_tokens)
    out = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[11 + i % 200] for i in range(len(ids))],
    )
    sched.update_from_output(so, out)


def _profile(sched, steps: int) -> str:
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        _step(sched)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(40)
    return buf.getvalue()


def serve(conn: Connection, kind: str, n: int, omni: bool) -> None:
    """Child main: build the scheduler, then answer ``step`` / ``profile`` until ``stop``.

    A ``step`` answer is the seconds spent in the step alone, as (wall, cpu): ``perf_counter``
    taken here, so the pipe round trip is not in it, and this thread's CPU time
    (``thread_time``), which leaves out the time the step sat preempted by other processes on a
    shared machine. The CPU clock is read outside the wall-clock window, so neither figure pays
    for the other's clock. A failure is sent back as ``("error", traceback)`` so the parent
    fails with the child's traceback instead of waiting on a dead pipe.
    """
    try:
        sched = _ready(SCHEDULERS[kind], n, omni)
        conn.send(("ready", None))
        while True:
            cmd, arg = conn.recv()
            if cmd == "step":
                c = time.thread_time()
                t = time.perf_counter()
                _step(sched)
                wall = time.perf_counter() - t
                conn.send(("ok", (wall, time.thread_time() - c)))
            elif cmd == "profile":
                conn.send(("ok", _profile(sched, arg)))
            else:
                break
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


# What the forkserver imports once for all children: the expensive imports behind this module.
# This module itself cannot be preloaded: on 3.11 the forkserver does not get the parent's
# sys.path (where pytest put benchmarks/), so each child imports it (cheaply) on start.
_PRELOAD = [
    "vllm.v1.core.sched.scheduler",
    "conformance._core.config",
    "omni_runtime.adapters",
    "omni_runtime.conformance_subject",
    "omni_runtime.sched",
]


def _context():
    ctx = multiprocessing.get_context("forkserver")
    # Only takes effect if this process has not started its forkserver yet; otherwise the
    # children import what they need themselves, which is slower but measures the same.
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class StepChild:
    """A child process hosting one scheduler: ``step()`` runs one timed step there."""

    def __init__(self, kind: str, n: int, omni: bool) -> None:
        ctx = _context()
        self._conn, child_end = ctx.Pipe()
        self._proc = ctx.Process(
            target=serve, args=(child_end, kind, n, omni), name=f"sched-{kind}", daemon=True
        )
        self._proc.start()
        child_end.close()  # the parent keeps only its end, so a dead child reads as EOF

    def _call(self, cmd: str, arg: object = None) -> Any:
        try:
            self._conn.send((cmd, arg))
        except OSError:
            self._died()
        return self._answer()

    def _answer(self) -> Any:
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError):
            self._died()
        if status == "error":
            raise RuntimeError(f"{self._proc.name} failed:\n{value}")
        return value

    def _died(self) -> NoReturn:
        self._proc.join(timeout=5)  # for its exit code
        raise RuntimeError(f"{self._proc.name} exited (code {self._proc.exitcode})") from None

    def wait_ready(self) -> None:
        self._answer()

    def step(self) -> float:
        """Seconds the child spent in one ``schedule()`` + ``update_from_output()``."""
        return self.step_times()[0]

    def step_times(self) -> tuple[float, float]:
        """One step's (wall, CPU) seconds in the child (``serve``)."""
        wall, cpu = self._call("step")
        return float(wall), float(cpu)

    def profile(self, steps: int) -> str:
        """cProfile of ``steps`` steps in the child, top 40 by own time."""
        return str(self._call("profile", steps))

    def close(self) -> None:
        try:
            self._conn.send(("stop", None))
        except OSError:
            pass  # already gone; join below reaps it
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()
