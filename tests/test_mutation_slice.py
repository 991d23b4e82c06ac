"""The mutation campaign (the ``mutation`` package): its CI slice, and its bookkeeping.

The slice runs six mutants of C-45's trimming against the chunk contracts under the ``ci``
profile; all six must die. Two of them (rows blanked, start shifted) die only through the
completeness check the full campaign led to, so weakening that check fails this test. The rest
checks the parts of the campaign that turn mutmut's results into a score: statuses, the triage
ledger (matching, stale entries, bad files), the re-check's verdicts and the report, and the
state kept in the checkout that lets a campaign outlive its work folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import mutation
import mutation.cli
import mutation.infection
import mutation.infection_plugin
import mutation.infection_run
import mutation.ledger
import mutation.mutmut_run
import mutation.reach
import mutation.recheck
import mutation.report
import mutation.results
import mutation.state
import mutation.targets
import mutation.workdir

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_ci_slice_kills_its_sample(tmp_path: Path) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONHASHSEED="0")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mutation",
            "run",
            "--slice",
            "ci",
            "--work",
            str(tmp_path / "work"),
            "--state",
            str(tmp_path / "state"),
            "--children",
            "1",
            "--profile",
            "ci",
            "--recheck",
            "none",
            "--min-score",
            "1.0",
        ],
        cwd=ROOT,  # ``python -m mutation`` runs from the repository root
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| payload.py (CI sample) | 6 | 6 | 0 | 0 | 0 | 0 | 0 | 0 | 100.0% |" in proc.stdout


def _mutant(status: str, change: tuple[str, ...] = (), n: int = 1):
    m = mutation.results.Mutant(
        f"omni_runtime.payload.xǁStagePayloadǁnbytes__mutmut_{n}", "payload.py", status
    )
    m.change = change
    return m


def test_statuses_and_verdicts() -> None:
    assert mutation.results.status_of(1) == "killed"
    assert mutation.results.status_of(0) == "survived"
    assert mutation.results.status_of(33) == "no tests"
    assert mutation.results.status_of(-24) == "timeout"
    assert mutation.results.status_of(None) == "not run"
    survived = _mutant("survived", ("-a", "+b"))
    assert survived.final == "survived"
    survived.recheck = "killed"
    assert survived.final == "killed"  # the thorough re-check killed it
    timeout = _mutant("timeout")
    assert timeout.final == "timeout"  # no verdict before the re-check
    timeout.recheck = "survived"
    assert timeout.final == "survived"  # mutmut's wall clock was the load, not the mutant
    equivalent = _mutant("survived", ("-a", "+b"))
    equivalent.equivalent = "same behaviour"
    assert equivalent.final == "equivalent"


def test_ledger_matches_by_function_and_change_and_reports_stale_entries() -> None:
    function = "omni_runtime.payload.xǁStagePayloadǁnbytes"
    mutants = [_mutant("survived", ("-x = 1", "+x = 2"), 1), _mutant("survived", ("-y", "+z"), 2)]
    ledger = [
        {"function": function, "change": ["-x = 1", "+x = 2"], "reason": "x is never read"},
        {"function": function, "change": ["-gone", "+gone"], "reason": "old"},
    ]
    stale = mutation.ledger.apply_ledger(mutants, ledger)
    assert mutants[0].final == "equivalent" and mutants[1].final == "survived"
    assert stale == [ledger[1]]
    row = mutation.report.tally(mutants + [_mutant("killed", n=3), _mutant("killed", n=4)])
    assert row["mutants"] == 4 and row["killed"] == 2 and row["equivalent"] == 1
    assert mutation.report.score(row) == pytest.approx(2 / 3)  # equivalents leave the denominator
    text = mutation.report.render(mutants, stale, {"mutmut": "3.8.1", "profile": "smoke"})
    assert "| total | 2 | 0 | 1 | 1 | 0 | 0 | 0 | 0 | 0.0% |" in text
    not_run = mutation.report.tally([_mutant("not run", n=5), _mutant("killed", n=6)])
    assert mutation.report.score(not_run) == 1.0  # a mutant the campaign never ran is not scored
    assert "Stale ledger entries" in text and "-gone / +gone" in text


def test_ledger_errors_name_the_file_and_entry(tmp_path: Path) -> None:
    bad = tmp_path / "triage.toml"
    bad.write_text('[[equivalent]]\nfunction = "f"\nchange = ["-a", "+b"]\n')
    with pytest.raises(
        mutation.CampaignError, match=r"triage.toml: equivalent entry 1 has no 'reason'"
    ):
        mutation.ledger.load_ledger(bad)
    bad.write_text("[[equivalent]\n")
    with pytest.raises(mutation.CampaignError, match="triage.toml"):
        mutation.ledger.load_ledger(bad)
    shipped = mutation.ledger.load_ledger()  # parses, and every entry names a mutated function
    assert shipped and all(str(e["function"]).startswith("omni_runtime.") for e in shipped)


def test_work_folder_inside_the_checkout_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # (a folder that does not exist: a broken check must not be able to delete anything)
    assert mutation.cli.main(["run", "--work", str(ROOT / "not-a-work-folder")]) == 2
    assert "use a folder outside the repository" in capsys.readouterr().err
    assert mutation.cli.main(["report", "--work", str(ROOT / "no-such-campaign")]) == 2


def test_resume_runs_only_the_mutants_without_a_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A campaign stopped after two of three mutants: mutmut re-runs whatever is named on its
    # command line, so resuming must name only the third, and keep the clock going.
    chosen = mutation.targets.SLICES["ci"]
    target = chosen.targets[0]
    meta_file = tmp_path / "mutants" / f"{target.path}.meta"
    meta_file.parent.mkdir(parents=True)
    names = [name for name, _ in chosen.expected][:3]
    codes = {names[0]: 1, names[1]: 0, names[2]: None}
    meta_file.write_text(json.dumps({"exit_code_by_key": codes}))
    ran: list[object] = []
    monkeypatch.setattr(
        mutation.mutmut_run,
        "run_mutmut",
        lambda work, targets, children, names=None: ran.append(names),
    )
    meta: dict[str, object] = {"slice": "ci", "seconds": 120.0, "complete": False}
    meta_path = tmp_path / "campaign.json"
    mutation.mutmut_run.timed_mutmut(tmp_path, chosen, 1, meta, meta_path)
    assert ran == [[names[2]]]
    saved = json.loads(meta_path.read_text())
    assert saved["complete"] is True and saved["seconds"] >= 120.0

    # Nothing left to run: mutmut is not started at all.
    codes[names[2]] = 1
    meta_file.write_text(json.dumps({"exit_code_by_key": codes}))
    mutation.mutmut_run.timed_mutmut(tmp_path, chosen, 1, saved, meta_path)
    assert ran == [[names[2]]]

    # A fresh campaign (no time spent yet) names its mutants by glob, as ``run`` does.
    mutation.mutmut_run.timed_mutmut(
        tmp_path, chosen, 1, {"slice": "ci", "seconds": 0.0}, meta_path
    )
    assert ran[-1] is None


def test_verdicts_outlive_the_work_folder(tmp_path: Path) -> None:
    # A campaign longer than a session loses its work folder: the verdicts kept in the state
    # folder rebuild it over the campaign's commit, and mutmut keeps them (their functions'
    # hashes match), so resuming runs only the mutants that never got one.
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    chosen = mutation.targets.SLICES["ci"]
    state = tmp_path / "state"
    kept = state / "ci"
    kept.mkdir(parents=True)
    meta = {"slice": "ci", "rev": head, "profile": "ci", "seconds": 60.0, "complete": False}
    (kept / "campaign.json").write_text(json.dumps(meta))
    mutation.state.restore(tmp_path / "one", chosen, None, state)  # nothing decided yet
    assert {m.status for m in mutation.results.load_results(tmp_path / "one", chosen.targets)} == {
        "not run"
    }

    meta_file = tmp_path / "one" / "mutants" / f"{chosen.targets[0].path}.meta"
    data = json.loads(meta_file.read_text())
    names = [name for name, _ in chosen.expected]
    for name in names[:-1]:
        data["exit_code_by_key"][name] = 1
    meta_file.write_text(json.dumps(data))
    mutation.state.save_state(tmp_path / "one", chosen, state)

    mutation.state.restore(tmp_path / "two", chosen, None, state)
    found = {
        m.name: m.status for m in mutation.results.load_results(tmp_path / "two", chosen.targets)
    }
    assert [found[n] for n in names] == ["killed"] * (len(names) - 1) + ["not run"]
    assert json.loads((tmp_path / "two" / "campaign.json").read_text())["seconds"] == 60.0
    # The mutants exist again, so the report can show what each one changed.
    changed = mutation.results.mutant_changes(tmp_path / "two", names[:1])
    assert changed == {names[0]: chosen.expected[0][1]}

    # A campaign whose suite was refreshed is rebuilt with that suite, not its commit's: its
    # kept verdicts and reach were decided against it.
    touched = subprocess.run(
        ["git", "log", "-2", "--format=%H", "--", "invariants/audits.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if len(touched) == 2:  # else a shallow clone: no earlier suite to rebuild with
        older = touched[1]
        then = subprocess.run(
            ["git", "show", f"{older}:invariants/audits.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert then != (ROOT / "invariants" / "audits.py").read_text()
        (kept / "campaign.json").write_text(json.dumps(meta | {"suite_refreshed_from": older}))
        mutation.state.restore(tmp_path / "four", chosen, None, state)
        for copy in (tmp_path / "four", tmp_path / "four" / "mutants"):
            assert (copy / "invariants" / "audits.py").read_text() == then
        rebuilt = json.loads((tmp_path / "four" / "campaign.json").read_text())
        assert rebuilt["suite_refreshed_from"] == older
        assert not (tmp_path / "four" / "suite-of-refresh").exists()

    # A campaign over a working tree cannot be rebuilt: the error says so and how to go on.
    (kept / "campaign.json").write_text(json.dumps(meta | {"rev": "abc + working tree"}))
    with pytest.raises(mutation.CampaignError, match="pass --rev"):
        mutation.state.restore(tmp_path / "three", chosen, None, state)


def test_a_refreshed_suite_keeps_one_form_of_the_subject(tmp_path: Path) -> None:
    # The subject's declaration was a module before it became a package: a campaign refreshed
    # from a commit of either form is rebuilt with that form alone (a package left beside the
    # module would shadow it, and a commit lacking the current form must still be readable).
    package = "omni_runtime/conformance_subject"
    module = f"{package}.py"
    assert package in mutation.workdir.SUITE_PATHS
    work = tmp_path / "work"
    for copy in (work, work / "mutants"):
        (copy / "tests").mkdir(parents=True)
        (copy / module).parent.mkdir(parents=True)
        (copy / module).write_text("# the module form, left by the campaign's own commit\n")
    mutation.workdir.refresh_suite(work)  # the checkout's suite: the package
    for copy in (work, work / "mutants"):
        assert (copy / package / "__init__.py").is_file() and not (copy / module).exists()
    deleted = subprocess.run(
        ["git", "log", "--diff-filter=D", "--format=%H", "-1", "--", module],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if deleted:  # else a shallow clone: no commit with the module form to rebuild from
        mutation.workdir.refresh_suite(work, f"{deleted}~1")
        for copy in (work, work / "mutants"):
            assert (copy / module).is_file() and not (copy / package).exists()
        assert not (work / "suite-of-refresh").exists()


def test_two_work_folders_keep_each_others_kills(tmp_path: Path) -> None:
    """One campaign's state, two work folders (a long re-check in one, targeted re-checks in the
    other): saving either keeps the kills the other saved; a survival does not overwrite a kill,
    a later verdict otherwise replaces an earlier one."""
    chosen = mutation.targets.SLICES["ci"]
    state = tmp_path / "state"
    long, quick = tmp_path / "long", tmp_path / "quick"
    for work in (long, quick):
        (work / "mutants").mkdir(parents=True)
        (work / "campaign.json").write_text("{}")
    (long / "recheck-thorough.json").write_text(json.dumps({"a": "survived"}))
    (long / "recheck-ci.json").write_text(json.dumps({"b": "survived", "c": "survived"}))
    mutation.state.save_state(long, chosen, state)
    (quick / "recheck-ci.json").write_text(json.dumps({"b": "killed", "d": "unreached"}))
    mutation.state.save_state(quick, chosen, state)
    # The long re-check saves again after its next verdict, from its older copy.
    (long / "recheck-ci.json").write_text(json.dumps({"b": "survived", "c": "killed"}))
    mutation.state.save_state(long, chosen, state)
    kept = mutation.state.state_dir(state, chosen)
    assert json.loads((kept / "recheck-ci.json").read_text()) == {
        "b": "killed",
        "c": "killed",
        "d": "unreached",
    }
    assert json.loads((kept / "recheck-thorough.json").read_text()) == {"a": "survived"}
    # A report over an existing work folder takes in what the state kept since.
    for cache in kept.glob("recheck-*.json"):
        mutation.state.merge_verdicts(cache, long / cache.name)
    assert mutation.recheck.recheck_kills(long) == {"b", "c"}

    # A targeted re-check with a state folder of its own: ``merge --from`` brings its kills in.
    other = tmp_path / "other-state"
    mutation.state.state_dir(other, chosen).mkdir(parents=True)
    (mutation.state.state_dir(other, chosen) / "recheck-ci.json").write_text(
        json.dumps({"d": "killed", "e": "survived"})
    )
    argv = ["merge", "--slice", "ci", "--state", str(state), "--work", str(tmp_path / "none")]
    assert mutation.cli.main([*argv, "--from", str(other)]) == 0
    assert json.loads((kept / "recheck-ci.json").read_text()) == {
        "b": "killed",
        "c": "killed",
        "d": "killed",
        "e": "survived",
    }
    assert mutation.cli.main([*argv, "--from", str(tmp_path / "nothing")]) == 2


def _numbered(*statuses: str) -> list:
    """Mutants ``m.f__mutmut_1``, ``_2``, ... of the given mutmut statuses, changing ``-a`` to
    ``+b``, ``-c`` to ``+d``, and so on (their cache keys: ``m.f__mutmut_1 -a | +b``, ...)."""
    letters = "abcdefghij"
    return [
        mutation.results.Mutant(
            f"m.f__mutmut_{i + 1}", "t", status, (f"-{letters[2 * i]}", f"+{letters[2 * i + 1]}")
        )
        for i, status in enumerate(statuses)
    ]


def test_a_kill_under_one_recheck_profile_counts_under_another(tmp_path: Path) -> None:
    """A quick ``smoke`` re-check's kill stands for the slow profile's; its survivor does not."""
    (tmp_path / "mutants").mkdir()
    stats = {"tests_by_mangled_function_name": {}, "duration_by_test": {}}
    (tmp_path / "mutants" / "mutmut-stats.json").write_text(json.dumps(stats))
    smoke = {"m.f__mutmut_1 -a | +b": "killed", "m.f__mutmut_2 -c | +d": "survived"}
    (tmp_path / "recheck-smoke.json").write_text(json.dumps(smoke))
    mutants = _numbered("survived", "survived", "killed")
    mutation.recheck.recheck(tmp_path, mutants, "ci", 10.0)
    assert [m.final for m in mutants] == ["killed", "survived", "killed"]
    # Nothing was run under ``ci``: nothing calls these functions.
    assert not (tmp_path / "recheck-ci.json").exists()


def test_a_report_without_a_recheck_counts_the_kept_verdicts(tmp_path: Path) -> None:
    """``--recheck none`` runs nothing, yet says where the campaign stands: a kill kept under any
    profile counts, a kept survival or reach stays, and a mutant mutmut killed is left alone."""
    (tmp_path / "recheck-ci.json").write_text(json.dumps({"m.f__mutmut_1 -a | +b": "killed"}))
    thorough = {"m.f__mutmut_1 -a | +b": "survived", "m.f__mutmut_2 -c | +d": "unreached"}
    (tmp_path / "recheck-thorough.json").write_text(json.dumps(thorough))
    mutants = _numbered("survived", "survived", "no tests", "killed")
    mutation.recheck.kept_verdicts(tmp_path, mutants)
    assert [m.recheck for m in mutants] == ["killed", "unreached", None, None]
    assert [m.final for m in mutants] == ["killed", "survived", "no tests", "killed"]


def test_a_suite_failing_on_clean_code_stops_the_rerun(tmp_path: Path) -> None:
    """A refreshed suite that fails with no mutant active would count false kills: refused. A
    targeted re-check's clean run is its own tests: the rest of the suite may fail there."""
    tests = tmp_path / "mutants" / "invariants"
    tests.mkdir(parents=True)
    (tests / "test_broken.py").write_text(
        "import pytest\n\n@pytest.mark.invariants\ndef test_broken():\n    assert False\n"
    )
    (tests / "test_sound.py").write_text(
        "import pytest\n\n@pytest.mark.invariants\ndef test_sound():\n    assert True\n"
    )
    (tmp_path / "mutants" / "tests").mkdir()
    (tmp_path / "mutants" / mutation.targets.PROCESS_STAGE_TESTS).write_text("")
    # The harness's pytest plugin, as a work folder has its own copy (its options and markers).
    (tmp_path / "mutants" / "conformance").symlink_to(mutation.REPO / "conformance")
    failing = r"no mutant active \(exit 1\)(.|\n)*test_broken.py::test_broken"
    with pytest.raises(mutation.CampaignError, match=failing):
        mutation.recheck.clean_run(tmp_path, "smoke")
    mutation.recheck.clean_run(tmp_path, "smoke", ("invariants/test_sound.py::test_sound",))
    with pytest.raises(mutation.CampaignError, match=failing):
        mutation.recheck.clean_run(tmp_path, "smoke", ("invariants/test_broken.py::test_broken",))


# ---- reach: which test executes which mutated statement ---------------------------------------

_MUTANTS_SOURCE = '''
def x_f__mutmut_orig(a, b=1):
    """Doc."""
    c = a + b
    if c > 2:
        return min(
            c,
            9,
        )
    return c


def x_f__mutmut_1(a, b=1):
    """Doc."""
    c = a - b
    if c > 2:
        return min(
            c,
            9,
        )
    return c


def x_f__mutmut_2(a, b=1):
    """Doc."""
    c = a + b
    if c >= 2:
        return min(
            c,
            9,
        )
    return c


def x_f__mutmut_3(a, b=1):
    """Doc."""
    c = a + b
    if c > 2:
        return min(
            c,
            10,
        )
    return c


def x_f__mutmut_4(a, b=2):
    """Doc."""
    c = a + b
    if c > 2:
        return min(
            c,
            9,
        )
    return c
'''


def test_a_mutant_maps_to_the_statement_it_changes() -> None:
    """The re-check runs the tests that executed the mutated statement: its lines in the
    unmutated function. A compound statement is its header only (its body is other statements);
    a multi-line one is all its lines, any of which coverage may record; a change outside the
    body (a default) stands for the whole function."""
    lines = mutation.reach.mutated_lines
    assert lines(_MUTANTS_SOURCE, "x_f__mutmut_1") == (4,)
    assert lines(_MUTANTS_SOURCE, "x_f__mutmut_2") == (5,)
    assert lines(_MUTANTS_SOURCE, "x_f__mutmut_3") == (6, 7, 8, 9)
    assert lines(_MUTANTS_SOURCE, "x_f__mutmut_4") == tuple(range(2, 11))
    assert lines(_MUTANTS_SOURCE, "x_f__mutmut_9") is None


# A runtime module's way to run code in a forked process, as a stage engine does.
_FORKING = """
import multiprocessing


def forked(target, x):
    child = multiprocessing.get_context("fork").Process(target=target, args=(x,))
    child.start()
    child.join()
    return child.exitcode
"""

_REACHED_MODULE = (
    _FORKING
    + """

def in_process(x):
    return x + 1


def in_child(x):
    return x * 2


def fork_and_call(x):
    return forked(in_child, x)
"""
)


def _work_tree(tmp_path: Path, module: str, source: str, tests: str) -> None:
    """A work folder's ``mutants/`` tree holding one runtime module and one test module."""
    mutants = tmp_path / "mutants"
    (mutants / "omni_runtime").mkdir(parents=True)
    (mutants / "omni_runtime" / "__init__.py").write_text("")
    (mutants / "omni_runtime" / f"{module}.py").write_text(source)
    (mutants / "invariants").mkdir()
    (mutants / "invariants" / f"test_{module}.py").write_text(tests)
    (mutants / "tests").mkdir()
    (mutants / mutation.targets.PROCESS_STAGE_TESTS).write_text("")


_REACHING_TESTS = """
import pytest

from omni_runtime import reached


@pytest.mark.invariants
def test_calls_in_process():
    assert reached.in_process(1) == 2


@pytest.mark.invariants
def test_calls_in_a_child():
    assert reached.fork_and_call(3) == 0


@pytest.mark.invariants
def test_calls_nothing():
    assert True
"""


def test_the_reach_run_names_each_line_s_tests(tmp_path: Path) -> None:
    """One suite run under coverage.py labels every executed line with the test that executed
    it, in the test's process and in a process the test forked (the process stage's engine)."""
    _work_tree(tmp_path, "reached", _REACHED_MODULE, _REACHING_TESTS)
    reach = mutation.reach.measure_reach(tmp_path, "smoke", "abc")

    def tests_at(fn: str) -> set[str]:
        lines = _REACHED_MODULE.splitlines()
        start = next(i for i, text in enumerate(lines, 1) if text.startswith(f"def {fn}("))
        return reach.tests_at("omni_runtime/reached.py", [start + 1])

    here = "invariants/test_reached.py::"
    assert tests_at("in_process") == {here + "test_calls_in_process"}
    assert tests_at("in_child") == {here + "test_calls_in_a_child"}
    assert set(reach.durations) == {
        here + t for t in ("test_calls_in_process", "test_calls_in_a_child", "test_calls_nothing")
    }
    kept = mutation.reach.Reach.from_json(reach.to_json())
    assert kept == reach


def _recheck_tree(tmp_path: Path) -> None:
    """A work folder for the re-check's bookkeeping: ``_MUTANTS_SOURCE`` as its one mutated
    module, and mutmut's stats recording no test of its own."""
    mutants = tmp_path / "mutants"
    (mutants / "omni_runtime").mkdir(parents=True)
    (mutants / "omni_runtime" / "m.py").write_text(_MUTANTS_SOURCE)
    stats = {"tests_by_mangled_function_name": {}, "duration_by_test": {}}
    (mutants / "mutmut-stats.json").write_text(json.dumps(stats))


def test_a_survivor_no_test_reaches_is_not_run(tmp_path: Path) -> None:
    """Under a reach, a survivor whose mutated statement no test executed is ``unreached``
    without a run, and stays a survivor; one that some test executed would run."""
    _recheck_tree(tmp_path)
    reach = mutation.reach.Reach(
        "thorough", "abc", 1.0, ["t::a"], {"t::a": 1.0}, {"omni_runtime/m.py": {4: [0]}}
    )
    survivor = mutation.results.Mutant(
        "omni_runtime.m.x_f__mutmut_2", "m", "survived", ("-x", "+y")
    )
    mutation.recheck.recheck(tmp_path, [survivor], "thorough", 10.0, reach=reach, workers=1)
    assert survivor.recheck == "unreached" and survivor.final == "survived"
    cache = json.loads((tmp_path / "recheck-thorough.json").read_text())
    assert cache == {survivor.key: "unreached"}
    assert UNREACHED_NOTE in mutation.report.render([survivor], [], {})

    # Reached only by a test that fails with no mutant active: no verdict, neither way.
    failing = mutation.reach.Reach(
        "thorough", "abc", 1.0, ["t::a"], {"t::a": 1.0}, {"omni_runtime/m.py": {6: [0]}}, ["t::a"]
    )
    other = mutation.results.Mutant("omni_runtime.m.x_f__mutmut_3", "m", "survived", ("-x", "+z"))
    mutation.recheck.recheck(tmp_path, [other], "ci", 10.0, reach=failing, workers=1)
    assert other.recheck is None and other.key not in json.loads(
        (tmp_path / "recheck-ci.json").read_text()
        if (tmp_path / "recheck-ci.json").exists()
        else "{}"
    )
    # The report names such tests: every re-check runs without them.
    text = mutation.report.render([other], [], {}, failing.failing)
    assert "Tests left out of the re-checks" in text and "- `t::a`" in text
    assert "left out" not in mutation.report.render([other], [], {})


UNREACHED_NOTE = "no test executes the mutated statement"


def test_a_quick_recheck_runs_only_quick_reaching_tests_and_keeps_kills(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``quick``: a survivor the caches say survived runs again, with only the tests that reach
    its statement and took at most ``quick`` seconds, quickest first; a kill is kept, a
    survival is not (it says nothing of the slower tests), and a kept kill is not run again."""
    _recheck_tree(tmp_path)
    tests = ["t::slow", "t::quick", "t::quicker", "t::failing"]
    durations = {"t::slow": 500.0, "t::quick": 5.0, "t::quicker": 1.0, "t::failing": 0.5}
    # Every test reaches every line of the function: lines 1..30 of the source.
    lines = {"omni_runtime/m.py": {n: [0, 1, 2, 3] for n in range(1, 31)}}
    reach = mutation.reach.Reach("ci", "abc", 1.0, tests, durations, lines, ["t::failing"])
    killed = mutation.results.Mutant("omni_runtime.m.x_f__mutmut_1", "m", "survived", ("-a", "+b"))
    spared = mutation.results.Mutant("omni_runtime.m.x_f__mutmut_2", "m", "survived", ("-c", "+d"))
    before = mutation.results.Mutant("omni_runtime.m.x_f__mutmut_3", "m", "survived", ("-e", "+f"))
    elsewhere = mutation.results.Mutant(
        "omni_runtime.m.x_f__mutmut_4", "m", "survived", ("-g", "+h")
    )
    cache = {
        killed.key: "survived",
        spared.key: "survived",
        before.key: "killed",
        elsewhere.key: "survived",
    }
    (tmp_path / "recheck-ci.json").write_text(json.dumps(cache))
    (tmp_path / "recheck-smoke.json").write_text(json.dumps({elsewhere.key: "killed"}))
    ran: list[tuple[str, list[str]]] = []

    def run_tests(work: Path, mutant: str, profile: str, tests: list[str], timeout: float):
        ran.append((mutant, list(tests)))
        return 1 if mutant == killed.name else 0

    monkeypatch.setattr(mutation.recheck, "run_tests", run_tests)
    kept: list[int] = []
    mutation.recheck.recheck(
        tmp_path,
        [killed, spared, before, elsewhere],
        "ci",
        10.0,
        reach=reach,
        workers=1,
        quick=10.0,
        keep=lambda: kept.append(1),
    )
    assert kept == [1]  # the state is kept after the one verdict the pass decided
    assert sorted(ran) == [
        (killed.name, ["t::quicker", "t::quick"]),
        (spared.name, ["t::quicker", "t::quick"]),
    ]
    assert [m.final for m in (killed, spared, before, elsewhere)] == [
        "killed",
        "survived",
        "killed",
        "killed",  # a kill under another profile stands
    ]
    kept = json.loads((tmp_path / "recheck-ci.json").read_text())
    assert kept == cache | {killed.key: "killed"}
    with pytest.raises(mutation.CampaignError, match="reach"):
        mutation.recheck.recheck(tmp_path, [spared], "ci", 10.0, quick=10.0)


def test_a_full_recheck_keeps_the_parts_it_passed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full re-check through the reach runs a survivor's tests in parts of at most
    ``PART_SECONDS`` and keeps each part it passed, so a re-check cut off part-way (its session
    ended) goes on where it stopped; a part that fails is the verdict, and a verdict clears the
    parts. Parts kept against another suite count for nothing."""
    _recheck_tree(tmp_path)
    monkeypatch.setattr(mutation.recheck, "PART_SECONDS", 100.0)
    tests = ["t::a", "t::b", "t::c", "t::d"]
    # Quickest first, as a re-check orders them.
    durations = {"t::a": 10.0, "t::b": 80.0, "t::c": 150.0, "t::d": 160.0}
    lines = {"omni_runtime/m.py": {n: [0, 1, 2, 3] for n in range(1, 31)}}
    reach = mutation.reach.Reach("thorough", "abc", 1.0, tests, durations, lines)
    assert mutation.recheck.split_parts(tests, durations) == [["t::a", "t::b"], ["t::c"], ["t::d"]]
    survivor = mutation.results.Mutant(
        "omni_runtime.m.x_f__mutmut_1", "m", "survived", ("-a", "+b")
    )
    killed = mutation.results.Mutant("omni_runtime.m.x_f__mutmut_2", "m", "survived", ("-c", "+d"))
    ran: list[tuple[str, list[str], float]] = []

    class SessionEnded(Exception):
        pass

    def cut_off(work: Path, mutant: str, profile: str, tests: list[str], timeout: float):
        ran.append((mutant, list(tests), timeout))
        if tests == ["t::d"]:
            raise SessionEnded  # the session stops while the last part runs
        return 0

    monkeypatch.setattr(mutation.recheck, "run_tests", cut_off)
    kept: list[int] = []
    with pytest.raises(SessionEnded):
        mutation.recheck.recheck(
            tmp_path,
            [survivor],
            "thorough",
            10.0,
            reach=reach,
            workers=1,
            keep=lambda: kept.append(1),
        )
    # Each part ran with three times its own unmutated time (and start-up) as its timeout.
    start = mutation.recheck.STARTUP_SECONDS
    assert ran == [
        (survivor.name, ["t::a", "t::b"], 3 * (90.0 + start)),
        (survivor.name, ["t::c"], 3 * (150.0 + start)),
        (survivor.name, ["t::d"], 3 * (160.0 + start)),
    ]
    assert kept == [1, 1]  # the state was kept after each part that passed
    parts = mutation.recheck.parts_path(tmp_path, "thorough")
    assert mutation.recheck.passed_parts(parts, "abc") == {survivor.key: ["t::a", "t::b", "t::c"]}
    assert not (tmp_path / "recheck-thorough.json").exists()

    # The next session: only the part left runs, and the verdict replaces the parts.
    ran.clear()

    def finish(work: Path, mutant: str, profile: str, tests: list[str], timeout: float):
        ran.append((mutant, list(tests), timeout))
        return 1 if mutant == killed.name and "t::c" in tests else 0

    monkeypatch.setattr(mutation.recheck, "run_tests", finish)
    mutation.recheck.recheck(tmp_path, [survivor, killed], "thorough", 10.0, reach=reach, workers=1)
    assert [(m, t) for m, t, _ in ran] == [
        (survivor.name, ["t::d"]),
        (killed.name, ["t::a", "t::b"]),
        (killed.name, ["t::c"]),  # fails: the rest of its tests need not run
    ]
    assert (survivor.recheck, killed.recheck) == ("survived", "killed")
    assert mutation.recheck.passed_parts(parts, "abc") == {}
    assert json.loads((tmp_path / "recheck-thorough.json").read_text()) == {
        survivor.key: "survived",
        killed.key: "killed",
    }

    # Parts passed against another suite are not taken for this one's.
    mutation.recheck.record_part(parts, "abc", "k", ["t::a"])
    assert mutation.recheck.passed_parts(parts, "refreshed") == {}


# ---- infection: in which reaching test a mutant's code computes otherwise ----------------------

_PROBED_FUNCTION = """
def x_g__mutmut_N(items, limit=3, flag=False):
    total = 0
    for x in items:
        if x is None or x > 100 and flag:
            continue
        total = max(total, x, key=None)
    return sorted([total], reverse=flag)
"""
# Each mutant as mutmut writes it: a copy of the function with one change.
_PROBED_CHANGES = {
    1: ("x > 100 and flag", "x > 100 or flag"),
    2: ("reverse=flag", "reverse=None"),
    3: ("x, key=None)", "x, )"),
    4: ("continue", "break"),
    5: ("limit=3", "limit=4"),
}
_PROBED_SOURCE = (
    '"""Doc."""\n\nfrom __future__ import annotations\n'
    + _PROBED_FUNCTION.replace("_N(", "_orig(")
    + "".join(
        _PROBED_FUNCTION.replace("_N(", f"_{n}(").replace(old, new)
        for n, (old, new) in _PROBED_CHANGES.items()
    )
)


def _instrumented(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    source: str,
    mutants: list[str],
    guards: dict[str, str] | None = None,
) -> tuple[dict[str, Any], dict[str, str | None], Path]:
    """``source`` instrumented for ``mutants``, run: its namespace, each mutant's probe kind,
    and the folder of ``tmp_path`` its probes' hits go to."""
    text, plans = mutation.infection.instrument_source(source, mutants, guards)
    # Instrumented code imports the probes' runtime by its bare name, as it is found at the root
    # of the work folder's tree; here that name is the package's module.
    monkeypatch.setitem(sys.modules, mutation.infection.PLUGIN_MODULE, mutation.infection_plugin)
    hits = tmp_path / "hits"
    hits.mkdir()
    monkeypatch.setenv("OMNI_INFECTION_DIR", str(hits))
    monkeypatch.setenv("OMNI_INFECTION_CONTEXT", "t::one")
    namespace: dict[str, Any] = {}
    exec(compile(text, "probed.py", "exec"), namespace)
    return namespace, {n: p.kind if p else None for n, p in plans.items()}, hits


def _probed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Any], Path]:
    """The instrumented module's namespace, its probes' hits going to a folder of ``tmp_path``."""
    names = [f"x_g__mutmut_{n}" for n in range(1, 6)]
    namespace, kinds, hits = _instrumented(tmp_path, monkeypatch, _PROBED_SOURCE, names)
    assert kinds == {
        "x_g__mutmut_1": "truth",  # inside an ``if`` condition with no side effect
        "x_g__mutmut_2": "value",  # a pure expression replaced (``None``)
        "x_g__mutmut_3": "call",  # an argument dropped
        "x_g__mutmut_4": "statement",  # ``continue`` became ``break``
        "x_g__mutmut_5": None,  # a default in the signature: no probe
    }
    return namespace, hits


def _hits(hits: Path) -> set[str]:
    plugin = sys.modules[mutation.infection.PLUGIN_MODULE]
    plugin._seen.clear()  # the next call starts a fresh record, as a new test would
    found = {
        line.split("\t")[0] for f in hits.glob("hits.*.tsv") for line in f.read_text().split("\n")
    } - {""}
    for f in hits.glob("hits.*.tsv"):
        f.unlink()
    return found


def test_probes_observe_each_kind_of_mutation_without_changing_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An instrumented function returns what the unmutated one returns, and records a mutant
    only where its code would compute otherwise: a condition whose truth flips (not merely a
    term that changes), a value that differs, arguments that bind otherwise (a dropped one whose
    default is the value passed binds the same), a statement that executes."""
    namespace, hits = _probed(tmp_path, monkeypatch)
    g, mutant_1 = namespace["x_g__mutmut_orig"], namespace["x_g__mutmut_1"]
    # ``reverse=None`` and ``reverse=False`` are both falsy, but not the same value. ``max`` is
    # a builtin whose signature Python cannot read: its argument lists are compared as written,
    # so dropping ``key=None`` counts wherever the call runs.
    assert g([1, 2]) == [2]
    assert _hits(hits) == {"x_g__mutmut_2", "x_g__mutmut_3"}
    # ``x > 100 or flag`` differs from ``x > 100 and flag`` only for a small x with the flag set.
    assert g([1, 2], flag=True) == [2] and mutant_1([1, 2], flag=True) == [0]
    assert _hits(hits) == {"x_g__mutmut_1", "x_g__mutmut_2", "x_g__mutmut_3"}
    # ``None`` skipped: the ``continue`` executes.
    assert g([None, 5]) == [5]
    assert _hits(hits) == {"x_g__mutmut_2", "x_g__mutmut_3", "x_g__mutmut_4"}
    # A falsy flag that is not a bool: the condition's truth does not flip, the value does.
    assert g([3], flag=0) == [3]
    assert _hits(hits) == {"x_g__mutmut_2", "x_g__mutmut_3"}
    # No element: no condition, no call, no statement; only the value at the return.
    assert g([]) == [0]
    assert _hits(hits) == {"x_g__mutmut_2"}


def test_a_guard_excuses_only_where_it_is_false(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ledger guard, evaluated where the probe sees a difference, excuses the difference
    where it is false; a guard that raises excuses nothing."""
    guards = {"x_g__mutmut_1": "x > 1", "x_g__mutmut_4": "no_such_name"}
    namespace, kinds, hits = _instrumented(
        tmp_path, monkeypatch, _PROBED_SOURCE, list(guards), guards
    )
    assert kinds == {"x_g__mutmut_1": "truth", "x_g__mutmut_4": "statement"}
    g = namespace["x_g__mutmut_orig"]
    assert g([1], flag=True) == [1]  # the condition flips at x = 1, where the guard is false
    assert _hits(hits) == set()
    assert g([1, 2], flag=True) == [2]  # ... and at x = 2, where it holds
    assert _hits(hits) == {"x_g__mutmut_1"}
    assert g([None]) == [0]  # the statement runs; its guard raises NameError
    assert _hits(hits) == {"x_g__mutmut_4"}


def test_a_dropped_argument_equal_to_its_default_binds_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = """
def helper(a, b=False):
    return (a, b)


def x_h__mutmut_orig(a, b):
    return helper(a, b)


def x_h__mutmut_1(a, b):
    return helper(a, )
"""
    namespace, kinds, hits = _instrumented(tmp_path, monkeypatch, source, ["x_h__mutmut_1"])
    assert kinds == {"x_h__mutmut_1": "call"}
    h = namespace["x_h__mutmut_orig"]
    assert h(1, False) == (1, False)
    assert _hits(hits) == set()
    assert h(1, True) == (1, True)
    assert _hits(hits) == {"x_h__mutmut_1"}
    assert h(1, 0) == (1, 0)  # 0 is not the default False: another value, though as falsy
    assert _hits(hits) == {"x_h__mutmut_1"}


_SCALE_FUNCTION = """

def x_scale__mutmut_N(x, factor):
    if x > 10 and factor:
        return x * 2
    return x
"""
_SCALE_CHANGES = {1: ("10 and", "10 or"), 2: ("x * 2", "x * 3"), 3: ("x > 10", "x > 11")}
_INFECTED_MODULE = (
    '"""A module as mutmut\'s tree holds it: the unmutated function and mutants of it."""\n'
    + _FORKING
    + _SCALE_FUNCTION.replace("_N(", "_orig(")
    + "".join(
        _SCALE_FUNCTION.replace("_N(", f"_{n}(").replace(old, new)
        for n, (old, new) in _SCALE_CHANGES.items()
    )
    + """

def scale(x, factor):
    return x_scale__mutmut_orig(x, factor)


def in_child(x):
    scale(x, True)


def fork_and_scale(x):
    return forked(in_child, x)
"""
)

_INFECTING_TESTS = """
import pytest

from omni_runtime import infected


@pytest.mark.invariants
def test_same_truth():
    assert infected.scale(20, True) == 40 and infected.scale(3, False) == 3


@pytest.mark.invariants
def test_flips_in_process():
    assert infected.scale(3, True) == 3


@pytest.mark.invariants
def test_flips_in_a_child():
    assert infected.fork_and_scale(3) == 0
"""


def test_the_infection_run_names_the_tests_a_mutant_is_infected_in(tmp_path: Path) -> None:
    """One run with no mutant active, probes in place, names per mutant the tests in which its
    code computed otherwise, in the test's process and in one the test forked; the re-check
    then runs only those (and any test that did not pass in that run)."""
    _work_tree(tmp_path, "infected", _INFECTED_MODULE, _INFECTING_TESTS)
    mutants = tmp_path / "mutants"
    here = "invariants/test_infected.py::"
    tests = [
        here + t for t in ("test_same_truth", "test_flips_in_process", "test_flips_in_a_child")
    ]
    key = "omni_runtime.infected.x_scale__mutmut_1 -and | +or"
    names = {key: "omni_runtime.infected.x_scale__mutmut_1"}
    found = mutation.infection_run.infection_for(
        tmp_path, "smoke", "abc", mutation.infection_run.ProbePlan({key: tests}, names)
    )
    assert found.mutants[key] == {
        "probe": "truth",
        "infected": sorted(tests[1:]),
        "passed": sorted(tests),
    }
    assert found.narrow(key, tests) == tests[1:]
    assert found.narrow("another", tests) is None  # not measured: every reaching test runs
    # A test the run did not pass, or did not run, is never left out.
    assert found.narrow(key, [here + "test_new", *tests]) == [here + "test_new", *tests[1:]]
    # Kept per suite in the work folder: asked again, nothing runs.
    kept = mutation.infection_run.load_infection(tmp_path, "smoke", "abc")
    assert (
        kept == found and mutation.infection_run.load_infection(tmp_path, "smoke", "other") is None
    )
    # The run leaves the work folder's own tree as it was.
    assert (mutants / "omni_runtime" / "infected.py").read_text() == _INFECTED_MODULE

    # Kills are the probes' positive controls: one that no probe saw infected in any test that
    # reaches it (here a mutant that could not have been killed, passed off as a kill) refuses
    # the run; a real one passes and is kept as a control.
    base = "omni_runtime.infected.x_scale__mutmut_"
    control = {f"{base}2 -2 | +3": f"{base}2"}
    missed = {f"{base}3 -10 | +11": f"{base}3"}
    plan = {key: tests}
    measured = mutation.infection_run.measure_infection(
        tmp_path,
        "smoke",
        "abc",
        mutation.infection_run.ProbePlan(plan, names | control, dict.fromkeys(control, tests)),
    )
    assert measured.mutants[f"{base}2 -2 | +3"]["infected"] == [tests[0]]
    assert measured.mutants[f"{base}2 -2 | +3"]["control"] is True
    with pytest.raises(mutation.CampaignError, match="probes missed .*x_scale__mutmut_3"):
        mutation.infection_run.measure_infection(
            tmp_path,
            "smoke",
            "abc",
            mutation.infection_run.ProbePlan(plan, names | missed, dict.fromkeys(missed, tests)),
        )


def test_a_full_recheck_runs_only_the_tests_a_survivor_is_infected_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``infect``, a full re-check through the reach runs each survivor's infected tests
    only; one infected in none is ``uninfected`` without a run and stays a survivor; one whose
    infection could not be probed, or was met outside any test, runs every reaching test."""
    _recheck_tree(tmp_path)
    tests = ["t::a", "t::b", "t::c"]
    durations = {"t::a": 1.0, "t::b": 2.0, "t::c": 3.0}
    lines = {"omni_runtime/m.py": {n: [0, 1, 2] for n in range(1, 31)}}
    reach = mutation.reach.Reach("thorough", "abc", 1.0, tests, durations, lines)
    m = [
        mutation.results.Mutant(f"omni_runtime.m.x_f__mutmut_{n}", "m", "survived", (f"-{n}", "+n"))
        for n in (1, 2, 3, 4)
    ]
    record = {"probe": "value", "passed": tests}
    kept = mutation.infection_run.Infection(
        "thorough",
        "abc",
        5.0,
        dict.fromkeys(tests, "passed"),
        {
            m[0].key: record | {"infected": ["t::b"]},
            m[1].key: record | {"infected": []},
            m[2].key: record | {"infected": ["", "t::a"]},
            m[3].key: record | {"probe": None, "infected": []},
        },
    )
    mutation.infection_run.infection_path(tmp_path, "thorough").write_text(
        json.dumps(dataclasses.asdict(kept))
    )
    ran: list[tuple[str, list[str]]] = []

    def run_tests(work: Path, mutant: str, profile: str, tests: list[str], timeout: float):
        ran.append((mutant, list(tests)))
        return 0

    monkeypatch.setattr(mutation.recheck, "run_tests", run_tests)
    mutation.recheck.recheck(tmp_path, m, "thorough", 10.0, reach=reach, workers=1, infect=True)
    assert sorted(ran) == [(m[0].name, ["t::b"]), (m[2].name, tests), (m[3].name, tests)]
    assert [x.recheck for x in m] == ["survived", "uninfected", "survived", "survived"]
    assert m[1].final == "survived"
    assert "computes anything otherwise" in mutation.report.render(m, [], {})
    # Without ``infect`` every reaching test runs, as before.
    ran.clear()
    (tmp_path / "recheck-thorough.json").unlink()
    mutation.recheck.recheck(tmp_path, m[:1], "thorough", 10.0, reach=reach, workers=1)
    assert ran == [(m[0].name, tests)]


def test_one_survivor_s_parts_share_the_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one survivor left, its parts run side by side on the workers, not one after the
    other; a failing part is its verdict, whatever the parts still running do, and no part of
    a killed survivor is kept."""
    _recheck_tree(tmp_path)
    monkeypatch.setattr(mutation.recheck, "PART_SECONDS", 100.0)
    tests = ["t::a", "t::b", "t::c"]
    durations = {"t::a": 90.0, "t::b": 95.0, "t::c": 99.0}
    lines = {"omni_runtime/m.py": {n: [0, 1, 2] for n in range(1, 31)}}
    reach = mutation.reach.Reach("thorough", "abc", 1.0, tests, durations, lines)
    survivor = mutation.results.Mutant(
        "omni_runtime.m.x_f__mutmut_1", "m", "survived", ("-a", "+b")
    )
    together = threading.Barrier(2, timeout=30)
    ran: list[list[str]] = []

    def run_tests(work: Path, mutant: str, profile: str, tests: list[str], timeout: float):
        ran.append(list(tests))
        if tests != ["t::c"]:
            together.wait()  # both of the first two parts are running at once
            return 1 if tests == ["t::a"] else 0
        return 0

    monkeypatch.setattr(mutation.recheck, "run_tests", run_tests)
    mutation.recheck.recheck(tmp_path, [survivor], "thorough", 10.0, reach=reach, workers=2)
    assert survivor.recheck == "killed"
    assert sorted(ran)[:2] == [["t::a"], ["t::b"]]
    assert (
        mutation.recheck.passed_parts(mutation.recheck.parts_path(tmp_path, "thorough"), "abc")
        == {}
    )


def test_guards_match_by_function_and_change_and_bad_ones_are_refused(tmp_path: Path) -> None:
    """A ledger guard applies to the survivor whose function and change it names (as an
    equivalent entry does); one without a field, or whose ``when`` is no expression, is refused
    naming the file and the entry."""
    ledger = tmp_path / "triage.toml"
    ledger.write_text(
        "[[guard]]\n"
        'function = "omni_runtime.m.x_f"\n'
        'change = ["-a", "+b"]\n'
        'when = "x is None"\n'
        'reason = "why"\n'
    )
    hit = mutation.results.Mutant("omni_runtime.m.x_f__mutmut_1", "m", "survived", ("-a", "+b"))
    other = mutation.results.Mutant("omni_runtime.m.x_f__mutmut_2", "m", "survived", ("-a", "+c"))
    assert mutation.ledger.load_guards([hit, other], ledger) == {hit.key: "x is None"}
    ledger.write_text('[[guard]]\nfunction = "f"\nchange = ["-a"]\nreason = "why"\n')
    with pytest.raises(mutation.CampaignError, match="triage.toml: guard entry 1 has no 'when'"):
        mutation.ledger.load_guards([hit], ledger)
    ledger.write_text('[[guard]]\nfunction = "f"\nchange = ["-a"]\nwhen = "x is"\nreason = "why"\n')
    with pytest.raises(mutation.CampaignError, match="guard entry 1: 'when' is no expression"):
        mutation.ledger.load_guards([hit], ledger)
