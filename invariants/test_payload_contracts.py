"""Token-only payloads and payload construction (C-30, C-31, C-50, C-51, C-55).

Runner-level properties: upstream's scheduler schedules a generated batch (shared prefixes, a
tight block pool so preemption happens, aborts at generated steps) and the same
``SchedulerOutput`` stream is executed by an include-hidden and a token-only runner of the
subject (``RunnerProbes.payload_feature``) over the same weights; the ``postprocess`` case uses
a model that postprocesses its payloads (``RunnerProbes.postprocessed``). The lock-step
machines check the same clauses end to end in ``test_ar_inv_001_parity.py``.

Not applicable without a real worker and runner probes. Clauses and mutants: docs/contracts.md;
the method: docs/design.md, "How the suite checks".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import example, given

from conformance._core.capabilities import NotApplicable, PayloadView, RunnerProbes
from conformance._core.needs import require, require_worker
from conformance._core.vllm_compat import computed_before
from conformance._core.workload import AddRequest, ResetPrefixCache, Step
from invariants.audits import CheckingExecutor
from invariants.machines import (
    AuditedLockstep,
    harness_config,
    suite_settings,
    worker_harness_config,
)
from invariants.runners import RunnerExec, drive_runners
from invariants.strategies import Job, jobs

pytestmark = [pytest.mark.invariants]


REPREFILL_AFTER_CROSSING = [
    Job(prefix=0, length=1, max_tokens=6, abort_after=None),
    Job(prefix=0, length=28, max_tokens=6, abort_after=None),
    Job(prefix=2, length=30, max_tokens=4, abort_after=None),
    Job(prefix=2, length=1, max_tokens=3, abort_after=None),
]


def probes_of(subject: Any) -> RunnerProbes:
    require_worker(subject)
    return require(subject, "runner_probes", "runner probes")


def postprocess_probe(probes: RunnerProbes) -> Callable[[PayloadView], bool]:
    check = getattr(probes, "postprocessed", None)
    if check is None:
        raise NotApplicable("the subject's runner probes provide no payload postprocess model")
    return check


def check_token_only(
    workload: list[Job],
    subject: Any,
    *,
    prefix: bool = True,
    multimodal: bool = False,
    postprocess: bool = False,
) -> int:
    probes = probes_of(subject)
    postprocessed = postprocess_probe(probes) if postprocess else None
    # Asked for only when the case runs with it: a subject without it need not take the argument.
    post: dict[str, Any] = {"postprocess": True} if postprocess else {}
    cfg_h, cfg_t = (
        worker_harness_config(
            subject,
            probes.payload_feature(
                include_hidden=hidden, full_prefix=hidden, multimodal=multimodal, **post
            ),
            mode="sync",
            prefix=prefix,
        )
        for hidden in (True, False)
    )
    runners = [subject.make_worker(c) for c in (cfg_h, cfg_t)]
    execs = [CheckingExecutor(RunnerExec(r), probes.payloads) for r in runners]
    # Requests whose conditioning crossed. A request preempted after that step re-runs its
    # prompt (vLLM recomputes it) and so crosses its last prompt position again; the row already
    # crossed, in a step this synchronous run never drops, so it must not cross twice.
    delivered: set[str] = set()

    def on_step(step, sched, so, outs) -> None:
        for e in execs:
            assert not e.problems, e.problems[0]
        hid, tok = outs
        assert tok.sampled_token_ids == hid.sampled_token_ids, (
            f"C-30: step {step}: token-only sampled {tok.sampled_token_ids}, "
            f"include-hidden {hid.sampled_token_ids}"
        )
        computed = computed_before(so)
        crossing = set()
        for rid, n in so.num_scheduled_tokens.items():
            plen = sched.requests[rid].num_prompt_tokens
            if computed[rid] < plen <= computed[rid] + n:
                crossing.add(rid)
        tp = probes.payloads(tok)
        # A model's postprocess sees every request's payload of every step, so a postprocess
        # stage, like a multimodal one, has something to deliver on every step.
        if not crossing and not multimodal and postprocessed is None:
            assert tp is None, (
                f"C-50: step {step}: token-only step with nothing to deliver built "
                f"{sum(p is not None for p in tp)} payload objects ({len(tp)} slots)"
            )
        hp = probes.payloads(hid) or [None] * len(hid.req_ids)
        tp = tp or [None] * len(tok.req_ids)
        for rid, h, t in zip(hid.req_ids, hp, tp, strict=True):
            n = so.num_scheduled_tokens[rid]
            assert h is not None and h.hidden is not None, (
                f"C-51: step {step}: include-hidden slot of {rid} is empty"
            )
            end = computed[rid] + n
            assert h.start + h.hidden.shape[0] == end and h.start in (0, computed[rid]), (
                f"C-51/C-55: step {step}: {rid}'s rows cover [{h.start}, "
                f"{h.start + h.hidden.shape[0]}), scheduled [{computed[rid]}, {end})"
            )
            if t is not None:
                assert t.hidden is None or t.hidden.shape[0] == 0, (
                    f"C-30: step {step}: token-only payload of {rid} carries hidden rows"
                )
                assert (t.start, t.num_tokens) == (computed[rid], n), (
                    f"C-51: step {step}: token-only payload of {rid} covers "
                    f"[{t.start}, +{t.num_tokens}), scheduled [{computed[rid]}, +{n})"
                )
            if multimodal:
                check_multimodal(step, rid, n, h, t)
            if postprocessed is not None:
                check_postprocessed(step, rid, h, t, postprocessed)
            hc = h.conditioning
            tc = None if t is None else t.conditioning
            if rid in crossing and rid in delivered:
                assert tc is None and hc is None, (
                    f"C-31: step {step}: {rid}'s prefill conditioning crossed again when a "
                    "preempted request re-ran its prompt "
                    f"({'token-only' if tc is not None else 'include-hidden'} run)"
                )
            elif rid in crossing:
                delivered.add(rid)
                # The row of the last prompt position, as the include-hidden run computed it.
                row = h.hidden[sched.requests[rid].num_prompt_tokens - 1 - h.start]
                assert tc is not None, (
                    f"C-31: step {step}: {rid}'s prefill conditioning is missing in token-only mode"
                )
                assert torch.equal(tc, row), (
                    f"C-31: step {step}: {rid}'s token-only conditioning is not the row of its "
                    "last prompt position"
                )
            if hc is not None or rid in crossing:
                assert tc is not None or hc is None, (
                    f"C-31: step {step}: {rid}'s prefill conditioning is missing in token-only mode"
                )
                if hc is not None:
                    assert torch.equal(hc, tc), f"C-31: step {step}: {rid}'s conditioning differs"

    try:
        return drive_runners(workload, cfg_h, execs, on_step)
    finally:
        for r in runners:
            probes.shutdown(r)


def check_postprocessed(
    step: int,
    rid: str,
    h: PayloadView,
    t: PayloadView | None,
    postprocessed: Callable[[PayloadView], bool],
) -> None:
    """C-51: a model's payload postprocess runs on every request's payload, in both payload
    modes, also on one with nothing else to deliver; what it adds is there, and what the build
    made (id, positions, hidden rows, conditioning) is kept: the checks around this one hold
    the same payloads to the rows and conditioning the step scheduled."""
    assert t is not None, (
        f"C-51: step {step}: {rid}'s token-only slot is empty, but its model postprocesses "
        "every payload"
    )
    for mode, p in (("include-hidden", h), ("token-only", t)):
        assert p.request_id == rid, (
            f"C-51: step {step}: {mode} slot of {rid} holds {p.request_id}'s payload"
        )
        assert postprocessed(p), (
            f"C-51: step {step}: {mode} payload of {rid} lacks what its model's postprocess "
            f"adds (outputs {sorted(p.multimodal)})"
        )


def check_multimodal(step: int, rid: str, n: int, h: Any, t: Any) -> None:
    """C-30/C-51: a stage with per-token multimodal outputs delivers them for exactly the
    scheduled positions in both payload modes, and the token-only runner's (computed for the
    whole batch before the build) are the include-hidden builder's (computed from each
    request's rows), up to float rounding of the different batch shapes."""
    assert h.multimodal, f"C-51: step {step}: include-hidden payload of {rid} has no outputs"
    assert t is not None and set(t.multimodal) == set(h.multimodal), (
        f"C-30: step {step}: token-only payload of {rid} carries outputs "
        f"{None if t is None else sorted(t.multimodal)}, include-hidden {sorted(h.multimodal)}"
    )
    for name, hv in h.multimodal.items():
        tv = t.multimodal[name]
        assert tv is not None and hv.shape[0] == n and tv.shape == hv.shape, (
            f"C-51: step {step}: {rid}'s {name} rows: token-only "
            f"{None if tv is None else tuple(tv.shape)}, include-hidden {tuple(hv.shape)}, "
            f"{n} scheduled"
        )
        assert torch.allclose(tv, hv, rtol=1e-5, atol=1e-5), (
            f"C-30: step {step}: {rid}'s {name} differs between payload modes"
        )


@pytest.mark.clauses("C-30", "C-31", "C-50", "C-51", "C-55")
@pytest.mark.parametrize(
    ("prefix", "multimodal", "postprocess"),
    [(True, False, False), (False, False, False), (True, True, False), (True, False, True)],
    ids=["prefix", "noprefix", "multimodal", "postprocess"],
)
def test_token_only_payloads(conformance_subject, prefix, multimodal, postprocess):
    probes = probes_of(conformance_subject)
    if postprocess:
        postprocess_probe(probes)
    total = [0]

    @suite_settings(20)
    @given(jobs)
    # Found by the thorough profile: the 49-token prompt crosses at its second step, decodes
    # once, is preempted for blocks, and re-runs its prompt alone (C-31's exactly once).
    @example(REPREFILL_AFTER_CROSSING)
    def prop(workload: list[Job]) -> None:
        total[0] += check_token_only(
            workload,
            conformance_subject,
            prefix=prefix,
            multimodal=multimodal,
            postprocess=postprocess,
        )

    prop()
    assert total[0] > 0


@pytest.mark.clauses("C-31")
def test_conditioning_survives_stale_reset(conformance_subject):
    """Regression (found by this suite): add, step (the prefill is in flight), then
    ``reset_prefix_cache(reset_running_requests=True)`` under async scheduling drops the
    in-flight step as stale; the prefill conditioning must still be delivered exactly once."""
    probes = probes_of(conformance_subject)
    require(conformance_subject, "chunk_delivery", "chunk delivery")
    feature = probes.payload_feature(include_hidden=True, full_prefix=True)
    session = AuditedLockstep(
        harness_config(feature, mode="async", prefix=True), conformance_subject, feature=feature
    )
    try:
        session.apply(AddRequest("a", tuple(range(100, 130)), max_tokens=4))
        session.apply(Step())
        session.apply(ResetPrefixCache(reset_running_requests=True))
        session.drain()
        problems = session.teardown_problems()
    finally:
        session.shutdown()
    assert session.failure is None, session.failure.headline()
    assert not problems, problems


# Names of per-token outputs no model provides: plain, and one that reads like a real one.
UNKNOWN_OUTPUTS = ("no-such-output", "logits_")


def check_unknown_output(subject: Any, name: str) -> None:
    """A stage asking for a per-token output its model does not provide is refused when its
    worker is built, with an error naming the output (C-30): a runner that skipped it would
    deliver payloads without it, and the downstream stage would find out on its first read."""
    probes = probes_of(subject)
    unknown_feature = getattr(probes, "unknown_output_feature", None)
    if unknown_feature is None:
        raise NotApplicable("the subject's probes name no stage with an unknown output")
    cfg = worker_harness_config(subject, unknown_feature(name), mode="sync", prefix=True)
    try:
        runner = subject.make_worker(cfg)
    except Exception as exc:  # noqa: BLE001 - any refusal will do, if it names the output
        assert name in str(exc), (
            f"C-30: the stage asking for the unknown output {name!r} was refused with "
            f"{type(exc).__name__}: {exc!s:.200}, which does not name it"
        )
        return
    probes.shutdown(runner)
    raise AssertionError(
        f"C-30: a stage asking for the per-token output {name!r}, which its model does not "
        "provide, built a worker"
    )


@pytest.mark.clauses("C-30")
@pytest.mark.parametrize("name", UNKNOWN_OUTPUTS)
def test_an_unknown_output_is_refused(conformance_subject, name):
    check_unknown_output(conformance_subject, name)


def check_last_stage(workload: list[Job], subject: Any, *, include_hidden: bool) -> int:
    """Run ``workload`` on a stage with nobody downstream; raise AssertionError when its runner
    builds payload objects (C-50). Returns the steps run."""
    probes = probes_of(subject)
    final_feature = getattr(probes, "final_feature", None)
    if final_feature is None:
        raise NotApplicable("the subject's probes name no stage without a downstream")
    cfg = worker_harness_config(subject, final_feature(include_hidden), mode="sync", prefix=True)
    runner = subject.make_worker(cfg)

    def on_step(step: int, sched: Any, so: Any, outs: list[Any]) -> None:
        payloads = probes.payloads(outs[0])
        assert payloads is None, (
            f"C-50: step {step}: a stage with nobody downstream built payload objects {payloads}"
        )

    try:
        return drive_runners(workload, cfg, [RunnerExec(runner)], on_step)
    finally:
        probes.shutdown(runner)


@pytest.mark.clauses("C-50")
@pytest.mark.parametrize("include_hidden", [True, False], ids=["hidden", "token-only"])
def test_a_last_stage_builds_no_payloads(conformance_subject, include_hidden):
    """A stage with nobody downstream has nothing to deliver: its runner builds no payload
    objects, whatever its payload settings (hidden rows, multimodal outputs) would build for a
    downstream (C-50)."""
    probes_of(conformance_subject)
    steps = [0]

    @suite_settings(10)
    @given(jobs)
    def prop(workload: list[Job]) -> None:
        steps[0] += check_last_stage(workload, conformance_subject, include_hidden=include_hidden)

    prop()
    assert steps[0] > 0
