"""What the campaign mutates and how the suite runs against each mutant.

Owns ``TARGETS`` (``omni_runtime/sched/``, ``omni_runtime/adapters/``, ``payload.py``,
``worker/materialize.py`` and the runner's payload-building functions), the slices (``full``,
and ``ci``: six pinned mutants of C-45's trimming that the README's test command runs through
``tests/test_mutation_slice.py``), and ``pytest_args``: per mutant, ``pytest -m invariants``
under one hypothesis profile, stopping at the first failure, without the tests of ``LEFT_OUT``
(audits that read the source text, which mutmut's trampolines change for every mutant).
Why these targets and tests: ``docs/mutation-score.md``.
"""

from __future__ import annotations

import dataclasses

MUTMUT_VERSION = "3.8.1"


# Tests each mutant's run leaves out. First, those that read the runtime's source text (C-10/C-11
# payload construction sites, C-21 import contracts). Under mutmut the source holds trampolines and renamed functions, which these audits
# rightly flag; they guard layout, not behaviour, and no mutation operator changes layout.
LEFT_OUT = (
    "invariants/test_ar_inv_002_adapters.py::test_only_adapters_build_payloads",
    "invariants/test_ar_inv_003_workers.py::test_import_contracts_hold",
    # The whole gate against omni-process-stage, through the command in a subprocess: the same
    # properties the module runs in process, plus the two audits above (which then fail on the
    # trampolines, so every mutant would count as killed).
    "tests/test_process_stage_subject.py::test_gate_check_passes",
)

_RUNNER = "omni_runtime.worker.runner.xǁOmniARModelRunnerǁ"


@dataclasses.dataclass(frozen=True)
class Target:
    """One row of the report: a file and, optionally, which of its mutants are run."""

    path: str  # relative to the repository
    select: tuple[str, ...] = ()  # mutmut mutant-name globs; none: every mutant of the file
    label: str = ""  # the report's name for the row; none: the path below the package

    @property
    def name(self) -> str:
        return self.label or self.path.removeprefix("omni_runtime/")

    @property
    def mutants(self) -> tuple[str, ...]:
        return self.select or (self.path.removesuffix(".py").replace("/", ".") + ".*",)


TARGETS = (
    *(
        Target(f"omni_runtime/{rel}")
        for rel in (
            "sched/scheduler.py",
            "sched/transfer.py",
            "sched/processors.py",
            "sched/process_stage.py",
            "adapters/input.py",
            "adapters/output.py",
            "adapters/shm_wire.py",
            "payload.py",
            "worker/materialize.py",
        )
    ),
    # The runner's other phases (inputs, forward, sampling, recovery) belong to the model, not to
    # the payload path the suite's contracts guard; its payload-building functions are these.
    # (``persistent_buffers`` is left out: it tells the gate which buffers C-52 may scribble on,
    # so a mutant there weakens the gate's audit and changes nothing the runtime does.)
    Target(
        "omni_runtime/worker/runner.py",
        tuple(
            f"{_RUNNER}{name}__mutmut_*"
            for name in (
                "_finish_payloads",
                "_finish",
                "_sample_output",
                "sample_tokens",
                "_producers",
                "_recheck_conditioning",
                "collect_connector_output",
            )
        ),
        label="worker/runner.py (payload parts)",
    ),
)


@dataclasses.dataclass(frozen=True)
class Slice:
    """What one campaign mutates and which tests it runs. ``expected`` pins a sample: mutant name
    -> the mutated lines it must still be (mutmut numbers mutants by position, so an edit of the
    file renumbers them; the campaign then refuses instead of measuring other mutants)."""

    targets: tuple[Target, ...]
    tests: tuple[str, ...] = ("invariants",)
    expected: tuple[tuple[str, tuple[str, ...]], ...] = ()


_TRIM = "omni_runtime.payload.xǁStagePayloadǁtrimmed_before__mutmut_"
# The CI guard: six mutants of C-45's trimming that the chunk contracts kill, two of them only
# through the completeness check the campaign led to. A suite change that lets one survive fails
# the README's test command (tests/test_mutation_slice.py).
CI_SAMPLE = (
    (
        f"{_TRIM}10",
        (
            "-drop = min(max(0, position - self.start), self.num_tokens)",
            "+drop = min(max(1, position - self.start), self.num_tokens)",
        ),
    ),
    (
        f"{_TRIM}11",
        (
            "-drop = min(max(0, position - self.start), self.num_tokens)",
            "+drop = min(max(0, position + self.start), self.num_tokens)",
        ),
    ),
    (f"{_TRIM}12", ("-if drop == 0:", "+if drop != 0:")),
    (
        f"{_TRIM}14",
        ("-hidden = None if self.hidden is None else self.hidden[drop:]", "+hidden = None"),
    ),
    (f"{_TRIM}38", ("-self.start + drop,", "+self.start - drop,")),
    (f"{_TRIM}39", ("-self.num_tokens - drop,", "+self.num_tokens + drop,")),
)

# The invariant suite runs against one subject per run (the runtime's ``omni``); the properties
# in which the stage-process code takes part also run against ``omni-process-stage`` from this
# module, which is how the campaign reaches ``sched/process_stage.py`` and the shared-memory wire.
PROCESS_STAGE_TESTS = "tests/test_process_stage_subject.py"

SLICES = {
    "full": Slice(TARGETS, tests=("invariants", PROCESS_STAGE_TESTS)),
    "ci": Slice(
        (
            Target(
                "omni_runtime/payload.py",
                tuple(n for n, _ in CI_SAMPLE),
                label="payload.py (CI sample)",
            ),
        ),
        tests=("invariants/test_chunk_contracts.py",),
        expected=CI_SAMPLE,
    ),
}


def pytest_args(profile: str) -> list[str]:
    args = [
        "-m",
        "invariants",
        "-p",
        "no:cacheprovider",
        "-x",
        "-q",
        "--conformance-profile",
        profile,
    ]
    for test in LEFT_OUT:
        args += ["--deselect", test]
    return args
