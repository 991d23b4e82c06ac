"""The infection run: in which of its reaching tests a survivor's mutated code computes otherwise.

Owns one pytest run, with no mutant active, of the tests that reach the pending survivors, in a
copy of the work folder's tree whose unmutated functions carry the probes of ``mutation.infection``
(``measure_infection``; ``mutation/infection_plugin.py`` is copied into the tree and loaded as
``-p infection_plugin``), with kills probed alongside as positive controls; and its record, kept
per profile and suite and extended survivor by survivor (``Infection``, ``infection_for``). A
survivor then re-runs only the reaching tests it was infected in (``Infection.narrow``).
Method: ``docs/mutation-score.md``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mutation import CampaignError, infection
from mutation.reach import observed_run
from mutation.state import update_json

INFECTION_PLUGIN = Path(__file__).with_name("infection_plugin.py")


@dataclasses.dataclass
class Infection:
    """Per survivor, the tests of the work folder's suite in which its mutated code, probed in
    the unmutated run under one profile and the pinned seed, ever computed something other than
    the unmutated code (``mutation/infection.py``). A test outside that set executes the same
    code with the same state as the mutant's run would, so it passes with the mutant: the
    re-check runs only the others.

    ``mutants``: by mutant key, ``{"probe": kind or None, "infected": [tests], "passed":
    [tests]}``: the tests it was infected in, and those of its run that passed. A test named
    ``""`` is an infection outside any test (a stage process between tests), which narrows
    nothing; a test that did not pass in the mutant's run (or was not in it) is never left out.
    ``tests``: what each test did in the runs so far (``passed``, ``failed``, ``skipped``)."""

    profile: str
    suite: str
    seconds: float
    tests: dict[str, str]
    mutants: dict[str, dict[str, Any]]

    def narrow(self, key: str, reaching: Sequence[str]) -> list[str] | None:
        """The tests of ``reaching`` that ``key``'s mutant must still run, in their order; None
        when its infection was not measured (or could not be probed): then all of them."""
        record = self.mutants.get(key)
        if record is None or record.get("probe") is None:
            return None
        infected, passed = set(record["infected"]), set(record["passed"])
        if "" in infected:
            return None
        return [t for t in reaching if t in infected or t not in passed]


def infection_path(work: Path, profile: str) -> Path:
    return work / f"infection-{profile}.json"


def load_infection(work: Path, profile: str, suite: str) -> Infection | None:
    path = infection_path(work, profile)
    if not path.is_file():
        return None
    kept = Infection(**json.loads(path.read_text()))
    return kept if kept.suite == suite else None


@dataclasses.dataclass(frozen=True)
class ProbePlan:
    """What an infection run probes: ``reaching``, survivors by key with the tests that reach
    them; ``names``, every probed mutant's mangled name by key; ``controls``, kills probed as
    positive controls, with their reaching tests; ``guards``, the ledger's guards by key."""

    reaching: Mapping[str, list[str]]
    names: Mapping[str, str]
    controls: Mapping[str, list[str]] = dataclasses.field(default_factory=dict)
    guards: Mapping[str, str] = dataclasses.field(default_factory=dict)


def measure_infection(work: Path, profile: str, suite: str, request: ProbePlan) -> Infection:
    """One run, with no mutant active, of the tests that reach ``request``'s survivors, under
    ``profile``, in a copy of the work folder's tree whose unmutated functions carry the probes
    of those mutants and of its controls.

    ``controls``: mutants a re-check under ``profile`` killed, with the tests that reach them,
    probed in the same run as positive controls: a kill needs a test in which the mutated code
    computed otherwise, so each control whose reaching tests all ran must be infected in one.
    One that is not means the probes miss infections, and narrowing by them would drop tests
    that kill: the run is refused. A guard (``load_guards``) applies to a survivor, never to a
    control."""
    controls, names = request.controls, request.names
    guards = {
        k: v for k, v in request.guards.items() if k in request.reaching and k not in controls
    }
    plan = {**controls, **request.reaching}
    root = (work / "infection").resolve()
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(
        work / "mutants", root / "mutants", ignore=shutil.ignore_patterns("__pycache__")
    )
    probes: dict[str, str | None] = {}
    by_file: dict[str, list[str]] = {}
    mangled: dict[str, str] = {}  # key -> the mangled name, as probes record it
    for key in plan:
        module, mangled[key] = names[key].rsplit(".", 1)
        by_file.setdefault(module.replace(".", "/") + ".py", []).append(mangled[key])
    found: dict[str, infection.Probe | None] = {}
    by_name = {mangled[k]: when for k, when in guards.items()}
    for path, functions in by_file.items():
        target = root / "mutants" / path
        text, plans = infection.instrument_source(target.read_text(), functions, by_name)
        target.write_text(text)
        found.update(plans)
    for key in plan:
        probe = found.get(mangled[key])
        probes[key] = probe.kind if probe is not None else None
    hits = root / "hits"
    hits.mkdir()
    tests = sorted(
        {t for key, ts in plan.items() if key not in controls and probes[key] for t in ts}
    )
    seconds = 0.0
    if tests:
        probed = [key for key, kind in probes.items() if kind is not None]
        print(
            f"probing the infections of {sum(k not in controls for k in probed)} survivors and "
            f"{sum(k in controls for k in probed)} kills (controls) under {profile} "
            f"({len(tests)} tests, one run)",
            flush=True,
        )
        _, seconds = observed_run(
            work,
            root / "mutants",
            INFECTION_PLUGIN,
            profile,
            tests,
            {"OMNI_INFECTION_DIR": str(hits)},
            root / "examples",
            "infection",
        )
    ran: dict[str, str] = {}
    for f in sorted(hits.glob("ran.*.json")):
        for test, outcome in json.loads(f.read_text()).items():
            if ran.get(test) != "failed":
                ran[test] = outcome
    infected: dict[str, set[str]] = {}
    for f in sorted(hits.glob("hits.*.tsv")):
        for line in f.read_text().splitlines():
            name, _, test = line.partition("\t")
            infected.setdefault(name, set()).add(test)
    found_in = {key: sorted(infected.get(mangled[key], ())) for key in plan}
    for key, reaching in controls.items():
        if probes[key] and reaching and set(reaching) <= set(tests) and not found_in[key]:
            raise CampaignError(
                f"the infection probes missed {names[key]}: a re-check under {profile} killed "
                f"it, yet no probe ({probes[key]}) saw its code compute otherwise in any of the "
                f"{len(reaching)} tests that reach it; narrowing by them would drop killing tests"
            )
    return Infection(
        profile,
        suite,
        seconds,
        ran,
        {
            key: {
                "probe": probes[key],
                "infected": found_in[key],
                "passed": sorted(t for t in plan[key] if ran.get(t) == "passed"),
            }
            | ({"control": True} if key in controls else {})
            | ({"guard": guards[key]} if key in guards else {})
            for key in plan
        },
    )


def infection_for(work: Path, profile: str, suite: str, request: ProbePlan) -> Infection:
    """The kept infection of the work folder's suite under ``profile``, measured first for the
    survivors of ``request`` it lacks, or holds under another guard (one run for all of them,
    ``measure_infection``), and kept with the rest."""
    kept = load_infection(work, profile, suite)
    missing = {
        k: v
        for k, v in request.reaching.items()
        if kept is None
        or k not in kept.mutants
        or kept.mutants[k].get("guard") != request.guards.get(k)
    }
    if not missing:
        assert kept is not None
        return kept
    new = measure_infection(work, profile, suite, dataclasses.replace(request, reaching=missing))

    def merged(on_disk: dict[str, Any]) -> dict[str, Any]:
        if on_disk.get("suite") != suite:
            on_disk = {}
        tests = {**on_disk.get("tests", {}), **new.tests}
        return dataclasses.asdict(new) | {
            "seconds": float(on_disk.get("seconds", 0.0)) + new.seconds,
            "tests": tests,
            "mutants": {**on_disk.get("mutants", {}), **new.mutants},
        }

    update_json(infection_path(work, profile), merged)
    result = load_infection(work, profile, suite)
    assert result is not None
    return result
