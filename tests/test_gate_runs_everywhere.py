"""Nothing in the gate skips silently: a promised check runs wherever the gate runs, or is
reported as not run, by name and reason, and ``check`` fails.

* With an empty ``PATH`` (only the interpreter known, by absolute path — an installed tool run
  from a shell where no environment is activated), the static import-contract check (C-21) and
  the source audits still run and pass: they reach their checkers through the interpreter
  running the suite, never a ``PATH`` lookup.
* A subject whose declared import contracts are missing gets ``not_run`` for that check, with
  the reason; ``check`` exits non-zero and says which check in one line on stderr. A capability
  the subject does not declare stays ``not_applicable`` and does not fail the run.

Why this can fail: a check that looks its tool up on ``PATH`` and skips itself when absent (the
report would say its clause holds), or a "could not run" that is reported as a pass or a skip.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import invariants

SUITE = Path(invariants.__file__).resolve().parent
WORKERS = f"{SUITE / 'test_ar_inv_003_workers.py'}"
ADAPTERS = f"{SUITE / 'test_ar_inv_002_adapters.py'}"
STATIC_CHECKS = (
    "test_import_contracts_hold",
    "test_worker_code_is_what_the_sink_watches",
    "test_only_adapters_build_payloads",
)

# The suite's one test that needs a process boundary (C-46), not applicable to ``omni``.
PROCESS_BOUNDARY_ONLY = "test_stage_inputs_cross_unchanged"
# C-47's, which needs a stage that parks requests until chunks arrive; ``omni``'s stages do not.
RECEIVING_STAGE_ONLY = (
    "test_a_receiving_stage_stays_in_upstream_states[sync]",
    "test_a_receiving_stage_stays_in_upstream_states[async]",
)

pytestmark = pytest.mark.clauses("C-21")


def _axis_off(test_name: str) -> bool:
    """Whether ``test_scheduler_axis[<feature>-<axis>-<mode>]`` cannot run here."""
    from conformance._core.axes import AXES

    params = test_name.split("[", 1)[1].rstrip("]")
    for axis in AXES:
        for mode in ("sync", "async"):
            if params.endswith(f"-{axis.name}-{mode}"):
                return axis.unavailable(mode) is not None
    raise AssertionError(f"no scheduler axis matches {test_name}")


@pytest.mark.slow
def test_every_check_runs_with_an_empty_path(tmp_path, run_check):
    """The whole gate on the project's own runtime with ``PATH`` empty: every test of the suite
    runs (none skipped, none not run) and passes, the static checks included. The tests that
    do not apply are C-46's: ``omni`` runs its stages in process, so nothing crosses a process
    boundary (``omni-process-stage`` is the subject that does); and C-47's: no ``omni`` stage
    parks requests waiting for chunks."""
    # smoke: the default test command runs the suite itself at the ci profile; here the point
    # is that every test runs from an empty PATH, not the depth of each search.
    run = run_check(
        tmp_path, "omni", workers=2, quiet=True, profile="smoke", extra_env={"PATH": ""}
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.report is not None, run.tail()
    report = run.report
    summary = report["summary"]
    outcomes = {t["nodeid"].rsplit("::", 1)[-1]: t["outcome"] for t in report["tests"]}
    not_applicable = sorted(name for name, outcome in outcomes.items() if outcome != "passed")
    # Besides C-46's and C-47's tests, the scheduler axes the installed release lacks.
    expected = sorted(
        [PROCESS_BOUNDARY_ONLY, *RECEIVING_STAGE_ONLY]
        + [name for name in outcomes if name.startswith("test_scheduler_axis[") and _axis_off(name)]
    )
    assert summary["not_run"] == 0 and not_applicable == expected, summary
    assert all(outcomes[name] == "not_applicable" for name in expected), outcomes
    assert summary["passed"] == summary["tests"] - len(expected) > 40, summary
    assert all(outcomes[name] == "passed" for name in STATIC_CHECKS), outcomes


MISSING_CONTRACTS = """
from pathlib import Path

from conformance._core.capabilities import SourceLayout
from conformance._core.subjects import BaseSubject


class MissingContracts(BaseSubject):
    name = "missing-contracts"

    def source_layout(self):
        return SourceLayout(import_contracts=Path(__file__).with_name("no-such-contracts.toml"))
"""


@pytest.mark.slow
def test_a_promised_check_that_cannot_run_fails_the_gate(tmp_path, run_check):
    (tmp_path / "missing_contracts.py").write_text(MISSING_CONTRACTS)
    run = run_check(
        tmp_path,
        "missing_contracts:MissingContracts",
        quiet=True,
        profile="smoke",
        tests=(
            f"{WORKERS}::test_import_contracts_hold",
            f"{ADAPTERS}::test_malformed_inputs_rejected_at_adapter",
        ),
    )
    report, stderr = run.report, run.stderr
    assert run.returncode not in (0, 2), stderr[-2000:]
    assert report is not None, run.tail()
    assert report["status"] == "incomplete"
    (not_run,) = report["not_run"]
    assert not_run["test"].endswith("test_import_contracts_hold")
    assert "no-such-contracts.toml" in not_run["reason"] and "missing" in not_run["reason"]
    # Not declaring an input adapter is not a problem of the environment: not applicable.
    (na,) = report["not_applicable"]
    assert na["test"].endswith("test_malformed_inputs_rejected_at_adapter")
    assert "input adapter" in na["reason"]
    assert {c["id"]: c["status"] for c in report["clauses"]}["C-21"] == "not_run"
    last = [line for line in stderr.splitlines() if line.startswith("omni-conformance check:")]
    assert last and "could not run" in last[-1] and "test_import_contracts_hold" in last[-1]
