"""The quick half of the fault campaign (C-61, C-62): one fault at a time, with figures.

Each case runs the same four requests (three bystanders and ``bad``) through the pipeline with
one fault injected for ``bad`` (or, for the relay child, for whatever was in flight) and holds
the run to four things:

* the set of requests that ended in ``error`` is exactly the set that should have: the faulted
  one(s), nothing else;
* every other request completed, with text ids, codec ids and waveform equal to a fault-free
  run of the same prompts;
* every request has exactly one terminal outcome;
* afterwards the pipeline is clean: no request in any scheduler, runner or queue, every KV
  block free, no transfer progress, processor buffer, decoder state or connector backlog, and
  no process besides the relay children the connectors own.

The cases: the chunk processor raising on a request's first, a middle and its terminal step
(thinker and talker edges); the connector's send raising (link down, a send timing out) on a
first and on the terminal chunk; the pipe connector's relay child killed mid-stream, and
stalled until its receive times out; the payload builder raising, once or on every
retry (inline, and on the background builder thread); the code2wav decoder raising on a first, a middle and the terminal
chunk. Each runs under sync scheduling with inline materialization and async scheduling with
background materialization (the pipeline fixture of ``tests/test_pipeline_faults.py``).

The long cases (KV exhaustion under overload, a 1,000-request abort storm) are in
``benchmarks/test_bench_faults.py``. A fault in the model forward shared by a batch is not
here: its isolation is ``tests/test_pipeline_faults.py``'s.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import pytest
import torch

from omni_runtime.engine import OmniPipeline
from omni_runtime.engine.connectors import PipeConnector
from omni_runtime.engine.orchestrator import RequestResult
from omni_runtime.models import code2wav as code2wav_model
from omni_runtime.sched.transfer import accepts_new_token_ids
from tests import test_pipeline_faults as pipeline_faults
from tests.test_pipeline_faults import FaultyConnector, assert_clean, terminal_counts

# The module-scoped pipeline fixture (sync-inline and async-background), reused as it is.
pipeline = pipeline_faults.pipeline

PROMPTS = ["campaign one", "campaign two, a longer prompt", "the faulted one", "four"]
IDS = ["c1", "c2", "bad", "c4"]
LIMITS: dict[str, Any] = {"max_text_tokens": 6, "max_codec_tokens": 32}
WHEN = ["first", "middle", "terminal"]

_REFERENCES: dict[tuple[Any, ...], dict[str, RequestResult]] = {}
# One entry per checked run (requests, affected vs expected, outcomes, what was left, time):
# the rows ``benchmarks/test_bench_faults.py`` prints for the quick cases.
FIGURES: list[dict[str, Any]] = []


def reference(p: OmniPipeline) -> dict[str, RequestResult]:
    """The fault-free outputs of PROMPTS on this pipeline's switches (computed once each)."""
    key = (p.options.async_scheduling, p.options.materialization, repr(p.config.connectors))
    if key not in _REFERENCES:
        refs = p.generate(PROMPTS, **LIMITS, request_ids=[f"{rid}-ref" for rid in IDS])
        assert all(r.ok for r in refs)
        _REFERENCES[key] = {rid: r for rid, r in zip(IDS, refs, strict=True)}
    return _REFERENCES[key]


def same_output(got: RequestResult, ref: RequestResult) -> bool:
    return (
        got.text_token_ids == ref.text_token_ids
        and got.codec_token_ids == ref.codec_token_ids
        and got.waveform is not None
        and ref.waveform is not None
        and torch.equal(got.waveform, ref.waveform)
    )


def owned_children(p: OmniPipeline) -> set[int]:
    """The child processes the pipeline is meant to have: one relay per pipe connector."""
    return {
        c.process.pid
        for c in p.orchestrator.connectors.values()
        if isinstance(c, PipeConnector) and c.process.pid is not None
    }


def live_children() -> set[int]:
    """Live descendants of this process, without multiprocessing's resource tracker (one per
    process, started with the first spawned child and shared by every later one)."""
    out = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            if any("resource_tracker" in part for part in child.cmdline()):
                continue
        except psutil.NoSuchProcess:
            continue
        out.add(child.pid)
    return out


def run_and_check(
    p: OmniPipeline,
    expected_failed: set[str] | Callable[[], set[str]],
    *,
    step_hook: Callable[[OmniPipeline, int], None] | None = None,
    error_says: str | None = None,
    second_wave: Callable[[OmniPipeline], bool] | None = None,
) -> dict[str, RequestResult]:
    """Run IDS through ``p`` (the fault already installed) and check the campaign's four
    properties; returns the outcomes. With ``second_wave``, ``bad`` and the request after it
    are submitted only once that predicate holds (so the fault finds the others elsewhere)."""
    ref = reference(p)
    t0 = time.perf_counter()
    held = 2 if second_wave is not None else len(IDS)
    p.submit(PROMPTS[:held], **LIMITS, request_ids=IDS[:held])
    events = []
    steps = 0
    while p.has_work() or held < len(IDS):
        if held < len(IDS) and second_wave is not None and second_wave(p):
            p.submit(PROMPTS[held:], **LIMITS, request_ids=IDS[held:])
            held = len(IDS)
        events.extend(p.step())
        steps += 1
        if step_hook is not None:
            step_hook(p, steps)
    expected = expected_failed() if callable(expected_failed) else expected_failed
    counts = terminal_counts(events)
    assert counts == Counter(IDS), counts  # exactly one terminal outcome each (C-62)
    outcome = {e.request_id: e.result for e in events if e.kind == "finished"}
    failed = {rid for rid, r in outcome.items() if not r.ok}
    assert failed == expected, {rid: (r.finish_reason, r.error) for rid, r in outcome.items()}
    for rid in failed:
        assert outcome[rid].finish_reason == "error" and outcome[rid].error, outcome[rid]
        if error_says is not None:
            assert error_says in outcome[rid].error, outcome[rid].error
        assert outcome[rid].waveform is None
    for rid in set(IDS) - failed:
        assert same_output(outcome[rid], ref[rid]), rid
    assert_clean(p)
    assert live_children() == owned_children(p)
    leftovers = p.leftovers()
    FIGURES.append(
        {
            "requests": len(IDS),
            "affected": sorted(failed),
            "expected": sorted(expected),
            "exactly_one": sum(1 for n in counts.values() if n == 1),
            "blocks_in_use": sum(leftovers[sid]["blocks_in_use"] for sid in p.orchestrator.engines),
            "omni_leftovers": _nonempty(leftovers),
            "seconds": time.perf_counter() - t0,
        }
    )
    return outcome


def _nonempty(leftovers: Any) -> int:
    """How many entries of ``leftovers`` still hold something (0 when clean)."""
    if isinstance(leftovers, dict):
        return sum(_nonempty(v) for v in leftovers.values())
    return 1 if leftovers else 0


# ---- the chunk processor ----------------------------------------------------------------------


class FaultAt:
    """Wraps a stage's chunk processor: raises once for ``target`` on its first call, a middle
    call (the third, if it is not the last) or its terminal (``is_final``) call."""

    def __init__(self, inner: Any, target: str, when: str, after_release: bool = True) -> None:
        self.inner = inner
        self.after_release = after_release
        self.target = target
        self.when = when
        self.calls: Counter[str] = Counter()
        self.fired = False
        if getattr(inner, "requires_token_updates", False) is True:
            self.requires_token_updates = True
        self._pass_ids = accepts_new_token_ids(inner)

    def __getattr__(self, name: str) -> Any:
        # Audits ask the processor for its buffers (``pending_request_ids``).
        return getattr(self.inner, name)

    def __call__(self, request_id: str, payload: Any, is_final: bool, **kw: Any) -> Any:
        self.calls[request_id] += 1
        n = self.calls[request_id]
        hit = {
            "first": n == 1 and not is_final,
            "middle": n == 3 and not is_final,
            "terminal": is_final,
        }[self.when]
        fault = request_id == self.target and hit and not self.fired
        if fault and not (is_final and self.after_release):
            self.fired = True
            raise RuntimeError(f"injected processor fault ({self.when}) for {request_id}")
        out = (
            self.inner(request_id, payload, is_final, **kw)
            if self._pass_ids
            else self.inner(request_id, payload, is_final)
        )
        if fault:
            # The processor did its work (and released its buffer), then failed.
            self.fired = True
            raise RuntimeError(f"injected processor fault ({self.when}) for {request_id}")
        return out


@contextmanager
def processor_fault(
    p: OmniPipeline, stage: str, when: str, after_release: bool = True
) -> Iterator[FaultAt]:
    transfer = p.orchestrator.engines[stage].scheduler.transfer
    assert transfer is not None
    original = transfer.processor
    wrapper = FaultAt(original, "bad", when, after_release)
    transfer.set_processor(wrapper)
    try:
        yield wrapper
    finally:
        transfer.set_processor(original)


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_processor_fault_fails_only_its_request(pipeline, stage, when) -> None:
    reference(pipeline)
    with processor_fault(pipeline, stage, when) as fault:
        run_and_check(pipeline, {"bad"})
    assert fault.fired


def test_processor_fault_before_release_leaves_no_buffer(pipeline) -> None:
    reference(pipeline)
    with processor_fault(pipeline, "talker", "terminal", after_release=False) as fault:
        try:
            run_and_check(pipeline, {"bad"})
        finally:
            assert fault.fired
            # Put the module's pipeline back for the next tests whatever happened.
            pipeline.orchestrator.engines["talker"].scheduler.transfer.processor._buffers.clear()


# ---- the connector's send ---------------------------------------------------------------------


class SendFault(FaultyConnector):
    """Raises ``exc`` for ``bad``'s first non-final chunk, or its terminal one."""

    def __init__(self, when: str, exc: BaseException) -> None:
        super().__init__("bad")
        self.when = when
        self.exc = exc
        self.fired = False

    def send(self, chunk) -> None:
        hit = chunk.is_final if self.when == "terminal" else not chunk.is_final
        if chunk.request_id == self.bad and hit and not self.fired:
            self.fired = True
            raise self.exc
        self.sent += 1
        self._queue.append(chunk)


@pytest.mark.parametrize("when", ["first", "terminal"])
@pytest.mark.parametrize(
    "exc",
    [ConnectionError("link down"), TimeoutError("send timed out after 0.5 s")],
    ids=["raising", "timing-out"],
)
@pytest.mark.parametrize("edge", ["thinker", "talker"])
def test_connector_send_fault_fails_only_its_request(pipeline, edge, exc, when) -> None:
    p = pipeline
    reference(p)
    orch = p.orchestrator
    original = orch.connectors[edge]
    faulty = SendFault(when, exc)
    orch.connectors[edge] = faulty
    orch.engines[edge].set_sink(faulty)
    try:
        run_and_check(p, {"bad"})
    finally:
        orch.connectors[edge] = original
        orch.engines[edge].set_sink(original)
    assert faulty.fired


@pytest.mark.parametrize("fault", ["processor", "connector"])
def test_send_path_fault_message_names_its_cause(pipeline, fault) -> None:
    p = pipeline
    reference(p)
    orch = p.orchestrator
    if fault == "processor":
        with processor_fault(p, "thinker", "first"):
            outcome = run_and_check(p, {"bad"})
        cause = "injected processor fault"
    else:
        original = orch.connectors["thinker"]
        faulty = SendFault("first", ConnectionError("link down for bad"))
        orch.connectors["thinker"] = faulty
        orch.engines["thinker"].set_sink(faulty)
        try:
            outcome = run_and_check(p, {"bad"})
        finally:
            orch.connectors["thinker"] = original
            orch.engines["thinker"].set_sink(original)
        cause = "link down for bad"
    assert cause in (outcome["bad"].error or ""), outcome["bad"].error


# ---- the pipe connector's relay child ---------------------------------------------------------


@pytest.fixture(scope="module", params=[False, True], ids=["sync-inline-pipe", "async-bg-pipe"])
def pipe_pipeline(request):
    materialization = "background" if request.param else "inline"
    with OmniPipeline(
        async_scheduling=request.param, materialization=materialization, connector="pipe"
    ) as p:
        yield p


class RelayFault:
    """Stops the relay child of one edge before a step in which ``bad`` sends on it, then either
    kills it when the orchestrator receives (``killed``) or leaves it stalled until the receive
    times out (``stalled``). The requests whose chunks went into the stopped child are the ones
    that should fail."""

    def __init__(self, p: OmniPipeline, edge: str, how: str, monkeypatch) -> None:
        self.conn = p.orchestrator.connectors[edge]
        assert isinstance(self.conn, PipeConnector)
        self.how = how
        self.stopped_pid: int | None = None
        self.in_stopped: set[str] = set()
        self.fired = False
        self.edge = edge
        self.p = p
        real_send, real_recv = self.conn.send, self.conn.recv

        def send(chunk) -> None:
            if self.stopped_pid is not None:
                self.in_stopped.add(chunk.request_id)
            real_send(chunk)

        def recv():
            # Stays stopped until a step sent something into it (the talker sends a codec
            # chunk every few tokens only).
            if self.stopped_pid is None or not self.in_stopped:
                return real_recv()
            if how == "killed":
                os.kill(self.stopped_pid, signal.SIGKILL)
                self.conn.process.join(10)
            try:
                return real_recv()
            finally:
                self.stopped_pid = None

        monkeypatch.setattr(self.conn, "send", send)
        monkeypatch.setattr(self.conn, "recv", recv)
        if how == "stalled":
            monkeypatch.setattr(self.conn, "recv_timeout", 0.5)

    def before_step(self, p: OmniPipeline, steps: int) -> None:
        """Called after each step: arms the fault once ``bad`` is streaming on the edge."""
        track = p.orchestrator._tracks.get("bad")
        if self.fired or track is None or track.stage != self.edge:
            return
        # Mid-stream: at least one chunk of ``bad`` already crossed this edge.
        if self.edge == "talker" and not track.codec_ids:
            return
        if self.edge == "thinker" and len(track.text_ids) < 2:
            return
        self.fired = True
        self.stopped_pid = self.conn.process.pid
        os.kill(self.stopped_pid, signal.SIGSTOP)


@pytest.mark.parametrize("how", ["killed", "stalled"])
@pytest.mark.parametrize("edge", ["thinker", "talker"])
def test_relay_child_lost_mid_stream_fails_only_what_it_held(
    pipe_pipeline, edge, how, monkeypatch
) -> None:
    """The chunks in a dead (or stuck) relay are lost: exactly the requests that had a chunk in
    it fail; the connector starts a fresh relay and the others, and later requests, complete."""
    p = pipe_pipeline
    reference(p)
    old_pid = p.orchestrator.connectors[edge].process.pid
    fault = RelayFault(p, edge, how, monkeypatch)
    tracks = p.orchestrator._tracks

    def second_wave(p: OmniPipeline) -> bool:
        # Thinker edge: the first wave is in the talker by then; talker edge: it has finished.
        first = [tracks.get(rid) for rid in IDS[:2]]
        if edge == "thinker":
            return all(t is None or t.stage != "thinker" for t in first)
        return all(t is None for t in first)

    outcome = run_and_check(
        p,
        lambda: set(fault.in_stopped),
        step_hook=fault.before_step,
        error_says="lost",
        second_wave=second_wave,
    )
    monkeypatch.undo()
    # The stopped relay held a chunk of at least one request (``bad``, or whichever sent the
    # next codec chunk), and the others were elsewhere.
    assert fault.fired and 0 < len(fault.in_stopped) < len(IDS), fault.in_stopped
    conn = p.orchestrator.connectors[edge]
    assert conn.process.pid != old_pid and conn.process.is_alive()
    assert not psutil.pid_exists(old_pid) or psutil.Process(old_pid).status() == "zombie"
    assert {r for r, o in outcome.items() if not o.ok} == fault.in_stopped
    # The fresh relay serves the next requests.
    again = p.generate(PROMPTS[:1], **LIMITS)
    assert same_output(again[0], reference(p)["c1"])
    assert_clean(p)


# ---- the payload builder ----------------------------------------------------------------------


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "one-off"])
def test_builder_fault_fails_only_its_request(pipeline, persistent, monkeypatch) -> None:
    """The thinker's payload builder raises on a step shared by ``bad`` and bystanders (on the
    builder thread in background mode). The stage retries the step: a one-off fault fails
    nobody; a fault that recurs whenever ``bad`` is in the step fails ``bad`` alone."""
    p = pipeline
    reference(p)
    builder = p.orchestrator.engines["thinker"].runner.materializer.builder
    real_build = builder.build
    fired: list[list[str]] = []

    def build(plan, inputs):
        if "bad" in plan.req_ids and (persistent or not fired):
            fired.append(list(plan.req_ids))
            raise RuntimeError("injected builder fault")
        return real_build(plan, inputs)

    monkeypatch.setattr(builder, "build", build)
    run_and_check(p, {"bad"} if persistent else set(), error_says="injected builder fault")
    monkeypatch.undo()
    assert fired and len(fired[0]) > 1  # the fault hit a step shared with bystanders


# ---- the code2wav decoder ---------------------------------------------------------------------


@pytest.mark.parametrize("when", WHEN)
def test_decoder_fault_fails_only_its_request(pipeline, when, monkeypatch) -> None:
    """The streaming decoder itself raises (inside ``Code2WavStage.push``, so the stage's own
    clean-up runs) on ``bad``'s first, a middle or its terminal chunk."""
    p = pipeline
    reference(p)
    c2w = p.orchestrator.code2wav
    assert c2w is not None
    real_push = c2w.push
    real_decoder_push = code2wav_model.StreamingDecoder.push
    chunks: Counter[str] = Counter()
    armed: list[bool] = [False]
    fired: list[str] = []

    def push(chunk):
        chunks[chunk.request_id] += 1
        n = chunks[chunk.request_id]
        hit = {"first": n == 1, "middle": n == 3 and not chunk.is_final}.get(when, chunk.is_final)
        armed[0] = chunk.request_id == "bad" and hit and not fired
        try:
            return real_push(chunk)
        finally:
            armed[0] = False

    def decoder_push(self, codes):
        if armed[0]:
            fired.append(when)
            raise ValueError(f"injected decoder fault ({when})")
        return real_decoder_push(self, codes)

    monkeypatch.setattr(c2w, "push", push)
    monkeypatch.setattr(code2wav_model.StreamingDecoder, "push", decoder_push)
    run_and_check(p, {"bad"}, error_says="injected decoder fault")
    assert fired == [when]
