"""The re-check: every survivor the ledger does not explain, run again under a stronger profile.

Owns ``recheck``: each survivor, timeout and uncovered mutant runs again (pinned seed, a fresh
pytest per run) against the tests that execute its mutated statement (``mutation.reach``), and
among those only the ones it is infected in (``mutation.infection_run``); a kill there counts as
a kill. Also targeted re-checks (named tests) and quick ones (short tests only), long re-checks
cut into parts kept as they pass (``PART_SECONDS``), verdicts cached per profile in the work
folder (``recheck-<profile>.json``), ``kept_verdicts`` for a report that runs nothing, and
``clean_run``, which refuses a refreshed suite that fails unmutated. Method:
``docs/mutation-score.md``.
"""

from __future__ import annotations

import concurrent.futures
import fnmatch
import json
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mutation import CampaignError
from mutation.infection_run import ProbePlan, infection_for
from mutation.ledger import load_guards
from mutation.reach import PINNED_SEED, Reach, mutated_lines, pinned_hypothesis
from mutation.results import RECHECKED, Mutant
from mutation.state import update_json
from mutation.targets import PROCESS_STAGE_TESTS, pytest_args
from mutation.workdir import campaign_env


def clean_run(work: Path, profile: str, tests: tuple[str, ...] = ()) -> None:
    """Run the work folder's suite (or only ``tests``) with no mutant active, under ``profile``:
    a refreshed suite that fails on the unmutated runtime (a harness change the work folder's
    runtime copy lacks, say) would count every mutant it covers as killed."""
    # A targeted re-check trusts the failures of its own tests only, so only they must pass:
    # the rest of a refreshed suite may need runtime code the campaign's commit lacks.
    targets = list(tests) or ["invariants", PROCESS_STAGE_TESTS]
    # Pinned as every re-check is: the examples a kill was drawn from must pass here.
    cmd = [sys.executable, "-m", "pytest", *pytest_args(profile), *PINNED_SEED, *targets]
    with tempfile.TemporaryDirectory(dir=work) as examples:
        env = campaign_env(work) | {"MUTANT_UNDER_TEST": ""} | pinned_hypothesis(examples)
        proc = subprocess.run(cmd, cwd=work / "mutants", env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-15:])
        raise CampaignError(
            f"the suite fails with no mutant active (exit {proc.returncode}); re-checks against "
            f"it would count false kills:\n{tail}"
        )


def collect_tests(work: Path) -> set[str]:
    """The node ids of the invariant suite as it is in the work folder."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", *pytest_args("ci"), "invariants"],
        cwd=work / "mutants",
        env=campaign_env(work),
        capture_output=True,
        text=True,
    )
    return {line.strip() for line in proc.stdout.splitlines() if "::" in line}


def _merge_into(path: Path, cache: dict[str, str]) -> None:
    """Write ``cache`` into ``path`` together with what other re-checks wrote there since it was
    read (re-checks of disjoint globs may run side by side); ``cache`` takes those in too."""

    def merged(on_disk: dict[str, Any]) -> dict[str, Any]:
        cache.update({k: v for k, v in on_disk.items() if k not in cache})
        return cache

    update_json(path, merged)


def recheck_kills(work: Path, skip: Path | None = None) -> set[str]:
    """Keys of the mutants a re-check killed, under any profile (every profile is derandomized,
    so a covering test that failed on the mutant fails it under any of them): the caches in the
    work folder but ``skip``."""
    return {
        key
        for cache in work.glob("recheck-*.json")
        if cache != skip
        for key, verdict in json.loads(cache.read_text()).items()
        if verdict in ("killed", "timeout")
    }


def parts_path(work: Path, profile: str) -> Path:
    """Where a full re-check keeps, per survivor, the tests it already passed (``PART_SECONDS``)."""
    return work / f"parts-{profile}.json"


def _passed_against(kept: Mapping[str, Any], suite: str) -> dict[str, list[str]]:
    """A parts file's passed tests by survivor, when it was kept against ``suite``: parts
    passed against another suite count for nothing."""
    return dict(kept.get("passed", {})) if kept.get("suite") == suite else {}


def passed_parts(path: Path, suite: str) -> dict[str, list[str]]:
    """The tests each survivor (by key) passed in earlier parts of a re-check against ``suite``."""
    return _passed_against(json.loads(path.read_text()) if path.is_file() else {}, suite)


def record_part(path: Path, suite: str, key: str, tests: Sequence[str] | None) -> None:
    """Add ``tests`` to what the survivor ``key`` passed against ``suite`` (``None``: forget the
    survivor's parts, once its verdict is in the re-check's cache), atomically beside the other
    re-check running at the same time."""

    def added(kept: dict[str, Any]) -> dict[str, Any]:
        passed = _passed_against(kept, suite)
        if tests is None:
            passed.pop(key, None)
        else:
            passed[key] = sorted({*passed.get(key, ()), *tests})
        return {"suite": suite, "passed": passed}

    update_json(path, added)


def split_parts(tests: Sequence[str], durations: Mapping[str, float]) -> list[list[str]]:
    """``tests`` in order, cut into runs of at most ``PART_SECONDS`` of unmutated time."""
    parts: list[list[str]] = []
    total = PART_SECONDS
    for t in tests:
        took = durations.get(t, 0.0)
        if parts and total + took <= PART_SECONDS:
            parts[-1].append(t)
            total += took
        else:
            parts.append([t])
            total = took
    return parts


def run_tests(
    work: Path, mutant: str, profile: str, tests: Sequence[str], timeout: float
) -> int | None:
    """pytest's exit code for ``tests`` with ``mutant`` active in the work folder, under
    ``profile``; None when it outran ``timeout`` seconds of wall clock."""
    with tempfile.TemporaryDirectory(dir=work) as examples:
        env = campaign_env(work) | {"MUTANT_UNDER_TEST": mutant} | pinned_hypothesis(examples)
        cmd = [sys.executable, "-m", "pytest", *pytest_args(profile), *PINNED_SEED, *tests]
        try:
            return subprocess.run(
                cmd, cwd=work / "mutants", env=env, capture_output=True, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            return None


# What a re-check's pytest costs before its first test (imports, collection): part of the clean
# time its timeout is a multiple of.
STARTUP_SECONDS = 30.0
# A full re-check through the reach runs a survivor's tests in parts of at most this many seconds
# (of their unmutated time; a longer test is a part of its own) and keeps each part that passes.
# A survivor the lock-step machines reach costs up to two hours under ``thorough``, as long as a
# good share of a working session: run whole, one cut off with its session left nothing behind.
PART_SECONDS = 900.0


def recheck(
    work: Path,
    mutants: list[Mutant],
    profile: str,
    timeout: float,
    only: str | None = None,
    tests_only: Sequence[str] = (),
    reach: Reach | None = None,
    workers: int = 2,
    quick: float | None = None,
    keep: Callable[[], None] | None = None,
    infect: bool = False,
) -> None:
    """Run each survivor the ledger does not explain, each timeout, and each mutant no test
    called when the campaign recorded its coverage, again under ``profile``. Results are kept in
    the work folder (keyed by mutant and change), so ``report`` does not redo them.

    With ``reach`` (measured under ``profile``), a survivor runs the tests that executed its
    mutated statement, quickest first, and a run more than three times as long as those tests
    took unmutated counts as a timeout (a kill, as mutmut counts it); a survivor whose statement
    no test executed is ``unreached`` without a run. Without it, a survivor runs its covering
    tests (mutmut's, per function) with ``timeout`` seconds of wall clock. ``workers`` survivors
    run at a time.

    ``tests_only``: run just these tests (node ids or paths in the suite), the properties added
    for a class of survivors, instead of every covering test. Only kills are kept then: a
    mutant they do not kill has not met the rest of the suite, so it gets no verdict and a later
    full re-check still runs it.

    ``quick`` (seconds, with ``reach``): every survivor, whatever a cache says of its survival,
    runs just the tests that executed its statement and took at most ``quick`` seconds unmutated,
    quickest first; only kills are kept, as with ``tests_only``. A kept survival was decided
    against the suite of its day, and a property added since (often a quick one) may kill it:
    this finds those kills for the cost of the quick tests, where a full re-check of a survivor
    that the lock-step machines reach costs every one of them.

    ``infect`` (with ``reach``): before the full re-checks, one run of the suite probes where
    their mutated code would compute otherwise (``Infection``, kept per suite); each survivor
    then runs only the reaching tests it was infected in, and one infected in none is
    ``uninfected`` without a run.

    ``keep`` runs after every verdict: the campaign's state in the checkout is brought up to
    date then (``save_state``), so a re-check that outlasts its session loses at most the
    survivors still running."""
    if quick is not None and reach is None:
        raise CampaignError("a quick re-check needs the reach of its profile")
    stats = json.loads((work / "mutants" / "mutmut-stats.json").read_text())
    tests_by_function = stats["tests_by_mangled_function_name"]
    durations: dict[str, float] = stats["duration_by_test"]
    # Tests the campaign's stats do not know (added to the suite since, ``--refresh-suite``) may
    # cover any mutant: each re-check runs them too.
    new_tests = [] if reach else sorted(collect_tests(work) - set(stats["duration_by_test"]))
    cache_path = work / f"recheck-{profile}.json"
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    # A kill under another profile is a kill under this one too: a quick ``smoke`` pass first
    # spares the slow profile's run for every mutant it kills.
    killed_elsewhere = recheck_kills(work, skip=cache_path)
    sources: dict[str, str] = {}
    # (mutant, tests, timeout, run in parts): a full re-check of a survivor whose statement the
    # reach located runs in parts; every other job (targeted, quick, or over mutmut's covering
    # tests with the wall-clock timeout) runs whole.
    jobs: list[tuple[Mutant, list[str], float, bool]] = []
    parts_file = parts_path(work, profile)
    passed = passed_parts(parts_file, reach.suite) if reach is not None else {}
    keep_lock = threading.Lock()  # parts finish on the pool's threads
    full: dict[str, tuple[Mutant, list[str]]] = {}  # full re-checks through the reach

    def reached_by(m: Mutant, reach: Reach) -> tuple[set[str], list[str]] | None:
        """Every test that executed ``m``'s mutated statement, and those of them that pass
        unmutated, quickest first; None when the statement cannot be located."""
        module, function = m.name.rsplit(".", 1)
        path = module.replace(".", "/") + ".py"
        if path not in sources:
            sources[path] = (work / "mutants" / path).read_text()
        lines = mutated_lines(sources[path], function)
        if lines is None:
            return None
        found = reach.tests_at(path, lines)
        passing = found - set(reach.failing)
        return found, sorted(passing, key=lambda t: (reach.durations.get(t, 0.0), t))

    def limit(tests: list[str], reach: Reach) -> float:
        """Three times what ``tests`` took unmutated: longer is a timeout (a kill)."""
        return 3 * (sum(reach.durations.get(t, 0.0) for t in tests) + STARTUP_SECONDS)

    for m in mutants:
        if m.status not in RECHECKED or m.equivalent:
            continue
        if only is not None and not any(fnmatch.fnmatch(m.name, g) for g in only.split(",")):
            continue
        key = m.key
        if key not in cache and key in killed_elsewhere:
            m.recheck = "killed"
            continue
        if tests_only and cache.get(key) not in ("killed", "timeout"):
            # A survival the cache holds was against the suite of its day, without these tests.
            jobs.append((m, list(tests_only), timeout, False))
        elif quick is not None and reach is not None:
            undecided = cache.get(key) not in ("killed", "timeout") and key not in killed_elsewhere
            hit = reached_by(m, reach) if undecided else None
            fast = [t for t in (hit[1] if hit else []) if reach.durations.get(t, 0.0) <= quick]
            if fast:
                jobs.append((m, fast, limit(fast, reach), False))
        elif key not in cache:
            hit = reached_by(m, reach) if reach is not None else None
            if reach is not None and hit is not None:
                found, reaching = hit
                if not reaching and found:
                    pass  # only tests that fail unmutated reach it: no verdict to be had
                elif not reaching:
                    cache[key] = "unreached"  # no test executes the statement: nothing to run
                    _merge_into(cache_path, cache)
                else:
                    full[key] = (m, reaching)
            else:
                # The suite's newer tests first: they were added to kill survivors. Then the
                # covering tests quickest first (by the campaign's timings): the run stops at the
                # first failure, and a kill by a quick property should not wait behind every
                # lock-step machine the mutant also passes.
                covering = tests_by_function.get(m.function, ())
                tests = new_tests + sorted(covering, key=lambda t: (durations.get(t, 0.0), t))
                if tests:  # else still nothing calls it
                    jobs.append((m, tests, timeout, False))
        if key in cache:
            m.recheck = cache[key]

    probed = None
    if full and infect and reach is not None:
        # The kills this profile's re-checks made are the probes' positive controls.
        killed = {
            m.key: hit[1]
            for m in mutants
            if cache.get(m.key) in ("killed", "timeout") and (hit := reached_by(m, reach))
        }
        probed = infection_for(
            work,
            profile,
            reach.suite,
            ProbePlan(
                {key: reaching for key, (_, reaching) in full.items()},
                {m.key: m.name for m in mutants if m.key in full or m.key in killed},
                killed,
                load_guards(mutants),
            ),
        )
        if keep is not None:
            keep()  # the infection run cost about a suite run: kept before any re-check
    for key, (m, reaching) in full.items():
        assert reach is not None
        narrowed = probed.narrow(key, reaching) if probed is not None else None
        if narrowed == []:
            # No reaching test ever computed otherwise at the mutated code: nothing to run.
            cache[key] = m.recheck = "uninfected"
            _merge_into(cache_path, cache)
            continue
        # The parts an earlier run passed with this mutant active are not run again.
        passed_before = set(passed.get(key, ()))
        left = [t for t in (reaching if narrowed is None else narrowed) if t not in passed_before]
        jobs.append((m, left, limit(left, reach), True))

    # The pool's tasks: a whole job, or one part of a full re-check through the reach. Parts,
    # not survivors, share the workers: with one survivor left, both cores still work on it.
    tasks: list[tuple[Mutant, list[str], float, bool]] = []
    parts_left: dict[str, int] = {}
    # Cheapest first: a session that ends part-way has decided the most survivors.
    for m, tests, timeout, parted in sorted(jobs, key=lambda j: j[2]):
        if not parted or reach is None:
            tasks.append((m, tests, timeout, False))
            continue
        parts = split_parts(tests, reach.durations) or [[]]  # none left: survived already
        parts_left[m.key] = len(parts)
        tasks += [(m, part, limit(part, reach), True) for part in parts]
    failed_parts: set[str] = set()  # survivors a part killed: their other parts need not run
    skip = object()

    def run(task: tuple[Mutant, list[str], float, bool]) -> tuple[Mutant, Any]:
        m, tests, timeout, parted = task
        if not parted:
            return m, run_tests(work, m.name, profile, tests, timeout)
        if m.key in failed_parts:
            return m, skip
        code = run_tests(work, m.name, profile, tests, timeout) if tests else 0
        with keep_lock:
            if code != 0:
                failed_parts.add(m.key)
            elif tests and m.key not in failed_parts:
                assert reach is not None
                record_part(parts_file, reach.suite, m.key, tests)
                if keep is not None:
                    keep()
        return m, code

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        running = {pool.submit(run, task): task[3] for task in tasks}
        for done in concurrent.futures.as_completed(running):
            m, code = done.result()
            if code is skip:
                continue
            if running[done]:  # a part: the survivor is decided by a failing part, or by all
                if m.key in parts_left and code == 0:
                    parts_left[m.key] -= 1
                    if parts_left[m.key]:
                        continue
                if parts_left.pop(m.key, None) is None:
                    continue  # decided already
            verdict = (
                "timeout"
                if code is None
                else {0: "survived", 1: "killed"}.get(code, f"exit {code}")
            )
            print(f"re-check ({profile}) {m.name}: {verdict}", flush=True)
            if (tests_only or quick is not None) and verdict not in ("killed", "timeout"):
                continue  # these tests alone decide only kills
            cache[m.key] = m.recheck = verdict
            _merge_into(cache_path, cache)
            if reach is not None:
                record_part(parts_file, reach.suite, m.key, None)
            if keep is not None:
                with keep_lock:
                    keep()
    for m in mutants:  # earlier re-checks of mutants this one skipped still count
        key = m.key
        if m.recheck is None and key in cache:
            m.recheck = cache[key]
        if m.recheck in (None, "survived", "unreached", "uninfected") and key in killed_elsewhere:
            m.recheck = "killed"


def kept_verdicts(work: Path, mutants: list[Mutant]) -> None:
    """Give each mutant the verdict earlier re-checks kept, running nothing (``--recheck
    none``): a kill under any profile counts, else the survival or reach a cache recorded. The
    report then says where the campaign stands without starting hours of re-checks."""
    killed = recheck_kills(work)
    recorded: dict[str, str] = {}
    for cache in sorted(work.glob("recheck-*.json")):
        recorded.update(json.loads(cache.read_text()))
    for m in mutants:
        if m.status in RECHECKED:
            m.recheck = "killed" if m.key in killed else recorded.get(m.key)
