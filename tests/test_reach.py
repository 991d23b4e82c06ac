"""``omni-conformance reach``: the coverage plumbing measures child processes, the figures are
per file and per function, every target is reported (reached or not), and the report fits its
schema."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conformance import api
from conformance._core import schemas
from conformance._core.render import render
from conformance.release import reach, reach_subject


def _fake_vllm(root: Path) -> Path:
    """A tree shaped like the targets: two scheduler modules, one never imported."""
    sched = root / "v1" / "core" / "sched"
    sched.mkdir(parents=True)
    (sched / "scheduler.py").write_text(
        textwrap.dedent(
            """
            def schedule(n):
                if n > 1:
                    return "many"
                return "one"


            def untouched():
                return None
            """
        )
    )
    (sched / "unused.py").write_text("def never():\n    return 1\n")
    (root / "v1" / "request.py").write_text("class Request:\n    def go(self):\n        return 2\n")
    return root


def test_a_measured_run_counts_its_child_processes_per_function(tmp_path):
    root = _fake_vllm(tmp_path / "vllm")
    rc = reach.write_config(tmp_path / "data", reach.target_files(root))
    # The parent runs nothing of the targets; its child (as an xdist worker would) does.
    child = f"import sys; sys.path.insert(0, {str(root / 'v1' / 'core' / 'sched')!r}); "
    child += "import scheduler; scheduler.schedule(2)"
    script = tmp_path / "parent.py"
    script.write_text(
        f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {child!r}])\n"
    )
    subprocess.run([*reach.launcher(rc)[:-1], str(script)], check=True)

    measured = reach.measure(rc, root)
    assert sorted(measured) == [
        "v1/core/sched/scheduler.py",
        "v1/core/sched/unused.py",
        "v1/request.py",
    ]
    functions = measured["v1/core/sched/scheduler.py"]["functions"]
    assert functions["schedule"] == {"lines": 2, "statements": 3, "branches": 1, "branch_total": 2}
    assert functions["untouched"]["lines"] == 0
    # Never imported: reported, with nothing covered.
    assert measured["v1/core/sched/unused.py"]["total"]["lines"] == 0
    assert measured["v1/core/sched/unused.py"]["total"]["statements"] == 2
    assert measured["v1/request.py"]["functions"]["Request.go"]["lines"] == 0


def _side(schedule_lines: int, untouched_lines: int) -> dict:
    def figures(lines: int, statements: int) -> dict:
        return {"lines": lines, "statements": statements, "branches": 0, "branch_total": 0}

    return {
        "v1/core/sched/scheduler.py": {
            "total": figures(schedule_lines + untouched_lines, 5),
            "functions": {
                "schedule": figures(schedule_lines, 3),
                "untouched": figures(untouched_lines, 1),
            },
        }
    }


def test_the_report_names_what_only_one_run_reaches_and_fits_its_schema():
    sides = {"gate": _side(2, 0), "upstream tests": _side(0, 1)}
    env = {"vllm": "0.33.0", "subject": "upstream", "profile": "ci"}
    report = reach.build_report(sides, env, reach_subject.section(_upstream_plan(), {}))
    schemas.validate("reach", report)
    assert report["only"] == {
        "gate": {"v1/core/sched/scheduler.py": ["schedule"]},
        "upstream tests": {"v1/core/sched/scheduler.py": ["untouched"]},
    }
    assert report["sides"]["gate"]["totals"]["lines"] == 2
    md = render("reach.md.j2", report=report)
    assert "| gate | 2/5 (40.0%) | 0/0 (-%) |" in md
    assert "**only gate**: `v1/core/sched/scheduler.py`: `schedule`" in md
    bad = {**report, "sides": {"gate": {"totals": report["sides"]["gate"]["totals"]}}}
    assert "files" in str(schemas.problem("reach", bad))


def test_the_targets_are_the_installed_release_s_scheduler_modules():
    files = {p.relative_to(reach.vllm_root()).as_posix() for p in reach.target_files()}
    assert "v1/core/sched/scheduler.py" in files and "v1/core/kv_cache_manager.py" in files
    assert "v1/request.py" in files


def _upstream_plan() -> reach_subject.Plan:
    from conformance._core.subjects import UpstreamSubject

    return reach_subject.plan(UpstreamSubject())


def _fake_runtime(root: Path) -> Path:
    """A subject's package: a scheduler subpackage, a worker module, a data folder."""
    (root / "sched").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "sched" / "__init__.py").write_text("")
    (root / "sched" / "scheduler.py").write_text(
        textwrap.dedent(
            """
            def schedule(n):
                if n:
                    return 1
                return 0


            def big_unreached(n):
                a = n
                b = a + 1
                return b
            """
        )
    )
    (root / "worker.py").write_text("def run():\n    return 3\n")
    (root / "configs").mkdir()
    (root / "configs" / "pipeline.json").write_text("{}")
    return root


def test_without_the_hook_each_first_level_module_of_the_schedulers_package_is_an_area(
    tmp_path, monkeypatch
):
    root = _fake_runtime(tmp_path / "fakeruntime")
    monkeypatch.syspath_prepend(str(tmp_path))

    class Subject:
        sync_scheduler = "fakeruntime.sched.scheduler.Scheduler"

    planned = reach_subject.plan(Subject())
    assert planned.reason is None and not planned.declared
    assert planned.package == "fakeruntime" and planned.root == root.resolve()
    # The data folder holds no module: no area.
    assert dict(planned.paths) == {
        "__init__": ("__init__.py",),
        "sched": ("sched/",),
        "worker": ("worker.py",),
    }
    assert [p.name for p in planned.files["sched"]] == ["__init__.py", "scheduler.py"]
    # A class rather than a dotted name: its module's package.
    Subject.sync_scheduler = type("S", (), {"__module__": "fakeruntime.sched.scheduler"})
    assert reach_subject.plan(Subject()).package == "fakeruntime"


def test_a_declared_area_with_a_missing_path_reports_it_and_a_shared_file_counts_once(tmp_path):
    root = _fake_runtime(tmp_path / "fakeruntime")
    areas = api.SubjectAreas(
        package="fakeruntime",
        areas={
            "scheduler": ("sched/scheduler.py", "sched/gone.py"),
            "everything": ("sched/", "worker.py"),
            "absent": ("transfer/",),
        },
    )
    planned = reach_subject.resolve(areas, root.resolve())
    assert planned.missing == {
        "scheduler": ("sched/gone.py",),
        "everything": (),
        "absent": ("transfer/",),
    }
    names = {a: [p.name for p in files] for a, files in planned.files.items()}
    assert names == {
        "scheduler": ["scheduler.py"],
        "everything": ["__init__.py", "worker.py"],
        "absent": [],
    }


def test_a_subject_returning_something_else_than_subject_areas_is_refused():
    """Planted wrong declaration: a plain mapping is not read as areas."""

    class Subject:
        sync_scheduler = "x.Scheduler"

        def reach_areas(self):
            return {"scheduler": ("sched/",)}

    with pytest.raises(TypeError, match="SubjectAreas"):
        reach_subject.plan(Subject())


def test_the_subject_section_is_measured_rendered_and_fits_the_schema(tmp_path):
    root = _fake_runtime(tmp_path / "fakeruntime").resolve()
    areas = api.SubjectAreas(
        package="fakeruntime",
        areas={"scheduler": ("sched/scheduler.py", "sched/gone.py"), "worker": ("worker.py",)},
    )
    planned = reach_subject.resolve(areas, root)
    rc = reach.write_config(tmp_path / "data", planned.all_files())
    script = tmp_path / "run.py"
    script.write_text(
        f"import sys; sys.path.insert(0, {str(root / 'sched')!r}); "
        "import scheduler; scheduler.schedule(1)\n"
    )
    subprocess.run([*reach.launcher(rc)[:-1], str(script)], check=True)
    section = reach_subject.section(planned, reach.combined(rc, planned.all_files()))
    scheduler = section["areas"]["scheduler"]
    assert scheduler["missing"] == ["sched/gone.py"]
    assert scheduler["files"]["sched/scheduler.py"]["branches"] == 1
    assert scheduler["files"]["sched/scheduler.py"]["branch_total"] == 2
    assert scheduler["unreached"] == [
        {"file": "sched/scheduler.py", "function": "big_unreached", "statements": 3}
    ]
    # Never imported: there, with nothing covered.
    assert section["areas"]["worker"]["totals"] == {
        "lines": 0, "statements": 2, "branches": 0, "branch_total": 0,
    }  # fmt: skip
    assert section["totals"]["statements"] == scheduler["totals"]["statements"] + 2
    env = {"vllm": "0.33.0", "subject": "fake", "profile": "ci"}
    report = reach.build_report({"gate": _side(2, 0)}, env, section)
    schemas.validate("reach", report)
    md = render("reach.md.j2", report=report)
    assert "What the gate run executed of `fakeruntime`" in md
    assert "| worker | 1 | 0/2 (0.0%) | 0/0 (-%) | 1 |" in md
    assert "not in this installation: `sched/gone.py`" in md
    assert "`sched/scheduler.py` `big_unreached` (3)" in md
    # An area without figures is not a valid section.
    broken = {**section, "areas": {"scheduler": {"paths": ["sched/"]}}}
    assert schemas.problem("reach", {**report, "subject": broken}) is not None


def test_upstream_has_no_package_of_its_own_its_section_says_why():
    section = reach_subject.section(_upstream_plan(), {})
    assert section["status"] == "not_applicable"
    assert "vLLM's own" in section["reason"]
    env = {"vllm": "0.33.0", "subject": "upstream", "profile": "ci"}
    report = reach.build_report({"gate": _side(1, 0)}, env, section)
    schemas.validate("reach", report)
    assert "Not applicable: the subject's scheduler is vLLM's own" in render(
        "reach.md.j2", report=report
    )
    # Never an empty pass: a "measured" section with no areas does not fit the schema.
    empty = {"status": "measured", "side": "gate", "package": "x", "declared": False,
             "areas": {}, "totals": report["sides"]["gate"]["totals"]}  # fmt: skip
    assert schemas.problem("reach", {**report, "subject": empty}) is not None


def test_the_runtimes_declared_areas_exist_in_this_checkout():
    from omni_runtime.conformance_subject.subjects import OmniSubject

    planned = reach_subject.plan(OmniSubject())
    assert planned.declared and planned.package == "omni_runtime"
    assert all(not lacking for lacking in planned.missing.values()), planned.missing
    assert all(planned.files[a] for a in planned.paths)


@pytest.mark.slow
def test_reach_measures_the_gate_on_upstream(tmp_path):
    out = tmp_path / "reach"
    done = subprocess.run(
        [sys.executable, "-m", "conformance.cli", "reach", "--subject", "upstream",
         "--profile", "smoke", "--out", str(out)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "reach.json").read_text())
    schemas.validate("reach", report)
    assert report["subject"]["status"] == "not_applicable"
    scheduler = report["sides"]["gate"]["files"]["v1/core/sched/scheduler.py"]
    assert scheduler["functions"]["Scheduler.schedule"]["lines"] > 0
    assert scheduler["functions"]["Scheduler.update_from_output"]["branches"] > 0
    assert (out / "compat-report" / "compat-report.json").is_file()


@pytest.mark.slow
def test_check_reach_adds_the_run_s_reach_to_the_compat_report(tmp_path):
    """``check --reach``: the report carries per-file figures of the run (the priority axis
    alone here), fits its schema, and its Markdown shows them."""
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-m", "conformance.cli", "check", "--subject", "upstream",
         "--profile", "smoke", "--reach", "--report-dir", str(out),
         "--failures-dir", str(tmp_path / "failures"), "-n", "1",
         "--", "-k", "test_scheduler_axis and priority-sync"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "compat-report.json").read_text())
    schemas.validate("compat-report", report)
    files = report["reach"]["files"]
    assert files["v1/core/sched/scheduler.py"]["branches"] > 0
    assert files["v1/core/sched/request_queue.py"]["lines"] > 0  # the priority queue ran
    assert report["reach"]["totals"]["branches"] == sum(f["branches"] for f in files.values())
    assert "Reach of vLLM's scheduler code" in (out / "compat-report.md").read_text()
    assert "reach of vLLM's scheduler code: lines" in done.stdout
    assert not (out / "reach-data").exists()


def test_a_branch_belongs_to_the_area_its_condition_or_nearest_enclosing_one_names():
    """Positive control of the area split: a connector condition inside ``schedule`` is the KV
    connectors', a stats condition nested in it the statistics', the encoder-cache connector the
    encoder cache's (narrower areas first), a function's name names its body, the rest core."""
    from conformance.release import reach_areas

    source = textwrap.dedent(
        """
        def schedule(self, n):
            if n > 1:                                   # 3: core
                n -= 1
            if self.connector is not None:              # 5: KV connectors
                if self.log_stats:                      # 6: statistics and events
                    n += 1
                for r in self.running:                  # 8: KV connectors (inherited)
                    n += 2
            if self.ec_connector is not None:           # 10: encoder cache
                n = 0
            return n


        def update_draft_token_ids(self, drafts):
            for d in drafts:                            # 16: speculative decoding
                if d:                                   # 17: speculative decoding
                    return d
        """
    )
    areas = reach_areas.line_areas(source)
    assert 3 not in areas
    assert areas[5] == areas[8] == "KV connectors"
    assert areas[6] == "statistics and events"
    assert areas[10] == "multimodal and encoder cache"
    assert areas[16] == areas[17] == "speculative decoding"
    split = reach_areas.split(source, [(3, 4), (5, 6), (16, 17)], [(3, 5), (6, 8), (10, 11)])
    assert split == {
        "core": {"branches": 1, "branch_total": 2},
        "multimodal and encoder cache": {"branches": 0, "branch_total": 1},
        "speculative decoding": {"branches": 1, "branch_total": 1},
        "KV connectors": {"branches": 1, "branch_total": 1},
        "statistics and events": {"branches": 0, "branch_total": 1},
    }
    assert list(split) == [a for a in reach_areas.ORDER if a in split]


def test_a_condition_that_joins_a_feature_with_other_tests_names_only_its_own_branch():
    """The admission block vLLM guards with "nothing preempted and not paused" is core code:
    the pause test names the condition's branch, not the block it guards."""
    from conformance.release import reach_areas

    source = textwrap.dedent(
        """
        def schedule(self, preempted):
            if not preempted and self._pause_state != PAUSED:   # 3: pause
                while self.waiting:                              # 4: core
                    self.admit()
            if self.connector is not None and self.connector.ready:  # 6: KV connectors
                self.load()                                      # 7: KV connectors
        """
    )
    areas = reach_areas.line_areas(source)
    assert areas[3] == "pause and prefill cadence"
    assert 4 not in areas and 5 not in areas
    assert areas[6] == areas[7] == "KV connectors"
