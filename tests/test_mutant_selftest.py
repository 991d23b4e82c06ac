"""Mutant self-test: every runtime mutant is killed by the invariant that names it.

For each mutant in ``tests/mutants/runtime_mutants.py`` this applies the mutant (a subclass or a
patch, undone afterwards), runs the property the mutant names (its ``probe``: the same functions
and machines ``pytest -m invariants`` runs) with a fixed hypothesis budget, and asserts that the
property fails with the mutant's clause. The failing programs are then replayed on the unmodified
runtime; a kill counts only if they pass there (a property that fails the unmodified runtime too
raised a false alarm, not a kill).

Two lanes. ``test_mutant_is_killed`` (the CI lane) stops at the first failing program: finding
it is the kill, and shrinking it was most of the time (double_eof_on_abort: 0.2 s without the
shrink phase, 123 s with it). ``test_counterexample_is_short`` (marked ``exhaustive``, its own
lane) also lets hypothesis shrink, and asserts the shrunk program is at most 12 workload
operations long (requests + steps + aborts + resets for the lock-step machines, jobs for the
runner-level properties, 1 for single-input properties).

Why this can fail: a mutant that survives means the invariant it names cannot see the defect
(a check that never fails); a counterexample longer than 12 operations means the property or
its strategies shrink badly. ``test_mutant_kill_table`` prints the kill rate and the table
mutant -> clause -> caught -> program length.
"""

from __future__ import annotations

import importlib.util
import shutil
import time
import unittest
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from hypothesis.database import InMemoryExampleDatabase

from conformance._core.axes import AXES
from conformance._core.clauses import unknown
from tests.mutants import runtime_mutants as CATALOGUE

MAX_SHRUNK_OPS = 12

# Deterministic, bounded: derandomized, short programs so shrinking is quick, and the shrink phase
# on (the exhaustive lane reports shrunk lengths; the CI lane takes it out, ``DETECT``). The
# database is set per run (``run_mutant``), to replay what the mutant failed on.
MUTANT_SETTINGS = settings(
    phases=tuple(Phase),
    # One failure, the smallest: two distinct bugs would arrive as an ExceptionGroup.
    report_multiple_bugs=False,
    max_examples=60,
    stateful_step_count=20,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=False,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)


@dataclass
class Verdict:
    mutant: str
    clause: str
    probe: str
    caught: bool
    shrunk_ops: int | None
    message: str
    seconds: float


# ---- probes: each returns (error or None, length of the failing input) --------------------


def _feature(subject: Any, name: str) -> Any:
    from conformance._core.needs import features_of

    return {f.name: f for f in features_of(subject)}[name]


def _machine_probe(
    feature_name: str, mode: str = "sync", prefix: bool = True, speculative: int = 0
):
    def probe(subject: Any, cfg: settings) -> tuple[BaseException | None, int]:
        from invariants.machines import LocalRecorder, MachineRun, harness_config, run_machine

        feature = _feature(subject, feature_name)
        config = harness_config(
            feature, mode=mode, prefix=prefix, num_speculative_tokens=speculative
        )
        run = MachineRun(LocalRecorder(subject), subject, feature, config, f"mutant-{feature_name}")
        outcome = run_machine(run, cfg)
        return _failure(outcome.error), outcome.ops

    return probe


# Axes whose behaviour needs longer programs than the probes' default: the chunked Mamba axis
# hands a partial tail only when an abort lands in the one step after a prefill chunk stops
# at the prompt's sub-block checkpoint, which 20-step programs do not draw.
AXIS_PROBE_SETTINGS: dict[str, dict[str, int]] = {
    "hybrid-mamba-connector-chunked": {"max_examples": 12, "stateful_step_count": 50},
}


def _axis_probe(axis_name: str, mode: str, feature_name: str = "off"):
    """The scheduler-axis property (``invariants/test_scheduler_axes.py``) on one axis."""

    def probe(subject: Any, cfg: settings) -> tuple[BaseException | None, int]:
        cfg = settings(cfg, **AXIS_PROBE_SETTINGS.get(axis_name, {}))
        from conformance._core.axes import DEFERRED_SECTIONS, axis
        from invariants.machines import (
            LocalRecorder,
            MachineRun,
            axis_machine,
            harness_config,
            run_machine,
        )

        chosen = axis(axis_name)
        feature = _feature(subject, feature_name)
        config = chosen.config(harness_config(feature, mode=mode, prefix=True))
        run = MachineRun(
            LocalRecorder(subject),
            subject,
            feature,
            config,
            f"mutant-{axis_name}-{mode}",
            request_values=chosen.request_values,
            defer=DEFERRED_SECTIONS,
        )
        outcome = run_machine(run, cfg, axis_machine(chosen))
        return _failure(outcome.error), outcome.ops

    return probe


def _failure(error: BaseException | None) -> BaseException | None:
    """A property's failure, or None. A replay (``run_mutant``) that had no program to run (the
    mutant failed on a probe's fixed input, or in the chunk probe's other mode) is reported by
    hypothesis as a skip: nothing failed."""
    return None if isinstance(error, unittest.SkipTest) else error


def _chunk_probe(subject: Any, cfg: settings) -> tuple[BaseException | None, int]:
    from invariants.machines import LocalRecorder
    from invariants.test_chunk_contracts import chunk_run, runs_per_shape

    ops = 0
    for mode in ("sync", "async"):
        # As the test runs it: one run per processor shape, sharing the budget.
        for _, outcome in runs_per_shape(
            lambda mode=mode: chunk_run(LocalRecorder(subject), subject, mode), cfg
        ):
            if _failure(outcome.error) is not None:
                return outcome.error, outcome.ops
            ops = outcome.ops
    return None, ops


def _given_probe(
    strategy: Any,
    check: Callable[..., Any],
    size: Callable[..., int],
    examples: tuple[Any, ...] = (),
):
    """``examples``: values the property meets first in every run (a scenario a deeper profile
    found that a 30-example draw need not)."""

    def probe(subject: Any, cfg: settings) -> tuple[BaseException | None, int]:
        last = [0]

        def prop(value: Any) -> None:
            last[0] = size(value)
            check(value, subject)

        for value in examples:
            prop = example(value)(prop)
        prop = settings(cfg, max_examples=30)(given(strategy)(prop))

        try:
            prop()
        except Exception as exc:  # noqa: BLE001 - any failure of the property is a kill
            return _failure(exc), last[0]
        return None, last[0]

    return probe


def _malformed_probe(subject: Any, cfg: settings) -> tuple[BaseException | None, int]:
    """What ``test_malformed_inputs_rejected_at_adapter`` checks: the well-formed inputs, then
    every defect kind, each in a run of its own."""
    from invariants.test_ar_inv_002_adapters import check_every_defect, check_wellformed_accepted

    probe = subject.input_adapter()
    scheduler = probe.scheduler()
    try:
        check_wellformed_accepted(probe, scheduler)
        check_every_defect(probe, scheduler, settings(cfg, max_examples=120))
    except Exception as exc:  # noqa: BLE001 - any failure of the property is a kill
        return _failure(exc), 1
    return None, 1


def _static_probe(subject: Any, tmp: Path) -> tuple[BaseException | None, int]:
    from invariants.test_ar_inv_002_adapters import layout_constructions

    layout = subject.source_layout()
    copy = tmp / "omni_runtime"
    shutil.copytree(layout.payload_root, copy, ignore=shutil.ignore_patterns("__pycache__"))
    planted = copy / "sched" / "transfer.py"
    planted.write_text(
        planted.read_text()
        + "\n\ndef _mutant_rebuild(p):\n    return StagePayload(p.request_id, 0, p.num_tokens)\n"
    )
    offenders = layout_constructions(layout, copy)
    if offenders:
        return AssertionError(f"C-11: StagePayload constructed outside adapters: {offenders}"), 1
    return None, 1


def _jobs_probe(check_name: str, module: str, **kw: Any):
    def probe(subject: Any, cfg: settings) -> tuple[BaseException | None, int]:
        from invariants.strategies import jobs

        mod = importlib.import_module(module)
        fn = getattr(mod, check_name)
        return _given_probe(jobs, lambda w, s: fn(w, s, **kw), len)(subject, cfg)

    return probe


def _token_only_reprefill_probe(subject: Any, cfg: settings) -> tuple[BaseException | None, int]:
    """The token-only property without the prefix cache, meeting first the workload in which a
    request preempted after its conditioning crossed re-runs its prompt."""
    from invariants.strategies import jobs
    from invariants.test_payload_contracts import REPREFILL_AFTER_CROSSING, check_token_only

    return _given_probe(
        jobs,
        lambda w, s: check_token_only(w, s, prefix=False),
        len,
        examples=(REPREFILL_AFTER_CROSSING,),
    )(subject, cfg)


def _builder_errors_probe(subject: Any, cfg: settings) -> tuple[BaseException | None, int]:
    from invariants.strategies import jobs
    from invariants.test_materialization import check_threads_and_errors

    return _given_probe(
        st.tuples(jobs, st.integers(0, 3)),  # 0: no fault planted
        lambda v, s: check_threads_and_errors(v[0], v[1], s),
        lambda v: len(v[0]),
    )(subject, cfg)


def _builder_recovery_probe(subject: Any, cfg: settings) -> tuple[BaseException | None, int]:
    from invariants.strategies import jobs
    from invariants.test_materialization import check_recovery_isolates_a_persistent_build_fault

    return _given_probe(
        st.tuples(jobs, st.integers(0, 5)),
        lambda v, s: check_recovery_isolates_a_persistent_build_fault(v[0], v[1], s),
        lambda v: len(v[0]),
    )(subject, cfg)


def _connector_faults_probe(subject: Any, cfg: settings) -> tuple[BaseException | None, int]:
    """What ``test_a_connector_fault_stays_with_its_request`` checks, each position in turn."""
    from invariants.strategies import jobs
    from invariants.test_send_path_faults import (
        check_connector_fault_stays_with_its_request,
        fault_specs,
    )

    return _given_probe(
        st.tuples(
            jobs,
            fault_specs(subject),
            st.integers(0, 5),
            st.sampled_from(("first", "middle", "final")),
        ),
        lambda v, s: check_connector_fault_stays_with_its_request(
            s, v[0], v[1], v[2], v[3], mode="sync"
        ),
        lambda v: len(v[0]),
    )(subject, cfg)


def _builder_cleared_probe(subject: Any, cfg: settings) -> tuple[BaseException | None, int]:
    from invariants.strategies import jobs
    from invariants.test_materialization import check_recovery_isolates_a_persistent_build_fault

    return _given_probe(
        st.tuples(jobs, st.integers(0, 5), st.integers(1, 3)),
        lambda v, s: check_recovery_isolates_a_persistent_build_fault(v[0], v[1], s, v[2]),
        lambda v: len(v[0]),
    )(subject, cfg)


def _builder_abandoned_probe(subject: Any, cfg: settings) -> tuple[BaseException | None, int]:
    from invariants.strategies import jobs
    from invariants.test_materialization import check_uncollected_build_error_surfaces

    return _given_probe(
        st.tuples(jobs, st.integers(0, 4)),
        lambda v, s: check_uncollected_build_error_surfaces(v[0], v[1], s),
        lambda v: len(v[0]),
    )(subject, cfg)


def _stage_inputs_probe(subject: Any, cfg: settings) -> tuple[BaseException | None, int]:
    """What ``invariants/test_process_boundary.py`` checks: generated stage inputs cross."""
    from invariants.strategies import every_slot_kind, stage_inputs
    from invariants.test_process_boundary import check_stage_input_crosses

    boundary = subject.process_boundary()
    probe = subject.input_adapter()
    scheduler = probe.scheduler()
    try:
        check_stage_input_crosses(
            subject, boundary, probe, scheduler, "every-kind", every_slot_kind(probe.spec)
        )
    except AssertionError as exc:
        return exc, 1
    count = [0]

    def check(fields: Any, s: Any) -> None:
        count[0] += 1
        check_stage_input_crosses(s, boundary, probe, scheduler, f"in{count[0]}", fields)

    return _given_probe(stage_inputs(probe.spec), check, lambda v: 1)(subject, cfg)


def _unknown_output_probe(subject: Any, cfg: settings) -> tuple[BaseException | None, int]:
    """What ``test_an_unknown_output_is_refused`` checks, for each of its names."""
    from invariants.test_payload_contracts import UNKNOWN_OUTPUTS, check_unknown_output

    try:
        for name in UNKNOWN_OUTPUTS:
            check_unknown_output(subject, name)
    except AssertionError as exc:
        return exc, 1
    return None, 1


def _registry_probe(subject: Any, cfg: settings) -> tuple[BaseException | None, int]:
    """What ``invariants/test_registry.py`` checks: completeness, then each entry's witness
    (the length is the number of registry entries)."""
    from invariants.registry import registry_problems, witness_problems

    entries = list(subject.differences())
    problems = registry_problems(entries)
    if not problems:
        problems = witness_problems(subject, subject.difference_witnesses())
    return (AssertionError(problems[0]) if problems else None), len(entries)


def _fault_containment_probe(subject: Any, cfg: settings) -> tuple[BaseException | None, int]:
    """What ``invariants/test_reliability.py`` checks, with a fault that persists (sync)."""
    from invariants.strategies import jobs
    from invariants.test_reliability import check_fault_stays_with_its_request

    return _given_probe(
        st.tuples(jobs, st.integers(0, 5), st.lists(st.booleans(), max_size=6)),
        lambda v, s: check_fault_stays_with_its_request(
            v[0], v[1], s, mode="sync", materialization="inline", persistent=True, final_here=v[2]
        ),
        lambda v: len(v[0]),
    )(subject, cfg)


def _send_path_faults_probe(subject: Any, cfg: settings) -> tuple[BaseException | None, int]:
    """What ``invariants/test_send_path_faults.py`` checks (sync)."""
    from invariants.strategies import jobs
    from invariants.test_send_path_faults import (
        FAULT_CALLS,
        check_send_fault_stays_with_its_request,
        fault_specs,
    )

    return _given_probe(
        st.tuples(jobs, fault_specs(subject), st.integers(0, 5), st.sampled_from(FAULT_CALLS)),
        lambda v, s: check_send_fault_stays_with_its_request(s, *v, mode="sync"),
        lambda v: len(v[0]),
    )(subject, cfg)


def _abort_faults_probe(subject: Any, cfg: settings) -> tuple[BaseException | None, int]:
    """What ``test_an_abort_that_meets_a_send_fault_stays_an_abort`` checks (sync)."""
    from invariants.strategies import jobs
    from invariants.test_send_path_faults import (
        ABORT_FAULTS,
        ABORT_POINTS,
        check_abort_meets_a_send_fault,
        fault_specs,
    )

    return _given_probe(
        st.tuples(
            jobs,
            fault_specs(subject),
            st.integers(0, 5),
            st.sampled_from(ABORT_POINTS),
            st.sampled_from(ABORT_FAULTS),
        ),
        lambda v, s: check_abort_meets_a_send_fault(s, *v, mode="sync"),
        lambda v: len(v[0]),
    )(subject, cfg)


def _recovery_builds_probe(subject: Any, cfg: settings) -> tuple[BaseException | None, int]:
    """What ``test_recovery_builds_as_often_as_configured`` checks, each declared budget."""
    from invariants.strategies import jobs
    from invariants.test_materialization import check_recovery_builds_as_configured, probes_of

    budgets = probes_of(subject).retry_features()  # type: ignore[attr-defined]
    return _given_probe(
        st.tuples(jobs, st.integers(0, 5), st.sampled_from(budgets)),
        lambda v, s: check_recovery_builds_as_configured(v[0], v[1], s, v[2]),
        lambda v: len(v[0]),
    )(subject, cfg)


def _reset_in_flight_probe(subject: Any, cfg: settings) -> tuple[BaseException | None, int]:
    """What ``invariants/test_chunk_contracts.py::test_rows_survive_a_reset_with_steps_in_flight``
    checks."""
    from invariants.strategies import processor_specs
    from invariants.test_chunk_contracts import check_rows_survive_a_reset

    return _given_probe(
        st.tuples(
            st.lists(st.integers(1, 40), min_size=1, max_size=3), st.integers(1, 4), processor_specs
        ),
        lambda v, s: check_rows_survive_a_reset(s, *v),
        lambda v: len(v[0]) + v[1] + 1,
    )(subject, cfg)


def _batching_probe(subject: Any, cfg: settings) -> tuple[BaseException | None, int]:
    """What ``invariants/test_processor_batching.py`` checks."""
    from invariants.test_processor_batching import (
        batching_processors,
        check_batching,
        edges_of,
        step_lists,
    )

    makers = batching_processors(subject)
    return _given_probe(
        st.tuples(st.sampled_from(sorted(makers)), step_lists(edges_of(subject))),
        lambda v, s: check_batching(makers[v[0]], v[0], v[1]),
        lambda v: len(v[1]),
    )(subject, cfg)


def _staged_aborts_probe(subject: Any, cfg: settings) -> tuple[BaseException | None, int]:
    """What ``tests/test_process_stage_subject.py::test_an_abort_meets_requests_still_staged``
    checks (the process-stage subject only: staging is that runtime's)."""
    from tests.test_process_stage_subject import check_staged_aborts, staged_aborts

    return _given_probe(staged_aborts(), check_staged_aborts, lambda v: v[0] + len(v[1]))(
        subject, cfg
    )


PROBES: dict[str, Callable[..., tuple[BaseException | None, int]]] = {
    "lockstep-off": _machine_probe("off"),
    "lockstep-token-updates": _machine_probe("token-updates"),
    "lockstep-hidden-inline": _machine_probe("hidden-inline"),
    "lockstep-hidden-background-async": _machine_probe("hidden-background", mode="async"),
    "lockstep-speculative": _machine_probe("token-updates", speculative=3),
    "chunk-contracts": _chunk_probe,
    **{f"axis-{a.name}-{mode}": _axis_probe(a.name, mode) for a in AXES for mode in a.modes},
    "chunk-reset-in-flight": _reset_in_flight_probe,
    "malformed-inputs": _malformed_probe,
    "graph-independence": _jobs_probe(
        "check_graph_independence", "invariants.test_ar_inv_003_workers", include_hidden=True
    ),
    "token-only": _jobs_probe("check_token_only", "invariants.test_payload_contracts"),
    "token-only-reprefill": _token_only_reprefill_probe,
    "token-only-multimodal": _jobs_probe(
        "check_token_only", "invariants.test_payload_contracts", multimodal=True
    ),
    "inline-vs-background": _jobs_probe(
        "check_inline_equals_background", "invariants.test_materialization"
    ),
    "inline-vs-background-token-only": _jobs_probe(
        "check_inline_equals_background", "invariants.test_materialization", include_hidden=False
    ),
    "builder-errors": _builder_errors_probe,
    "builder-recovery": _builder_recovery_probe,
    "last-stage": _jobs_probe(
        "check_last_stage", "invariants.test_payload_contracts", include_hidden=True
    ),
    "connector-faults": _connector_faults_probe,
    "unknown-output": _unknown_output_probe,
    "builder-cleared": _builder_cleared_probe,
    "builder-abandoned": _builder_abandoned_probe,
    "registry": _registry_probe,
    "fault-containment": _fault_containment_probe,
    "send-path-faults": _send_path_faults_probe,
    "abort-faults": _abort_faults_probe,
    "recovery-builds": _recovery_builds_probe,
    "processor-batching": _batching_probe,
    "stage-inputs-cross": _stage_inputs_probe,
    "staged-aborts": _staged_aborts_probe,
}


def _message(error: BaseException | None) -> str:
    return "" if error is None else f"{type(error).__name__}: {error}".splitlines()[0][:200]


def _unmodified(subject: Any) -> Any:
    """A fresh subject of the runtime's own class that ``subject`` is, or derives from (a mutant's
    subject is a subclass defined in the catalogue; a patch is undone by then)."""
    for cls in type(subject).__mro__:
        if cls.__module__.startswith("omni_runtime."):
            return cls()
    raise TypeError(f"{type(subject).__name__} derives from no subject of the runtime")


# The CI lane: stop at the first failing program, unshrunk.
DETECT = (Phase.explicit, Phase.reuse, Phase.generate)


def run_mutant(mutant: Any, tmp: Path, shrink: bool = True) -> Verdict:
    from omni_runtime.conformance_subject import OmniSubject

    start = time.monotonic()
    # The failing examples hypothesis finds (the shrunk one first) are kept here, so the same
    # programs can be replayed on the unmodified runtime below.
    found = InMemoryExampleDatabase()
    cfg = settings(MUTANT_SETTINGS, database=found)
    if not shrink:
        cfg = settings(cfg, phases=DETECT)
    with mutant.apply() as applied:
        subject = applied if isinstance(applied, OmniSubject) else OmniSubject()
        if mutant.probe == "static-payload-builders":
            error, ops = _static_probe(subject, tmp)
        else:
            error, ops = PROBES[mutant.probe](subject, cfg)
    message = _message(error)
    clauses = [c.strip() for c in mutant.clause.split("/")]
    # Caught = the property failed and its message names the mutant's clause (a crash of the
    # harness itself, or a failure for an unrelated reason, does not count as a kill).
    caught = error is not None and (
        any(c in message for c in clauses) or "first difference" in message
    )
    if caught and mutant.probe != "static-payload-builders":
        # A kill counts only if the unmodified runtime passes the same programs: otherwise the
        # check raised a false alarm that the mutant merely happened to reach. (The static probe
        # plants its own defect in a copy of the tree; its clean control is the layout check the
        # suite runs on the real tree.)
        replay = settings(MUTANT_SETTINGS, database=found, phases=(Phase.explicit, Phase.reuse))
        clean_error, _ = PROBES[mutant.probe](_unmodified(subject), replay)
        if clean_error is not None:
            caught = False
            message = f"the unmodified runtime fails the same program: {_message(clean_error)}"
    return Verdict(
        mutant.name,
        mutant.clause,
        mutant.probe,
        caught,
        ops if error else None,
        message,
        time.monotonic() - start,
    )


_VERDICTS: dict[str, Verdict] = {}


# The scheduler axis each axis probe runs: a mutant whose probe's axis the installed vLLM cannot
# run (``Axis.unavailable``) is not applicable there, with the axis's reason (its path is
# release-specific: ``encoder_instance_never_stops`` breaks 0.28's encoder-only instances).
PROBE_AXES = {f"axis-{a.name}-{mode}": (a, mode) for a in AXES for mode in a.modes}


def _judge(name: str, tmp_path: Path, shrink: bool) -> Verdict:
    mutant = CATALOGUE.by_name(name)
    chosen = PROBE_AXES.get(mutant.probe)
    why = chosen[0].unavailable(chosen[1]) if chosen is not None else None
    if why is not None:
        pytest.skip(f"not applicable: mutant {name}'s probe {mutant.probe}: {why}")
    verdict = run_mutant(mutant, tmp_path, shrink=shrink)
    _VERDICTS[name] = verdict
    print(
        f"\n{name} [{verdict.clause}] caught={verdict.caught} ops={verdict.shrunk_ops} "
        f"({'shrunk' if shrink else 'first found'}, {verdict.seconds:.1f}s): {verdict.message}"
    )
    assert verdict.caught, (
        f"mutant {name} ({mutant.clause}) survived its probe {mutant.probe}: {verdict.message}"
    )
    return verdict


@pytest.mark.slow
@pytest.mark.parametrize("name", [m.name for m in CATALOGUE.MUTANTS])
def test_mutant_is_killed(name: str, tmp_path: Path) -> None:
    _judge(name, tmp_path, shrink=False)


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("name", [m.name for m in CATALOGUE.MUTANTS])
def test_counterexample_is_short(name: str, tmp_path: Path) -> None:
    verdict = _judge(name, tmp_path, shrink=True)
    assert verdict.shrunk_ops is not None and verdict.shrunk_ops <= MAX_SHRUNK_OPS, (
        f"mutant {name}: counterexample of {verdict.shrunk_ops} operations "
        f"(target <= {MAX_SHRUNK_OPS})"
    )


def test_mutant_catalogue_covers_every_clause_group() -> None:
    clauses = {c for m in CATALOGUE.MUTANTS for c in m.clause.split("/")}
    groups = {
        "AR-INV-001": {"C-01", "C-03", "C-04", "C-05", "C-07"},
        "AR-INV-002": {"C-11", "C-12", "C-13"},
        "AR-INV-003": {"C-20", "C-21", "C-22"},
        "token-only": {"C-30", "C-31"},
        "chunks": {"C-40", "C-42", "C-43", "C-44", "C-45"},
        "materialization": {"C-50", "C-51", "C-52", "C-54", "C-55"},
        "reliability": {"C-62"},
        "process-boundary": {"C-46"},
    }
    missing = {g: sorted(want - clauses) for g, want in groups.items() if want - clauses}
    assert not missing, f"clauses without a mutant: {missing}"
    assert not unknown(clauses), f"mutants name clauses nobody defined: {unknown(clauses)}"
    assert len(CATALOGUE.MUTANTS) >= 15


@pytest.mark.slow
def test_mutant_kill_table() -> None:
    """Prints the table (run after the parametrized tests; with xdist, per worker)."""
    if not _VERDICTS:
        pytest.skip("no mutant ran in this process")
    rows = sorted(_VERDICTS.values(), key=lambda v: v.mutant)
    killed = sum(v.caught for v in rows)
    print(f"\nmutant kill rate: {killed}/{len(rows)}")
    print(f"{'mutant':<36} {'clause':<10} {'caught':<7} {'ops':>6}  seconds")
    for v in rows:
        print(
            f"{v.mutant:<36} {v.clause:<10} {str(v.caught):<7} {str(v.shrunk_ops):>6}  "
            f"{v.seconds:6.1f}"
        )
    assert killed == len(rows)


def _planted(name: str, both: bool) -> Any:
    """A mutant whose probe fails from value 500 on: on the mutant only, or (``both``) on the
    unmodified runtime as well, as a property with a false alarm would."""
    import contextlib

    from omni_runtime.conformance_subject import OmniSubject

    class Marked(OmniSubject):
        pass

    def check(value: int, subject: Any) -> None:
        assert value < 500 or not (both or isinstance(subject, Marked)), f"C-01: {value}"

    PROBES[name] = _given_probe(st.integers(0, 1000), check, lambda v: 1)
    return CATALOGUE.Mutant(name, "C-01", name, "planted", lambda: contextlib.nullcontext(Marked()))


@pytest.mark.parametrize("false_alarm", [False, True])
def test_kill_needs_the_unmodified_runtime_to_pass(false_alarm: bool, tmp_path: Path) -> None:
    """A failure the unmodified runtime shares is refused as a kill; the replay really reaches
    the shrunk program (else the false alarm would pass on the unmodified runtime unseen)."""
    name = f"planted-{false_alarm}"
    try:
        verdict = run_mutant(_planted(name, both=false_alarm), tmp_path)
    finally:
        del PROBES[name]
    assert verdict.caught is not false_alarm, verdict
    assert ("unmodified runtime fails the same program" in verdict.message) is false_alarm
    assert "C-01: 500" in verdict.message, verdict.message  # shrunk to the boundary
