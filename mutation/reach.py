"""The reach: which test of the suite executes which mutated statement.

A mutant's run draws the unmutated run's examples (the seed is pinned, ``PINNED_SEED``) and
executes the same code until it first meets the mutated statement, so only tests that execute
that statement can kill it. Owns the reach run (``measure_reach``: the suite once under
coverage.py with no mutant active, a context per test, through ``mutation/reach_plugin.py``
copied into the tree and loaded as ``-p reach_plugin``), its record kept per profile and suite
(``Reach``, ``load_reach``), the observed pytest run it shares with the infection run
(``observed_run``), and locating a mutant's statements in mutmut's copy of a file
(``mutated_lines``). Method: ``docs/mutation-score.md``.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from mutation import CampaignError, infection
from mutation.targets import PROCESS_STAGE_TESTS, pytest_args
from mutation.workdir import campaign_env

# Every re-check runs hypothesis with this seed and no example database. ``thorough`` is not
# derandomized, so without the pin a re-check would draw other examples on every run: its kills
# could not be replayed, and the reach run below could not say which tests a mutant's run meets.
PINNED_SEED = ("--hypothesis-seed", "0")
REACH_PLUGIN = Path(__file__).with_name("reach_plugin.py")


def pinned_hypothesis(examples: str) -> dict[str, str]:
    """The environment that points hypothesis's example database at ``examples``, an empty
    folder: examples an earlier mutant's failure saved would otherwise be replayed first."""
    return {"HYPOTHESIS_STORAGE_DIRECTORY": examples}


@dataclasses.dataclass
class Reach:
    """Which tests of the work folder's suite execute which line of its (unmutated) runtime copy
    under one profile and the pinned seed, and how long each test took there.

    A mutant's run draws the same examples as the unmutated run and executes the same code up to
    the first time it meets the mutated statement, so a test that never executed that statement
    cannot fail on the mutant: the re-check runs only the tests that did."""

    profile: str
    suite: str  # the work folder's suite: the campaign's commit, or where it was refreshed from
    seconds: float  # the reach run's wall clock
    tests: list[str]
    durations: dict[str, float]
    lines: dict[str, dict[int, list[int]]]  # file (relative to mutants/) -> line -> test indices
    # Tests that failed with no mutant active: a mutant's run of one would count a false kill, so
    # no re-check runs them (the report names them: each is a finding about the runtime or the
    # suite under this profile).
    failing: list[str] = dataclasses.field(default_factory=list)

    def tests_at(self, path: str, lines: Iterable[int]) -> set[str]:
        """Every test that executed one of ``lines``, those failing unmutated included."""
        at = self.lines.get(path, {})
        return {self.tests[i] for line in lines for i in at.get(line, ())}

    def to_json(self) -> str:
        return json.dumps(
            dataclasses.asdict(self)
            | {
                "lines": {
                    path: {str(line): ids for line, ids in by_line.items()}
                    for path, by_line in self.lines.items()
                }
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Reach:
        raw = json.loads(text)
        raw["lines"] = {
            path: {int(line): ids for line, ids in by_line.items()}
            for path, by_line in raw["lines"].items()
        }
        return cls(**raw)


def suite_of(meta: dict[str, object]) -> str:
    return str(meta.get("suite_refreshed_from") or meta.get("commit") or meta.get("rev"))


def reach_path(work: Path, profile: str) -> Path:
    return work / f"reach-{profile}.json"


def load_reach(work: Path, profile: str, meta: dict[str, object]) -> Reach:
    """The reach of the work folder's suite under ``profile``: the kept one when it was measured
    on this suite, else measured now (one run of the whole suite under coverage.py, with no
    mutant active: for ``thorough`` about as long as the suite's own run under it)."""
    path = reach_path(work, profile)
    if path.is_file():
        kept = Reach.from_json(path.read_text())
        if kept.suite == suite_of(meta):
            return kept
    reach = measure_reach(work, profile, suite_of(meta))
    path.write_text(reach.to_json())
    return reach


def measure_reach(work: Path, profile: str, suite: str) -> Reach:
    out = (work / "reach").resolve()
    shutil.rmtree(out, ignore_errors=True)
    (out / "data").mkdir(parents=True)
    rcfile = out / "coveragerc"
    # ``context`` expands the variable the plugin sets around each test, in the process that
    # reads the file: a stage process started during a test labels its lines with that test.
    rcfile.write_text(
        "\n".join(
            [
                "[run]",
                "include = omni_runtime/*",
                "concurrency = thread, multiprocessing",
                "context = ${OMNI_REACH_CONTEXT}",
                f"data_file = {out / 'data' / 'cov'}",
                "parallel = true",
                "sigterm = true",  # a stage process vLLM terminates still writes its lines
                "",
            ]
        )
    )
    print(f"measuring which test reaches which line under {profile} (one suite run)", flush=True)
    failing, seconds = observed_run(
        work,
        work / "mutants",
        REACH_PLUGIN,
        profile,
        ["invariants", PROCESS_STAGE_TESTS],
        {"OMNI_REACH_RCFILE": str(rcfile)},
        out / "examples",
        "reach",
    )
    reach = read_reach(out / "data", work / "mutants", profile, suite, seconds)
    reach.failing = failing
    return reach


def observed_run(
    work: Path,
    tree: Path,
    plugin: Path,
    profile: str,
    targets: Sequence[str],
    env: Mapping[str, str],
    examples: Path,
    what: str,
) -> tuple[list[str], float]:
    """One pytest in ``tree`` (the work folder's ``mutants/`` or a probed copy of it) over
    ``targets`` with no mutant active and ``plugin`` (copied into ``tree``) observing it:
    under ``profile`` and the pinned seed, two workers, every test run (no stop at the first
    failure). Returns the tests that failed and the wall clock; a run that broke (not a test
    failure) raises, naming ``what`` run it was."""
    shutil.copyfile(plugin, tree / plugin.name)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        plugin.stem,
        "-n",
        "2",
        *pytest_args(profile),
        *PINNED_SEED,
        "-rf",
        *targets,
    ]
    cmd.remove("-x")
    full_env = (
        campaign_env(work)
        | {"MUTANT_UNDER_TEST": ""}
        | dict(env)
        | pinned_hypothesis(str(examples))
    )
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=tree, env=full_env, capture_output=True, text=True)
    seconds = time.monotonic() - start
    failing = failed_tests(proc.stdout)
    if proc.returncode not in (0, 1) or (proc.returncode == 1 and not failing):
        tail = "\n".join(proc.stdout.splitlines()[-15:])
        raise CampaignError(
            f"the {what} run under {profile} broke (exit {proc.returncode}):\n{tail}"
        )
    return failing, seconds


def failed_tests(output: str) -> list[str]:
    """The node ids of pytest's ``-rf`` summary lines (``FAILED node - message``)."""
    return sorted(
        {
            line.removeprefix("FAILED ").split(" - ", 1)[0].strip()
            for line in output.splitlines()
            if line.startswith("FAILED ")
        }
    )


def read_reach(data: Path, root: Path, profile: str, suite: str, seconds: float) -> Reach:
    from coverage import CoverageData  # the test extra's; only the re-check needs it

    tests: list[str] = []
    index: dict[str, int] = {}
    lines: dict[str, dict[int, set[int]]] = {}
    for part in sorted(data.glob("cov.*")):
        if part.name.endswith(".json"):
            continue
        cov = CoverageData(str(part))
        cov.read()
        for path in cov.measured_files():
            rel = Path(path).resolve().relative_to(root.resolve()).as_posix()
            for line, contexts in cov.contexts_by_lineno(path).items():
                for context in contexts:
                    # "static|dynamic": the test process switches the dynamic part, a stage
                    # process it started carries the test in the static part.
                    test = next((c for c in reversed(context.split("|")) if c), "")
                    if not test:
                        continue  # imports and fixtures shared by every test
                    i = index.setdefault(test, len(tests))
                    if i == len(tests):
                        tests.append(test)
                    lines.setdefault(rel, {}).setdefault(line, set()).add(i)
    durations: dict[str, float] = {}
    for part in data.glob("cov.seconds.*.json"):
        durations.update(json.loads(part.read_text()))
    return Reach(
        profile,
        suite,
        seconds,
        tests,
        durations,
        {p: {n: sorted(ids) for n, ids in by.items()} for p, by in lines.items()},
    )


def _statements(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.stmt]:
    return [n for n in ast.walk(fn) if isinstance(n, ast.stmt) and n is not fn]


def _own_lines(stmt: ast.stmt) -> range:
    """The lines a statement's own code is on: a compound statement's header, a simple
    statement's every line (coverage.py may record any of them for a multi-line one)."""
    children = [
        n
        for field in ("body", "orelse", "finalbody", "handlers", "cases")
        for n in getattr(stmt, field, ())
        if isinstance(n, ast.AST) and hasattr(n, "lineno")
    ]
    end = min((n.lineno for n in children), default=(stmt.end_lineno or stmt.lineno) + 1)
    return range(stmt.lineno, max(end, stmt.lineno + 1))


def mutated_lines(source: str, mutant: str) -> tuple[int, ...] | None:
    """The lines (in ``source``, mutmut's copy of a file) of the statements of the unmutated
    function that mutant ``mutant`` (its mangled name, ``x…__mutmut_N``) changes; None when
    ``source`` holds no such mutant."""
    fns = infection.functions(ast.parse(source))
    base = mutant.rsplit("__mutmut_", 1)[0]
    orig, changed = fns.get(f"{base}__mutmut_orig"), fns.get(mutant)
    if orig is None or changed is None:
        return None
    text = source.splitlines()

    def body(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
        return text[fn.body[0].lineno - 1 : fn.end_lineno]

    first = orig.body[0].lineno
    before, after = body(orig), body(changed)
    differing: set[int] = set()
    for tag, i1, i2, _, _ in difflib.SequenceMatcher(
        a=before, b=after, autojunk=False
    ).get_opcodes():
        if tag != "equal":
            # A pure insertion has no line of its own before: the line it precedes stands in.
            differing.update(range(first + i1, first + max(i2, i1 + 1)))
    # A change outside the body's statements (a default in the signature, say) is met wherever
    # the function runs: then any of its lines stands for it.
    whole = tuple(range(orig.lineno, (orig.end_lineno or orig.lineno) + 1))
    if not differing:
        return whole
    found: set[int] = set()
    statements = _statements(orig)
    for line in differing:
        holding = [s for s in statements if s.lineno <= line <= (s.end_lineno or s.lineno)]
        if not holding:
            return whole
        innermost = max(holding, key=lambda s: s.lineno)
        found.update(_own_lines(innermost))
    return tuple(sorted(found))
