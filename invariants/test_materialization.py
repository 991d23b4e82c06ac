"""Inline and background materialization (C-50, C-52, C-53, C-54).

Runner-level properties over generated batches (``invariants.machines.drive_runners``): the same
``SchedulerOutput`` stream is executed by an inline and a background runner of one include-hidden
stage (prefix-cache merges on), and, right after ``sample_tokens`` returns and *before* the
output is collected, every persistent runner buffer (query offsets, scheduled counts, positions,
slot mapping, conditioning index, hidden buffer) is overwritten with garbage. The background
runner's builder is made lazy (``DeferredPool``: the build runs only when the output is
collected), so the overwrite deterministically happens before the build — no race decides the
verdict.

What can fail, and why:

* C-52/C-53 — payloads (hidden rows, conditioning, start, counts) or tokens differ between
  inline and background, i.e. one of them read a buffer after the runner reused it (background
  must snapshot; inline must consume before returning).
* C-53 — a payload list that is not aligned with the runner's ``req_ids`` list object it reuses.
* C-54 — with the real builder thread: connector output is collected on a thread other than the
  calling one, or not exactly once per executed step; a payload build ran on the calling
  thread; a builder exception is lost instead of re-raised from ``get_output`` (or, for an
  output nobody collected, from a later step).

Positive controls: mutants ``background_no_snapshot``, ``builder_error_swallowed``,
``connector_collected_on_builder``.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np
import pytest
import torch
from hypothesis import given

from invariants.machines import (
    RunnerExec,
    WorkerSubject,
    drive_runners,
    harness_config,
    suite_settings,
)
from invariants.strategies import STAGES, Feature, Job, jobs
from omni_runtime.payload import same_payload

pytestmark = [pytest.mark.invariants]


def stage_feature(materialization: str) -> Feature:
    stage = {
        "stage_id": "thinker",
        "stages": list(STAGES),
        "downstream": ["talker"],
        "omni_pooler_payload_include_hidden": True,
        "downstream_needs_full_prefix": True,
        "multimodal_outputs": ["logits"],
        "materialization": materialization,
    }
    return Feature(f"mat-{materialization}", {"omni_stage": stage}, use_worker=True)


class LazyFuture(Future):
    """A future whose work runs when its result is first asked for."""

    def __init__(self, fn, args) -> None:
        super().__init__()
        self._call = (fn, args)

    def _run(self) -> None:
        if self._call is not None:
            fn, args = self._call
            self._call = None
            try:
                self.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - delivered through the future
                self.set_exception(exc)

    def result(self, timeout=None):
        self._run()
        return super().result(timeout)

    def exception(self, timeout=None):
        self._run()
        return super().exception(timeout)

    def done(self) -> bool:
        return self._call is None


class DeferredPool:
    def submit(self, fn, *args):
        return LazyFuture(fn, args)

    def shutdown(self, wait: bool = True) -> None:
        return None


def scribble(runner) -> None:
    """Overwrite every buffer C-52 says the runner may reuse as soon as the step returns."""
    for buf in runner.persistent_buffers().values():
        if isinstance(buf, np.ndarray):
            buf.fill(3)
        else:
            buf.fill_(float("nan"))


def check_inline_equals_background(workload: list[Job], *, subject=None) -> int:
    subject = subject or WorkerSubject()
    cfg_i = harness_config(stage_feature("inline"), mode="sync", prefix=True)
    cfg_b = harness_config(stage_feature("background"), mode="sync", prefix=True)
    inline = subject.make_worker(cfg_i)
    background = subject.make_worker(cfg_b)
    background.materializer._executor = DeferredPool
    execs = [RunnerExec(inline, scribble), _Checked(RunnerExec(background, scribble))]

    def on_step(step, sched, so, outs) -> None:
        a, b = outs
        assert a.sampled_token_ids == b.sampled_token_ids, (
            f"C-52: step {step}: tokens inline {a.sampled_token_ids} "
            f"background {b.sampled_token_ids}"
        )
        pa, pb = a.omni_payloads, b.omni_payloads
        assert (pa is None) == (pb is None), f"C-50/C-52: step {step}: payload lists {pa} vs {pb}"
        if pa is None:
            return
        assert len(pa) == len(a.req_ids) and len(pb) == len(b.req_ids), "C-53: slots != req_ids"
        for rid, x, y in zip(a.req_ids, pa, pb, strict=True):
            assert same_payload(x, y), f"C-52: step {step}: {rid}'s payload differs inline vs background"
            assert x is None or not torch.isnan(x.hidden).any(), (
                f"C-53: step {step}: inline payload of {rid} read an overwritten buffer"
            )

    try:
        return drive_runners(workload, cfg_i, execs, on_step, subject=subject)
    finally:
        inline.shutdown()
        background.shutdown()


class _Checked:
    """A build that crashes on overwritten buffers is a C-52/C-53 violation, not a test error."""

    def __init__(self, inner: RunnerExec) -> None:
        self.inner = inner

    def execute(self, so):
        try:
            return self.inner.execute(so)
        except (IndexError, RuntimeError, ValueError) as exc:
            raise AssertionError(
                f"C-52/C-53: the background build failed after the runner reused its buffers: "
                f"{type(exc).__name__}: {exc}"
            ) from exc


@pytest.mark.clauses("C-50", "C-52", "C-53")
def test_inline_equals_background_under_buffer_reuse():
    total = [0]

    @suite_settings(30)
    @given(jobs)
    def prop(workload: list[Job]) -> None:
        total[0] += check_inline_equals_background(workload)

    prop()
    assert total[0] > 0


# ---- C-54 ---------------------------------------------------------------------------------


class InjectedBuildError(RuntimeError):
    pass


def check_threads_and_errors(workload: list[Job], fail_at: int, *, subject=None) -> None:
    """Real builder thread: who collects connector output, who builds, and where errors go."""
    subject = subject or WorkerSubject()
    cfg = harness_config(stage_feature("background"), mode="sync", prefix=True)
    runner = subject.make_worker(cfg)
    main = threading.get_ident()
    collected: list[int] = []
    original_collect = runner.collect_connector_output

    def collect():
        collected.append(threading.get_ident())
        return original_collect()

    runner.collect_connector_output = collect
    builds = [0]
    original_build = runner.materializer.builder.build

    def build(plan, inputs):
        builds[0] += 1
        if builds[0] == fail_at:
            raise InjectedBuildError(f"build {fail_at}")
        return original_build(plan, inputs)

    runner.materializer.builder.build = build
    executed = [0]
    raised: list[BaseException] = []

    def on_step(step, sched, so, outs) -> None:
        if so.total_num_scheduled_tokens:
            executed[0] += 1

    class Exec(RunnerExec):
        def execute(self, so):
            try:
                return super().execute(so)
            except InjectedBuildError as exc:
                # The engine fails the step here; the run ends with the error surfaced.
                raised.append(exc)
                raise _Stop from exc

    try:
        drive_runners(workload, cfg, [Exec(runner)], on_step, subject=subject)
    except _Stop:
        executed[0] += 1
    finally:
        runner.shutdown()
    assert set(collected) <= {main}, "C-54: connector output collected off the calling thread"
    assert len(collected) == executed[0], (
        f"C-54: connector output collected {len(collected)}x for {executed[0]} executed steps"
    )
    assert main not in runner.materializer.builder_thread_ids, "C-54: a build ran on the caller"
    if builds[0] >= fail_at:
        assert raised, f"C-54: the builder error of build {fail_at} was lost"


class _Stop(Exception):
    pass


@pytest.mark.clauses("C-54")
def test_builder_thread_and_errors():
    from hypothesis import strategies as st

    @suite_settings(20)
    @given(jobs, st.integers(1, 6))
    def prop(workload: list[Job], fail_at: int) -> None:
        check_threads_and_errors(workload, fail_at)

    prop()
