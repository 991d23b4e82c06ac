"""C-61 and C-62 under a worker step fault: the fault stays with the request it concerns.

A subject that declares ``fault_containment`` claims its worker contains a fault raised in its
model's forward to the requests whose data cause it. The check plants a fault the subject does
not choose: a pre-hook on the token embedding (``FaultContainment.embedding``) raises on a
poison token at the last prompt position of one request, the victim. Persistent: the victim
alone ends with ``FinishReason.ERROR``, everyone else with one normal outcome, nothing left
(C-06, C-04), and the victim's prompt, rerun, gives fault-free tokens. Transient: nobody fails
and tokens equal the fault-free run's. Trace headers stay on every output (C-07, C-61); chunks
go downstream as C-42/C-43 say. A fault that escapes the worker fails the check.

Not applicable to a subject that does not declare containment. The method:
docs/design.md, "How the suite checks"; clauses and mutants: docs/contracts.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance._core.capabilities import FaultContainment
from conformance._core.driver import WorkerExecutor, make_driver
from conformance._core.machine import client_trace_headers
from conformance._core.needs import require, require_worker
from conformance._core.vllm_compat import state as vc
from conformance._core.workload import AddRequest
from invariants.machines import suite_settings, worker_harness_config
from invariants.outcomes import Outcome
from invariants.strategies import Job, job_prompt, jobs

pytestmark = [pytest.mark.invariants]

MODES = ("sync", "async")
MATERIALIZATION = ("inline", "background")


class InjectedModelFault(RuntimeError):
    """The fault the check plants in the subject's model forward."""


@contextmanager
def poisoned(embedding: Any, poison: int, times: int | None) -> Iterator[list[int]]:
    """``embedding`` raises when its input holds ``poison`` (at most ``times`` times; None:
    always). Yields the count of faults raised so far."""
    raised = [0]

    def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        ids = args[0] if args else None
        if not isinstance(ids, torch.Tensor) or not bool((ids == poison).any()):
            return
        if times is not None and raised[0] >= times:
            return
        raised[0] += 1
        raise InjectedModelFault(f"poison token {poison} in the forward")

    if not isinstance(embedding, torch.nn.Module):
        raise AssertionError(
            f"C-61: the subject names {type(embedding).__name__} as its token embedding, which is "
            "not a torch module the fault can be planted in"
        )
    handle = embedding.register_forward_pre_hook(hook)
    try:
        yield raised
    finally:
        handle.remove()


def _drain(
    subject: Any,
    driver: Any,
    scheduler: Any,
    outcome: Outcome,
    max_steps: int,
    cause_field: str,
) -> None:
    while scheduler.has_requests() or driver.in_flight():
        if outcome.steps >= max_steps:
            raise AssertionError(f"C-62: the workload did not drain within {max_steps} steps")
        try:
            obs = driver.step()
        except InjectedModelFault as exc:
            raise AssertionError(
                f"C-61: step {outcome.steps}: the model fault escaped the subject's worker, which "
                f"declares it contains them ({exc}); under vLLM's EngineCore every request of "
                "the step would fail"
            ) from exc
        outcome.steps += 1
        # What the engine's caller receives: the cause must survive whatever the outputs cross.
        outcome.record(subject.receive_outputs(scheduler, obs.outputs), cause_field)
        outcome.record_chunks(subject, scheduler)


def run_workload(
    subject: Any,
    containment: FaultContainment,
    cfg: Any,
    prompts: dict[str, list[int]],
    max_tokens: dict[str, int],
    fault: tuple[int, int | None] | None,
    again: tuple[str, list[int], int],
    finals: dict[str, str | None],
) -> tuple[Outcome, Outcome, int]:
    """Run ``prompts`` (with ``fault`` = (poison, times) planted), drain, check conservation,
    then run ``again`` alone with no fault. ``finals``: each request's final stage (a request
    final at this stage sends nothing downstream). Returns both outcomes and the fault count."""
    field = getattr(containment, "cause_field", None) or "omni_error"
    scheduler = subject.build_scheduler(cfg)
    worker = subject.make_worker(cfg)
    try:
        pool = vc.block_pool(scheduler)
        initial = vc.num_free_blocks(pool)
        driver = make_driver(scheduler, WorkerExecutor(worker))
        first = Outcome()
        for i, (rid, prompt) in enumerate(prompts.items()):
            # Every request traced, so that the victim's error output must carry its headers.
            op = AddRequest(
                rid,
                tuple(prompt),
                max_tokens=max_tokens[rid],
                final_stage=finals.get(rid),
                trace_headers=client_trace_headers(i, 1 + i % 2),
            )
            request = subject.make_request(op, prompt, cfg, scheduler, float(i))
            subject.admit(scheduler, request)
            first.admitted(op)
        faults = 0
        if fault is None:
            _drain(subject, driver, scheduler, first, 400, field)
        else:
            with poisoned(containment.embedding(worker), fault[0], fault[1]) as raised:
                _drain(subject, driver, scheduler, first, 400, field)
            faults = raised[0]
        free = vc.num_free_blocks(pool)
        assert free == initial, f"C-06: {initial - free} blocks still held after the drain"
        left = subject.live_omni_ids(scheduler)
        assert not left, f"C-04: omni state left for {sorted(left)} after the drain"
        rid, prompt, limit = again
        op = AddRequest(rid, tuple(prompt), max_tokens=limit)
        subject.admit(scheduler, subject.make_request(op, prompt, cfg, scheduler, 1000.0))
        second = Outcome()
        _drain(subject, driver, scheduler, second, 200, field)
        return first, second, faults
    finally:
        containment.shutdown(worker)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def check_fault_stays_with_its_request(
    workload: list[Job],
    victim_index: int,
    subject: Any,
    *,
    mode: str,
    materialization: str,
    persistent: bool,
    final_here: Sequence[bool] = (),
) -> int:
    """Raise AssertionError on a C-61/C-62 violation; returns the steps run."""
    containment = require(subject, "fault_containment", "worker fault containment")
    cfg = worker_harness_config(
        subject, containment.feature(materialization), mode=mode, prefix=True
    )
    prompts = {f"f{i}": job_prompt(i, job) for i, job in enumerate(workload)}
    # Requests final at this stage send nothing downstream: a step of only those has no chunk,
    # and a failure reported in it is the only output change of that step.
    here = next((f for f in containment.feature(materialization).final_stages if f), None)
    finals = {
        rid: here if i < len(final_here) and final_here[i] else None
        for i, rid in enumerate(prompts)
    }
    limits = {f"f{i}": job.max_tokens for i, job in enumerate(workload)}
    victim = f"f{victim_index % len(workload)}"
    # The poison must reach the embedding only through the victim's prompt: no other prompt may
    # hold it, and no request may sample it (a decode embeds the sampled token, and the hook
    # would then fault a request the check calls innocent). Sampling depends on the victim's
    # prompt, so a candidate is kept only once a fault-free run with it never sampled it.
    excluded = {t for p in prompts.values() for t in p}
    base = prompts[victim][:-1]
    for _ in range(8):
        poison = min(t for t in range(1, 100_000) if t not in excluded)
        prompts[victim] = base + [poison]
        again = ("again", list(prompts[victim]), limits[victim])
        clean, clean_again, _ = run_workload(
            subject, containment, cfg, prompts, limits, None, again, finals
        )
        sampled = {t for out in (clean, clean_again) for ids in out.tokens.values() for t in ids}
        if poison not in sampled:
            break
        excluded |= sampled
    else:
        raise AssertionError("no poison token the fault-free runs never sample in 8 tries")
    fault = (poison, None if persistent else 1)
    got, got_again, faults = run_workload(
        subject, containment, cfg, prompts, limits, fault, again, finals
    )
    assert faults > 0, "the planted fault never fired (the victim was never embedded)"
    # C-61 lets a request fail with the victim when it was scheduled onto the victim's unwritten
    # blocks as a prefix hit; only one that shares a whole block with the victim's prompt can be.
    readers = {
        rid
        for rid, prompt in prompts.items()
        if persistent
        and rid != victim
        and _common_prefix(prompt, prompts[victim]) >= cfg.block_size
    }
    for rid in prompts:
        ends = got.terminal.get(rid, [])
        assert len(ends) == 1, f"C-62: {rid} ended {len(ends)} times: {ends}"
        if persistent and rid == victim:
            assert ends == ["error"], (
                f"C-61: {rid}, whose every forward faulted, ended {ends[0]!r}, not with an error"
            )
            if getattr(containment, "cause_field", None):
                cause = got.causes.get(rid, "")
                assert f"poison token {poison}" in cause, (
                    f"C-61: {rid} failed, but its {containment.cause_field} ({cause!r}) does not "
                    "carry the fault that failed it"
                )
        elif rid in readers and ends == ["error"]:
            continue
        else:
            assert ends != ["error"], (
                f"C-61: {rid} failed with an error, yet only "
                + (f"{victim}'s forward faulted" if persistent else "one forward faulted, once")
                + (f" (the subject says: {got.causes[rid]})" if rid in got.causes else "")
            )
            assert rid not in got.causes, (
                f"C-61: {rid} did not fail, yet its output carries a failure cause "
                f"{got.causes[rid]!r}"
            )
    for rid in prompts:
        if persistent and (rid == victim or got.terminal.get(rid) == ["error"]):
            continue
        assert got.tokens.get(rid) == clean.tokens.get(rid), (
            f"C-61: {rid}'s tokens differ from a fault-free run's: {got.tokens.get(rid)} vs "
            f"{clean.tokens.get(rid)}"
            + (
                f", though only {victim}'s forward faulted"
                if persistent
                else ", after a fault a retry cleared"
            )
        )
    assert got_again.tokens == clean_again.tokens, (
        f"C-61: {victim}'s prompt, run again after its fault, gives {got_again.tokens} and "
        f"{clean_again.tokens} after a fault-free run: a prefix-cache hit on KV never written"
    )
    # A failed request's error output is an output of it like any other (C-61), and its end
    # goes downstream like any other: one EOF, as its last chunk (C-43).
    here_only = {rid: finals[rid] is not None for rid in prompts}
    problems = clean.header_problems("C-07") + got.header_problems("C-61")
    problems += clean.chunk_problems(here_only, "C-43") + got.chunk_problems(here_only, "C-61")
    assert not problems, "; ".join(problems)
    return clean.steps + got.steps


@pytest.mark.clauses("C-61", "C-62")
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "transient"])
@pytest.mark.parametrize("mode,materialization", [("sync", "inline"), ("async", "background")])
def test_a_model_fault_stays_with_its_request(
    conformance_subject, mode, materialization, persistent
):
    require_worker(conformance_subject)
    require(conformance_subject, "fault_containment", "worker fault containment")
    total = [0]

    @suite_settings(8)
    @given(jobs, st.integers(0, 5), st.lists(st.booleans(), max_size=6))
    def prop(workload: list[Job], victim: int, final_here: list[bool]) -> None:
        total[0] += check_fault_stays_with_its_request(
            workload,
            victim,
            conformance_subject,
            mode=mode,
            materialization=materialization,
            persistent=persistent,
            final_here=final_here,
        )

    prop()
    assert total[0] > 0
