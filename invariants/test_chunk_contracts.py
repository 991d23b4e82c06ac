"""Chunk processors and token updates (C-40..C-45), with generated processors.

A lock-step program (upstream vs the subject, ``invariants.machines``) runs the subject's
processor feature (``ChunkDelivery.processor_feature``) with a generated, logging chunk
processor and an executor that attaches synthetic hidden rows to some steps of some requests
(``PayloadTokenSource``), mixing requests with and without a downstream in every batch. It
checks every call and chunk against C-40..C-45, C-51, C-62 and, for a subject whose chunks
cross a process boundary, C-46.

``test_rows_survive_a_reset_with_steps_in_flight`` resets the prefix cache with running
requests and steps in flight (async): no row of a step upstream drops as stale may reach the
processor, and every row the recompute owes must (C-45).

Not applicable without ``chunk_delivery`` or a ``processor_feature``. Clauses and mutants:
docs/contracts.md; how processors are drawn: docs/design.md, "How the suite checks".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize

from conformance._core.capabilities import ChunkDelivery, ChunkView, Feature, NotApplicable
from conformance._core.lockstep import Shrinker
from conformance._core.needs import require
from conformance._core.replay import failures_dir
from conformance._core.vllm_compat import environment_versions
from conformance._core.workload import AddRequest, Op, ResetPrefixCache, Step, Trace
from conformance.plugin import covers
from invariants.ledger import caller_ends
from invariants.machines import (
    PREFIXES,
    AuditedLockstep,
    InvariantMachine,
    MachineOutcome,
    MachineRun,
    harness_config,
    raise_failure,
    run_machine,
    suite_settings,
)
from invariants.strategies import (
    PROCESSOR_SHAPES,
    PayloadTokenSource,
    ProcessorCall,
    ProcessorSpec,
    RecordingProcessor,
    delivery_shapes,
    processor_specs,
    processor_specs_of,
    stable_hash,
)

pytestmark = [pytest.mark.invariants]


class ChunkMachine(InvariantMachine):
    """The audited lock-step machine with a generated processor (any shape) and payload-carrying
    steps; ``chunk_machine`` makes one whose processors have given shapes."""

    def __init__(self, run: ChunkRun) -> None:
        super().__init__(run)
        self.run: ChunkRun = run
        self.delivery: ChunkDelivery = require(run.subject, "chunk_delivery", "chunk delivery")
        self.source: PayloadTokenSource = payload_sources(self.session, self.delivery)
        self.spec: ProcessorSpec | None = None
        self.processor: RecordingProcessor | None = None

    @initialize(spec=processor_specs)
    def choose_processor(self, spec: ProcessorSpec) -> None:
        self.use_processor(spec)

    def use_processor(self, spec: ProcessorSpec) -> None:
        self.spec = spec
        self.processor = spec.build()
        attach_processor(self.delivery, self.session, self.source, self.processor)
        self.session.trace.meta["processor"] = spec.describe()

    def teardown(self) -> None:
        super().teardown()
        if self.processor is not None:
            self.run.processor_calls += len(self.processor.calls)
        if self.session.failure is None and not self.session.problems and self.processor:
            assert self.spec is not None
            problems = processor_problems(
                self.session, self.delivery, self.processor, self.spec, self.source.owed
            )
            if problems:
                self.run.chunk_failure = (self.session, self.spec, problems)
                raise AssertionError(
                    f"{self.spec.describe()}: {problems[0]}"
                    + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "")
                )


def chunk_machine(shapes: tuple[str, ...]) -> type[ChunkMachine]:
    """``ChunkMachine`` with processors of ``shapes`` (``PROCESSOR_SHAPES``) only."""
    specs = processor_specs_of(shapes)

    class ShapedChunkMachine(ChunkMachine):
        @initialize(spec=specs)
        def choose_processor(self, spec: ProcessorSpec) -> None:
            self.use_processor(spec)

    ShapedChunkMachine.__name__ = f"ChunkMachine[{','.join(shapes)}]"
    return ShapedChunkMachine


def payload_sources(session: Any, delivery: ChunkDelivery) -> PayloadTokenSource:
    """Give each side in this process a payload-carrying token source (under its
    ``CheckingExecutor``); the subject's. An oracle in its own process keeps its deterministic
    source: upstream reads no payload, and both draw the same tokens (checked here)."""
    for side in session.local_sides():
        base = side.executor.inner
        source = PayloadTokenSource(delivery, vocab=base.vocab)
        if (base.edges, base.num_drafts, base.aux) != ((), 0, None):
            # The payload source draws plain tokens only; the oracle across the pipe would not.
            raise NotApplicable(
                "the chunk machine's payload source draws no token edges, drafts or auxiliary "
                "outputs, which this configuration asks for"
            )
        side.executor.inner = source
    return session.sub.executor.inner


def attach_processor(
    delivery: ChunkDelivery, session: Any, source: PayloadTokenSource, processor: Any
) -> None:
    """Give the subject's scheduler ``processor``, and tell the subject's payload source what
    the processor has been handed (what ``PayloadTokenSource.owed`` is decided against)."""
    delivery.set_processor(session.sub.scheduler, processor)
    source.handed = lambda rid: handed_positions(delivery, processor.calls_for(rid))


def handed_positions(delivery: ChunkDelivery, calls: Any) -> list[int]:
    """The positions of the rows in the payloads of ``calls``, in call order."""
    handed: list[int] = []
    for c in calls:
        payload = delivery.payload_view(c.payload)
        if payload is not None and payload.hidden is not None:
            handed.extend(int(x) for x in payload.hidden[:, 1].tolist())
    return handed


def eof_reason_problems(
    rid: str, entry: Any, views: list[ChunkView], required: bool = False
) -> list[str]:
    """C-43: the EOF says why its request ended, as upstream's output did (an abort of a live
    request: ``abort``, or the reason it finished with in the same step), when the subject's
    chunks carry a reason at all; ``required`` (the delivery's ``eof_reasons``): every EOF
    must carry one."""
    eofs = [v for v in views if v.is_final]
    if len(eofs) != 1:
        return []
    if eofs[0].finish_reason is None:
        return [f"C-43: {rid}: its EOF chunk carries no finish reason"] if required else []
    # vLLM's reason strings, exactly ("stop", "length", "abort", "error"): a consumer that
    # matches them (an orchestrator ending a track on "abort" or "error") reads them so.
    said = str(eofs[0].finish_reason)
    ended = str(entry.finish_reason or "").lower()
    allowed = ({"abort"} if entry.aborted else set()) | ({ended} if ended else set())
    if allowed and said not in allowed:
        return [
            f"C-43: {rid}: its EOF chunk says it ended with {said!r}; upstream ended it with "
            f"{' or '.join(sorted(allowed))}"
        ]
    return []


def returned_data_problems(
    rid: str, delivery: ChunkDelivery, calls: list[ProcessorCall], views: list[ChunkView]
) -> list[str]:
    """C-43: what the processor returns is what goes downstream. Every non-final call that
    returned something other than ``None`` is delivered as a chunk of its own; one that
    returned ``None`` sends nothing, except that the tensors of its payload may still cross
    (C-31). ``is_final`` is a bool on every call: a processor may test it with ``is``."""
    loose = [c.is_final for c in calls if not isinstance(c.is_final, bool)]
    if loose:
        return [f"C-43: {rid}: the processor was called with is_final={loose[0]!r}, not a bool"]
    returned = tensors_only = 0
    for c in calls:
        if c.is_final:
            continue
        if c.returned is not None:
            returned += 1
        else:
            payload = delivery.payload_view(c.payload)
            tensors_only += payload is not None and payload.has_tensors
    sent = sum(1 for v in views if not v.is_final)
    if not returned <= sent <= returned + tensors_only:
        return [
            f"C-43: {rid}: {sent} chunks before the EOF, but the processor returned data from "
            f"{returned} non-final calls (and None from {tensors_only} whose payload carried "
            "tensors)"
        ]
    return []


def processor_problems(
    session: Any,
    delivery: ChunkDelivery,
    proc: RecordingProcessor,
    spec: ProcessorSpec,
    owed: dict[str, set[int]] | None = None,
) -> list[str]:
    problems: list[str] = []
    views: dict[str, list] = {}
    for chunk in session.sub.chunks:
        view = delivery.view(chunk)
        views.setdefault(view.request_id, []).append(view)
    reasons_required = bool(getattr(delivery, "eof_reasons", False))
    for rid, entry in session.ledger.items():
        calls = proc.calls_for(rid)
        if not session.facts.get(rid, {}).get("has_downstream"):
            if calls:
                problems.append(
                    f"C-42: {rid} is final here but the processor was called {len(calls)}x"
                )
            continue
        batched = [c for c in calls if c.batched]
        if batched and not spec.may_batch:
            problems.append(
                f"C-40: {rid}: {len(batched)} calls went through on_token_batch, which this "
                f"processor's own __call__ does not stand for ({spec.describe()}): it is called "
                "per request"
            )
        finals = [c for c in calls if c.is_final]
        ended_by = caller_ends(
            entry,
            abort_eof=getattr(delivery, "abort_eof", True),
            error_eof=getattr(delivery, "error_eof", True),
        )
        if ended_by is not None:
            # The caller ends the request downstream: no final call is owed, and at most one
            # may come (the request finished in the step the abort met).
            if len(finals) > 1 or (finals and not calls[-1].is_final):
                problems.append(
                    f"C-43: {rid} ({ended_by}): {len(finals)} final processor calls of {len(calls)}"
                )
        elif len(finals) != 1 or not calls or not calls[-1].is_final:
            problems.append(f"C-43: {rid}: {len(finals)} final processor calls of {len(calls)}")
        problems.extend(returned_data_problems(rid, delivery, calls, views.get(rid, [])))
        problems.extend(eof_reason_problems(rid, entry, views.get(rid, []), reasons_required))
        if spec.declaration is True and len(calls) < len(entry.steps):
            # Declared: called on every step that accepted ids, handed them or not (C-40).
            problems.append(
                f"C-40: {rid}: a processor declaring token updates was called {len(calls)}x, "
                f"but the request accepted ids on {len(entry.steps)} steps"
            )
        if spec.declaration is True and spec.takes_ids:
            got = [t for c in calls for t in (c.ids or ())]
            if got != entry.emitted:
                problems.append(
                    f"C-40/C-44: {rid}: processor saw ids {got} but the request accepted "
                    f"{entry.emitted}"
                )
        if spec.declaration is not True:
            for c in calls:
                payload = delivery.payload_view(c.payload)
                if not c.is_final and (payload is None or not payload.has_tensors):
                    problems.append(
                        f"C-41: {rid}: processor with requires_token_updates="
                        f"{spec.declaration!r} called on a step without a tensor payload"
                    )
                    break
        for c in calls:
            if c.ids_ref is not None:
                expected = list(c.ids or ()) + ([-1] if spec.mutate_ids else [])
                if list(c.ids_ref) != expected:
                    problems.append(
                        f"C-44: {rid}: ids handed to the processor changed after the call: "
                        f"{c.ids} -> {list(c.ids_ref)}"
                    )
                    break
        seen: list[int] = []
        owner = float(stable_hash(rid) % 100003)
        for v in sorted(views.get(rid, []), key=lambda v: v.seq):
            p = v.payload
            if p is None or p.hidden is None:
                continue
            if p.hidden.shape[0] and not torch.all(p.hidden[:, 0] == owner):
                problems.append(f"C-51: {rid}: chunk {v.seq} carries another request's rows")
            seen.extend(int(x) for x in p.hidden[:, 1].tolist())
        if len(seen) != len(set(seen)) or seen != sorted(seen):
            dup = sorted({x for x in seen if seen.count(x) > 1})
            problems.append(f"C-45: {rid}: positions delivered twice or out of order {dup or seen}")
        ended = str(entry.finish_reason or "").lower()
        if owed is not None and ended and not entry.aborted and "abort" not in ended:
            # Trimming drops only rows already handed over: every position the executor owes
            # downstream (``PayloadTokenSource.owed``), and that the request computed (an
            # output dropped as stale or past the request's end computed nothing), reaches the
            # processor once.
            computed = len(entry.prompt) + len(entry.emitted) - 1
            expected = {p for p in owed.get(rid, ()) if p < computed}
            handed = handed_positions(delivery, calls)
            missing = sorted(expected - set(handed))
            twice = sorted({p for p in handed if handed.count(p) > 1})
            if missing:
                problems.append(
                    f"C-45: {rid}: rows for positions {missing} were computed but never handed "
                    "to the processor (trimming may drop only rows already delivered)"
                )
            elif twice:
                problems.append(f"C-45: {rid}: rows for positions {twice} handed over twice")
    return problems


@dataclass
class ChunkRun(MachineRun):
    """A chunk machine's run, with what its processors saw: how many calls they were handed
    (none at all: no chunk contract was checked), and a processor problem with its session and
    processor (``raise_chunk_failure`` saves it as a trace)."""

    processor_calls: int = 0
    chunk_failure: tuple[AuditedLockstep, ProcessorSpec, list[str]] | None = None


def chunk_run(recorder: Any, subject: Any, mode: str) -> ChunkRun:
    """The property's run for ``subject`` (``run_machine(run, settings, ChunkMachine)``)."""
    delivery: ChunkDelivery = require(subject, "chunk_delivery", "chunk delivery")
    feature = delivery.processor_feature
    if feature is None:
        raise NotApplicable(f"subject {subject.name!r} provides no processor feature")
    return ChunkRun(
        recorder,
        subject,
        feature,
        harness_config(feature, mode=mode, prefix=True),
        f"chunk-{mode}",
    )


@pytest.mark.clauses("C-40", "C-41", "C-42", "C-43", "C-44", "C-45", "C-62")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_chunk_contracts(request, conformance, conformance_subject, mode):
    calls = 0
    for run, outcome in runs_per_shape(
        lambda: chunk_run(conformance, conformance_subject, mode),
        suite_settings(40),
        delivery_shapes(conformance_subject),
    ):
        # What the sessions really checked beyond the marker (C-46 where chunks cross a process).
        covers(request.node, run.clauses)
        raise_chunk_failure(outcome, run)
        raise_failure(outcome, run)
        calls += run.processor_calls
    if not calls:
        raise NotApplicable(
            f"subject {conformance_subject.name!r}: no generated processor was called in any "
            "program (no request sent anything downstream), so no chunk contract was checked"
        )


# ---- processor problems as replayable traces ----------------------------------------------

# What ``omni-conformance replay`` imports to re-run a chunk trace (``replay_chunk``).
REPLAY_CHUNK = "invariants.test_chunk_contracts:replay_chunk"


def chunk_problems(trace: Trace, subject: Any, feature: Feature, spec: ProcessorSpec) -> list[str]:
    """Re-run ``trace`` in an audited session with ``spec``'s processor: the session's problems
    or first difference, else (after the drain) the processor's problems."""
    delivery: ChunkDelivery = require(subject, "chunk_delivery", "chunk delivery")
    session = AuditedLockstep(trace.config, subject, feature=feature, prefixes=dict(trace.prefixes))
    try:
        source = payload_sources(session, delivery)
        processor = spec.build()
        attach_processor(delivery, session, source, processor)
        for op in trace.ops:
            if session.failure is not None or session.problems:
                break
            session.apply(op)
        if session.failure is None and not session.problems:
            session.drain()
        if session.problems:
            return list(session.problems)
        if session.failure is not None:
            return [f"first difference: {session.failure.headline()}"]
        return processor_problems(session, delivery, processor, spec, source.owed)
    finally:
        session.shutdown()


def replay_chunk(trace: Trace, subject: Any) -> list[str]:
    """The problems a chunk trace shows on ``subject`` now (empty: it does not reproduce)."""
    f = trace.meta["feature"]
    feature = Feature(f["name"], f["additional_config"], tuple(f["final_stages"]))
    return chunk_problems(trace, subject, feature, ProcessorSpec(**trace.meta["processor_spec"]))


def raise_chunk_failure(outcome: MachineOutcome, run: ChunkRun) -> None:
    """A processor problem (``ChunkMachine.teardown``), shrunk and saved as a trace."""
    if outcome.error is None or run.chunk_failure is None:
        return
    session, spec, problems = run.chunk_failure
    found = Trace(session.config, list(session.trace.ops), dict(session.trace.prefixes))
    path, problem, trace = save_chunk_trace(
        found, problems, run.subject, session.feature, spec, run.recorder, run.name
    )
    raise AssertionError(
        f"{spec.describe()}: {problem} ({len(trace.ops)} operations)\ntrace: {path}"
    ) from outcome.error


def save_chunk_trace(
    found: Trace,
    problems: list[str],
    subject: Any,
    feature: Feature,
    spec: ProcessorSpec,
    recorder: Any,
    name: str,
) -> tuple[Path, str, Trace]:
    """Shrink ``found`` to the smallest trace whose chunk problems keep the first one's clause
    and save it for ``replay`` (``replay_chunk``); the path, the problem it shows, the trace."""
    clause = problems[0].split(":", 1)[0]

    def same_clause(t: Trace) -> bool:
        return any(p.split(":", 1)[0] == clause for p in chunk_problems(t, subject, feature, spec))

    trace = Shrinker(found, same_clause).run().trace
    same = [p for p in chunk_problems(trace, subject, feature, spec) if p.startswith(clause)]
    if not same:
        trace, same = found, problems
    trace.meta = {
        "kind": "audit",
        "replay": REPLAY_CHUNK,
        "subject": getattr(recorder, "subject_spec", None) or subject.name,
        "test": name,
        "feature": {
            "name": feature.name,
            "additional_config": dict(feature.additional_config),
            "final_stages": list(feature.final_stages),
        },
        "processor": spec.describe(),
        "processor_spec": dataclasses.asdict(spec),
        **environment_versions(),
        "problem": same[0],
        "found": {"ops": len(found.ops), "problem": problems[0]},
    }
    path = failures_dir(getattr(recorder, "failures_dir", None)) / f"{name}.json"
    trace.save(path)
    if hasattr(recorder, "trace"):
        recorder.trace = str(path)
    return path, same[0], trace


def runs_per_shape(
    make_run: Callable[[], MachineRun],
    budget: settings,
    shapes: tuple[str, ...] = PROCESSOR_SHAPES,
) -> Iterator[tuple[MachineRun, MachineOutcome]]:
    """The chunk machine once per processor shape, each with ``budget``'s examples: drawn among
    all processors, the shapes that take the token-update paths (one declaration value of seven)
    would meet a small budget's examples only by chance, and a share of the budget per shape
    met preemption with trimming too rarely in the payload-driven one. Stops after the first
    failing run."""
    for shape in shapes:
        run = make_run()
        outcome = run_machine(run, budget, chunk_machine((shape,)))
        yield run, outcome
        if outcome.error is not None:
            return


def reset_in_flight(subject: Any, lengths: list[int], steps: int) -> tuple[Feature, Trace]:
    """One async workload: requests of ``lengths`` prompt tokens, ``steps`` steps, a reset of the
    prefix cache with running requests (upstream drops the steps in flight as stale); with the
    subject's processor feature."""
    feature = require(subject, "chunk_delivery", "chunk delivery").processor_feature
    if feature is None:
        raise NotApplicable(f"subject {subject.name!r} provides no processor feature")
    ops: list[Op] = [
        AddRequest(f"r{i}", tuple(100 + (7 * i + j) % 200 for j in range(n)), max_tokens=6)
        for i, n in enumerate(lengths)
    ]
    ops += [Step()] * steps + [ResetPrefixCache(reset_running_requests=True)]
    return feature, Trace(harness_config(feature, mode="async", prefix=True), ops, dict(PREFIXES))


def check_rows_survive_a_reset(
    subject: Any, lengths: list[int], steps: int, spec: ProcessorSpec
) -> int:
    """``reset_in_flight``'s workload, then the drain; raises AssertionError on a C-45 violation
    (or any other audited one). Returns the operations run."""
    problems = reset_problems(subject, lengths, steps, spec)
    assert not problems, reset_failure(spec, lengths, steps, problems[0])
    return len(lengths) + steps + 1


def reset_problems(subject: Any, lengths: list[int], steps: int, spec: ProcessorSpec) -> list[str]:
    """The chunk problems of ``reset_in_flight``'s workload with ``spec``'s processor."""
    feature, trace = reset_in_flight(subject, lengths, steps)
    return chunk_problems(trace, subject, feature, spec)


def reset_failure(spec: ProcessorSpec, lengths: list[int], steps: int, problem: str) -> str:
    return f"{spec.describe()}, lengths {lengths}, {steps} steps: {problem}"


@pytest.mark.clauses("C-45")
def test_rows_survive_a_reset_with_steps_in_flight(conformance, conformance_subject):
    require(conformance_subject, "chunk_delivery", "chunk delivery")
    # hypothesis runs the failing example once more at the end: the last one kept is saved.
    failed: list[tuple[list[int], int, ProcessorSpec, list[str]]] = []

    @suite_settings(10)
    @given(
        st.lists(st.integers(1, 40), min_size=1, max_size=3),
        st.integers(1, 4),
        processor_specs_of(delivery_shapes(conformance_subject)),
    )
    def prop(lengths: list[int], steps: int, spec: ProcessorSpec) -> None:
        problems = reset_problems(conformance_subject, lengths, steps, spec)
        if problems:
            failed.append((lengths, steps, spec, problems))
        assert not problems, reset_failure(spec, lengths, steps, problems[0])

    try:
        prop()
    except AssertionError:
        if not failed:
            raise
        lengths, steps, spec, problems = failed[-1]
        feature, found = reset_in_flight(conformance_subject, lengths, steps)
        path, problem, trace = save_chunk_trace(
            found,
            problems,
            conformance_subject,
            feature,
            spec,
            conformance,
            "C-45-rows-survive-a-reset",
        )
        raise AssertionError(
            f"{reset_failure(spec, lengths, steps, problem)} ({len(trace.ops)} operations)"
            f"\ntrace: {path}"
        ) from None
