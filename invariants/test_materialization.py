"""Inline and background materialization (C-50, C-52, C-53, C-54).

Runner-level properties over generated batches (``invariants.runners.drive_runners``): one
``SchedulerOutput`` stream runs through an inline and a background runner of one include-hidden
stage, and every reusable buffer (``RunnerProbes.reusable_buffers``) is overwritten after
``sample_tokens`` returns, before the output is collected; background builds are deferred to
collection, so no race decides the verdict. With the real builder thread
(``RunnerProbes.instrument``) it checks where collection and builds run and that a builder
error is never lost; with a build fault that persists for one request
(``MaterializationProbe.fail_request``), that recovery fails that request alone and, where the
subject declares retry budgets, costs exactly the builds it declares.

Not applicable without a real worker and runner probes. Clauses and mutants: docs/contracts.md;
the method: docs/design.md, "How the suite checks".
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance._core.capabilities import Feature, NotApplicable, RunnerProbes
from conformance._core.needs import cause_naming_problem, require, require_worker
from invariants.machines import suite_settings, worker_harness_config
from invariants.runners import RunnerExec, drive_runners, same_view
from invariants.strategies import Job, jobs

pytestmark = [pytest.mark.invariants]


def probes_of(subject: Any) -> RunnerProbes:
    require_worker(subject)
    return require(subject, "runner_probes", "runner probes")


def stage_config(
    subject: Any, probes: RunnerProbes, materialization: str, *, include_hidden: bool = True
) -> Any:
    """A stage with per-token multimodal outputs: built from the hidden rows in include-hidden
    mode, handed to the builder by the runner in token-only mode (both snapshot paths)."""
    feature = probes.payload_feature(
        include_hidden=include_hidden,
        full_prefix=include_hidden,
        materialization=materialization,
        multimodal=True,
    )
    return worker_harness_config(subject, feature, mode="sync", prefix=True)


def scribbler(probes: RunnerProbes):
    def scribble(runner: Any) -> None:
        """Overwrite every buffer C-52 says the runner may reuse as soon as the step returns."""
        for buf in probes.reusable_buffers(runner):
            if isinstance(buf, np.ndarray):
                buf.fill(3)
            else:
                buf.fill_(float("nan"))

    return scribble


class _Checked:
    """A build that crashes on overwritten buffers is a C-52/C-53 violation, not a test error."""

    def __init__(self, inner: RunnerExec) -> None:
        self.inner = inner

    def execute(self, so: Any) -> Any:
        try:
            return self.inner.execute(so)
        except (IndexError, RuntimeError, ValueError) as exc:
            raise AssertionError(
                f"C-52/C-53: the background build failed after the runner reused its buffers: "
                f"{type(exc).__name__}: {exc}"
            ) from exc


def check_inline_equals_background(
    workload: list[Job], subject: Any, *, include_hidden: bool = True
) -> int:
    probes = probes_of(subject)
    cfg_i = stage_config(subject, probes, "inline", include_hidden=include_hidden)
    inline = subject.make_worker(cfg_i)
    background = subject.make_worker(
        stage_config(subject, probes, "background", include_hidden=include_hidden)
    )
    probes.defer_background_builds(background)
    # The inline runner's builds, counted: a runner that recovers from failing builds (by
    # rebuilding the step another way) would deliver the same payloads from a broken build path.
    counted = probes.instrument(inline)
    delivered = [0]
    scribble = scribbler(probes)
    execs = [RunnerExec(inline, scribble), _Checked(RunnerExec(background, scribble))]

    def on_step(step, sched, so, outs) -> None:
        a, b = outs
        assert a.sampled_token_ids == b.sampled_token_ids, (
            f"C-52: step {step}: tokens inline {a.sampled_token_ids} "
            f"background {b.sampled_token_ids}"
        )
        pa, pb = probes.payloads(a), probes.payloads(b)
        assert (pa is None) == (pb is None), f"C-50/C-52: step {step}: payload lists {pa} vs {pb}"
        if pa is None or pb is None:
            return
        delivered[0] += 1
        assert len(pa) == len(a.req_ids) and len(pb) == len(b.req_ids), "C-53: slots != req_ids"
        for rid, x, y in zip(a.req_ids, pa, pb, strict=True):
            assert same_view(x, y), (
                f"C-52: step {step}: {rid}'s payload differs inline vs background"
            )
            assert x is None or x.hidden is None or not torch.isnan(x.hidden).any(), (
                f"C-53: step {step}: inline payload of {rid} read an overwritten buffer"
            )

    try:
        steps = drive_runners(workload, cfg_i, execs, on_step)
    finally:
        probes.shutdown(inline)
        probes.shutdown(background)
    assert counted.builds == delivered[0], (
        f"C-50/C-54: in a run without a fault the inline runner started {counted.builds} "
        f"builds for {delivered[0]} steps that delivered payloads: each such step builds once"
    )
    return steps


@pytest.mark.clauses("C-50", "C-52", "C-53")
@pytest.mark.parametrize("include_hidden", [True, False], ids=["hidden", "token-only"])
def test_inline_equals_background_under_buffer_reuse(conformance_subject, include_hidden):
    probes_of(conformance_subject)
    total = [0]

    @suite_settings(30)
    @given(jobs)
    def prop(workload: list[Job]) -> None:
        total[0] += check_inline_equals_background(
            workload, conformance_subject, include_hidden=include_hidden
        )

    prop()
    assert total[0] > 0


# ---- C-54 ---------------------------------------------------------------------------------


class InjectedBuildError(RuntimeError):
    pass


class _Stop(Exception):
    pass


def check_threads_and_errors(workload: list[Job], fail_at: int, subject: Any) -> None:
    """Real builder thread: who collects connector output, who builds, and where errors go."""
    probes = probes_of(subject)
    cfg = stage_config(subject, probes, "background")
    runner = subject.make_worker(cfg)
    probe = probes.instrument(runner)
    probe.fail_build(fail_at, InjectedBuildError(f"build {fail_at}"))
    main = threading.get_ident()
    executed = [0]
    raised: list[BaseException] = []

    def on_step(step, sched, so, outs) -> None:
        if so.total_num_scheduled_tokens:
            executed[0] += 1

    recovered: list[Any] = []

    class Exec(RunnerExec):
        def execute(self, so: Any) -> Any:
            before = probe.builds
            try:
                out = super().execute(so)
            except InjectedBuildError as exc:
                # The engine fails the step here; the run ends with the error surfaced.
                raised.append(exc)
                raise _Stop from exc
            if before < fail_at <= probe.builds:
                # The failing build was this step's, and get_output returned: recovered.
                recovered.append(out)
            return out

    try:
        drive_runners(workload, cfg, [Exec(runner)], on_step)
    except _Stop:
        executed[0] += 1
    finally:
        probes.shutdown(runner)
    collected = probe.collector_threads
    assert set(collected) <= {main}, "C-54: connector output collected off the calling thread"
    assert len(collected) == executed[0], (
        f"C-54: connector output collected {len(collected)}x for {executed[0]} executed steps"
    )
    assert main not in probe.builder_threads(), "C-54: a build ran on the caller"
    # The probe's own record of where builds ran, not the subject's: recovery rebuilds a failed
    # build on the calling thread, so a broken builder path (nothing submitted, wrong arguments)
    # would still deliver every payload. Without a planted fault no build may run here.
    observed = getattr(probe, "build_threads", None)
    if not fail_at and observed is not None:
        assert main not in observed, (
            f"C-54: {observed.count(main)} of {len(observed)} builds ran on the calling thread "
            "in a run without any fault: the background builder path failed and recovery hid it"
        )
        # The subject's record of its builder threads is what the check above the probe's
        # reads: it must name the threads the builds ran on, or that check passes vacuously.
        unrecorded = set(observed) - probe.builder_threads()
        assert not unrecorded, (
            f"C-54: builds ran on {len(unrecorded)} thread(s) the subject's builder_threads() "
            "does not name"
        )
    if fail_at and probe.builds >= fail_at and not raised:
        assert recovered, f"C-54: the builder error of build {fail_at} was lost"
        out = recovered[0]
        payloads = probes.payloads(out)
        missing = [
            rid
            for rid, p in zip(out.req_ids, payloads or [None] * len(out.req_ids), strict=True)
            if p is None
        ]
        assert not missing, (
            f"C-54: build {fail_at} raised and get_output neither re-raised it nor rebuilt the "
            f"step: no payload for {missing}"
        )


@pytest.mark.clauses("C-54")
def test_builder_thread_and_errors(conformance_subject):
    probes_of(conformance_subject)

    @suite_settings(20)
    @given(jobs, st.integers(0, 6))  # 0: no fault planted
    def prop(workload: list[Job], fail_at: int) -> None:
        check_threads_and_errors(workload, fail_at, conformance_subject)

    prop()


class PersistentBuildError(RuntimeError):
    pass


def check_recovery_isolates_a_persistent_build_fault(
    workload: list[Job],
    victim_index: int,
    subject: Any,
    times: int | None = None,
    *,
    include_hidden: bool = True,
) -> int:
    """Background builds always fail for one request; recovery must fail it alone (C-54).
    With ``times``, builds of a batch holding it fail but it alone fails only its first
    ``times`` builds: a fault recovery may outlast when it builds each request alone, so the
    request may end up failed or not, but failed exactly when it has no payload (recovery that
    rebuilt it and still reports its old error is caught). Returns the number of steps whose
    builds failed."""
    probes = probes_of(subject)
    failed_of = getattr(probes, "failed_requests", None)
    cfg_i = stage_config(subject, probes, "inline", include_hidden=include_hidden)
    inline = subject.make_worker(cfg_i)
    cfg_b = stage_config(subject, probes, "background", include_hidden=include_hidden)
    background = subject.make_worker(cfg_b)
    probe = probes.instrument(background)
    fail_request = getattr(probe, "fail_request", None)
    if fail_request is None or failed_of is None:
        probes.shutdown(inline)
        probes.shutdown(background)
        raise NotApplicable("the subject's probes cannot plant a per-request build fault")
    victim = f"j{victim_index % len(workload)}"
    error = PersistentBuildError(f"planted build fault of {victim}")
    if times is None:
        fail_request(victim, error)
    else:
        try:
            fail_request(victim, error, times=times)
        except TypeError:
            probes.shutdown(inline)
            probes.shutdown(background)
            raise NotApplicable(
                "the subject's probes cannot plant a build fault that clears"
            ) from None
    fired = [0]

    def on_step(step, sched, so, outs) -> None:
        a, b = outs
        assert a.sampled_token_ids == b.sampled_token_ids, (
            f"C-54: step {step}: a build fault changed the tokens: inline {a.sampled_token_ids} "
            f"background {b.sampled_token_ids}"
        )
        pa, pb = probes.payloads(a), probes.payloads(b)
        failed = failed_of(b)
        if pa is None:
            assert pb is None and not failed, (
                f"C-50/C-54: step {step}: payloads {pb}, failed {failed}"
            )
            return
        assert pb is not None and len(pb) == len(b.req_ids), (
            f"C-53/C-54: step {step}: the recovered step has payload slots {pb} for {b.req_ids}"
        )
        expected_failed = {victim} & set(b.req_ids)
        fired[0] += bool(expected_failed)
        built: set[str] = set()
        if times is not None:
            # Whether recovery outlasts the fault is the subject's choice (its retries); what
            # it reports must match what it delivered.
            built = {rid for rid, p in zip(b.req_ids, pb, strict=True) if p is not None}
            expected_failed -= built
        for rid, cause in failed.items():
            assert str(error) in str(cause), (
                f"C-54: step {step}: {rid} is reported failed with cause {cause!r}, which does "
                f"not carry the build's error ({error})"
            )
            unnamed = cause_naming_problem(subject, cfg_b.additional_config, str(cause), error)
            assert unnamed is None, f"C-54/C-61: step {step}: {rid}'s cause {cause!r}: {unnamed}"
        assert set(failed) == expected_failed, (
            f"C-54: step {step}: "
            + (
                f"every build holding {victim} raised"
                if times is None
                else f"the first {times} builds holding {victim} raised; {sorted(built)} got a "
                "payload"
            )
            + f"; the recovered step reports {sorted(failed)} failed, not {sorted(expected_failed)}"
        )
        for rid, x, y in zip(a.req_ids, pa, pb, strict=True):
            if rid in expected_failed:
                assert y is None, f"C-54: step {step}: failed request {rid} still has a payload"
            else:
                assert same_view(x, y), (
                    f"C-54: step {step}: {rid}'s recovered payload differs from the inline one "
                    f"(only {victim}'s builds failed)"
                )

    try:
        drive_runners(workload, cfg_i, [RunnerExec(inline), RunnerExec(background)], on_step)
        return fired[0]
    finally:
        probes.shutdown(inline)
        probes.shutdown(background)


@pytest.mark.clauses("C-54")
@pytest.mark.parametrize("include_hidden", [True, False], ids=["hidden", "token-only"])
def test_recovery_isolates_a_persistent_build_fault(conformance_subject, include_hidden):
    """Token-only too: a rebuilt request's multimodal outputs come from the runner, not from
    hidden rows, and recovery must hand them over as the first build did."""
    probes_of(conformance_subject)
    total = [0]

    @suite_settings(15)
    @given(jobs, st.integers(0, 5))
    def prop(workload: list[Job], victim: int) -> None:
        total[0] += check_recovery_isolates_a_persistent_build_fault(
            workload, victim, conformance_subject, include_hidden=include_hidden
        )

    prop()
    assert total[0] > 0, "the planted build fault never fired"


@pytest.mark.clauses("C-54")
def test_recovery_reports_a_fault_it_outlasted_as_cleared(conformance_subject):
    """A per-request build fault that every batch build meets but that clears after one to
    three builds of the request alone: the request is failed exactly when recovery gave up on
    it before the fault cleared, never when its payload was rebuilt; every other request's
    payload equals the inline runner's."""
    probes_of(conformance_subject)
    total = [0]

    @suite_settings(15)
    @given(jobs, st.integers(0, 5), st.integers(1, 3))
    def prop(workload: list[Job], victim: int, times: int) -> None:
        total[0] += check_recovery_isolates_a_persistent_build_fault(
            workload, victim, conformance_subject, times
        )

    prop()
    assert total[0] > 0, "the planted build fault never fired"


def check_recovery_builds_as_configured(
    workload: list[Job], victim_index: int, subject: Any, feature: Feature
) -> int:
    """Every background build holding one request fails, under ``feature``'s retry budget: each
    step that holds it must cost exactly ``RunnerProbes.recovery_builds(feature, n)`` builds
    (C-54). Returns the number of such steps."""
    probes = probes_of(subject)
    cfg = worker_harness_config(subject, feature, mode="sync", prefix=True)
    runner = subject.make_worker(cfg)
    # Each step's builds run when its output is collected, so a step's count is its own.
    probes.defer_background_builds(runner)
    probe = probes.instrument(runner)
    fail_request = getattr(probe, "fail_request", None)
    if fail_request is None:
        probes.shutdown(runner)
        raise NotApplicable("the subject's probes cannot plant a per-request build fault")
    victim = f"j{victim_index % len(workload)}"
    fail_request(victim, PersistentBuildError(f"planted build fault of {victim}"))
    counted = [0, 0]  # builds so far, steps checked

    def on_step(step: int, sched: Any, so: Any, outs: list[Any]) -> None:
        (out,) = outs
        builds, counted[0] = probe.builds - counted[0], probe.builds
        if probes.payloads(out) is None or victim not in out.req_ids:
            return
        n = len(out.req_ids)
        want = probes.recovery_builds(feature, n)  # type: ignore[attr-defined]
        assert builds == want, (
            f"C-54: step {step} ({n} requests, {victim}'s builds always failing) cost {builds} "
            f"builds under {feature.name}; the stage's retry budget makes that {want}"
        )
        counted[1] += 1

    try:
        drive_runners(workload, cfg, [RunnerExec(runner)], on_step)
        return counted[1]
    finally:
        probes.shutdown(runner)


@pytest.mark.clauses("C-54")
def test_recovery_builds_as_often_as_configured(conformance_subject):
    """A persistent per-request build fault under each retry budget the subject declares: each
    step holding the failing request costs exactly the builds that budget allows."""
    probes = probes_of(conformance_subject)
    features = getattr(probes, "retry_features", lambda: ())()
    if not features or not hasattr(probes, "recovery_builds"):
        raise NotApplicable("the subject's probes declare no retry budgets to hold recovery to")
    total = [0]
    for feature in features:

        @suite_settings(max(1, 12 // len(features)))
        @given(jobs, st.integers(0, 5), st.just(feature))
        def prop(workload: list[Job], victim: int, budget: Feature) -> None:
            total[0] += check_recovery_builds_as_configured(
                workload, victim, conformance_subject, budget
            )

        prop()
    assert total[0] > 0, "no step held the request whose builds fail"


class AbandonedBuildError(RuntimeError):
    pass


def check_uncollected_build_error_surfaces(workload: list[Job], drop_at: int, subject: Any) -> bool:
    """The background build of the ``drop_at``-th step that schedules tokens raises, and nobody
    collects that step's output (C-54). vLLM's engine keeps at most two steps in flight
    (``max_concurrent_batches``): when the next step is handed back the dropped one may still be
    collected, so nothing may be raised yet; once the step after that is handed back it was
    abandoned, and its error must reach the caller from that step: not swallowed, and not
    retried away as though it were that step's own fault. An inline twin drives the scheduler,
    so the dropped output costs the workload nothing. Returns whether two steps ran after the
    dropped one (or the error surfaced): otherwise the example checked nothing."""
    probes = probes_of(subject)
    cfg_i = stage_config(subject, probes, "inline")
    inline = subject.make_worker(cfg_i)
    background = subject.make_worker(stage_config(subject, probes, "background"))
    probe = probes.instrument(background)
    error = AbandonedBuildError(f"planted fault in the build of step {drop_at}, never collected")
    executed = [0]  # steps that scheduled tokens, handed to the background runner so far
    dropped: list[int] = []
    raised: list[int] = []

    class Dropping(RunnerExec):
        def execute(self, so: Any) -> Any:
            n = executed[0]
            executed[0] += bool(so.total_num_scheduled_tokens)
            drop = not dropped and n == drop_at and bool(so.total_num_scheduled_tokens)
            if drop:
                # Every earlier output was collected, so every earlier build has ended: the
                # next build started is this step's.
                probe.fail_build(probe.builds + 1, error)
            try:
                out = self.runner.execute_model(so)
                if out is None:
                    out = self.runner.sample_tokens(None)
                get = getattr(out, "get_output", None)
                if drop:
                    if get is None:
                        raise NotApplicable("background steps hand back no uncollected output")
                    dropped.append(n)
                    return None
                return get() if get is not None else out
            except AbandonedBuildError as exc:
                raised.append(n)
                raise _Stop from exc

    try:
        drive_runners(workload, cfg_i, [RunnerExec(inline), Dropping(background)], lambda *_: None)
    except _Stop:
        pass
    finally:
        probes.shutdown(inline)
        probes.shutdown(background)
    if not dropped:
        return False
    if raised:
        assert raised[0] == dropped[0] + 2, (
            f"C-54: the build error of step {dropped[0]}, whose output nobody collected, was "
            f"raised from step {raised[0]}: "
            + (
                "the engine may still collect that output then (two steps are in flight)"
                if raised[0] <= dropped[0] + 1
                else "not from the step after next, when the output was known abandoned"
            )
        )
        return True
    assert executed[0] < dropped[0] + 3, (
        f"C-54: the build error of step {dropped[0]}, whose output nobody collected, was lost: "
        f"{executed[0] - dropped[0] - 1} later steps ran and none raised it"
    )
    return False


@pytest.mark.clauses("C-54")
def test_an_uncollected_build_error_is_raised_later(conformance_subject):
    probes_of(conformance_subject)
    checked = [0]

    @suite_settings(15)
    @given(jobs, st.integers(0, 4))
    def prop(workload: list[Job], drop_at: int) -> None:
        checked[0] += check_uncollected_build_error_surfaces(workload, drop_at, conformance_subject)

    prop()
    assert checked[0] > 0, "no example ran two steps past the dropped one"
