"""``omni-conformance upstream-tests``: vLLM's own scheduler tests on a subject's classes.

The fast tests need neither vLLM imported nor the network: the JSON contract, the swap on a
synthetic module, JUnit parsing, test-file selection and extraction from a synthetic sdist, the
fetch path with a stand-in pip, the offline/empty-cache exit. One slow test runs vLLM 0.33.0's
real scheduler tests for ``omni-scheduler`` against the upstream baseline.
"""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import tarfile
import types
from pathlib import Path

import pytest

from conformance.cli import main
from conformance.release import upstream_tests as ut
from conformance.release.upstream_swap import Swapper, release_modules

JSON_KEYS = {
    "vllm": str,
    "subject": str,
    "passed": int,
    "failed": int,
    "skipped": int,
    "errors": int,
    "total": int,
    "failing": list,
    "baseline_failing": list,
    "duration_s": float,
    "tests_source": str,
}


def _check_shape(doc: dict) -> None:
    assert set(doc) == set(JSON_KEYS)
    for key, typ in JSON_KEYS.items():
        assert isinstance(doc[key], typ), key
    assert doc["total"] == doc["passed"] + doc["failed"] + doc["skipped"] + doc["errors"]
    assert set(doc["baseline_failing"]) <= set(doc["failing"])


# ---- the JSON contract and the verdict ----------------------------------------------------


def test_result_json_has_exactly_the_matrix_shape():
    subject = {"a::t1": "passed", "a::t2": "failed", "a::t3": "errors", "a::t4": "skipped"}
    baseline = {"a::t1": "passed", "a::t2": "passed", "a::t3": "errors", "a::t4": "skipped"}
    verdict = ut.compare(subject, baseline)
    doc = ut.result_json("0.33.0", "omni", subject, verdict, 12, "vllm-0.33.0.tar.gz")
    _check_shape(doc)
    assert doc["failing"] == ["a::t2", "a::t3"]
    assert doc["baseline_failing"] == ["a::t3"]
    assert (doc["passed"], doc["failed"], doc["skipped"], doc["errors"]) == (1, 1, 1, 1)
    json.dumps(doc)


def test_verdict_counts_only_what_upstream_passes():
    baseline = {"x": "passed", "y": "failed", "z": "passed", "w": "passed"}
    subject = {"x": "passed", "y": "failed", "z": "skipped"}  # w did not run at all
    verdict = ut.compare(subject, baseline)
    assert verdict.baseline_failing == ["y"]
    assert verdict.regressions == ["w", "z"]
    assert (
        ut.compare(
            {"x": "passed", "y": "failed"}, baseline | {"z": "failed", "w": "failed"}
        ).regressions
        == []
    )
    # Without a baseline every failure is the subject's.
    assert ut.compare({"x": "errors"}, None).regressions == ["x"]


# ---- the swap --------------------------------------------------------------------------


class Upstream:
    pass


class UpstreamAsync(Upstream):
    pass


class Theirs(Upstream):
    pass


class TheirsAsync(UpstreamAsync):
    pass


class VllmSubclass(Upstream):
    """A vLLM subclass a test picks on purpose: never replaced."""


def test_swap_rebinds_upstream_names_in_a_synthetic_module():
    mod = types.ModuleType("tests.v1.core.synthetic")
    mod.Scheduler = Upstream
    mod.AsyncScheduler = UpstreamAsync
    mod.Alias = Upstream
    mod.Picked = VllmSubclass
    mod.other = 3
    swapper = Swapper({Upstream: Theirs, UpstreamAsync: TheirsAsync})
    changed = swapper.swap_module(mod)
    assert sorted(changed) == [
        "tests.v1.core.synthetic.Alias",
        "tests.v1.core.synthetic.AsyncScheduler",
        "tests.v1.core.synthetic.Scheduler",
    ]
    assert mod.Scheduler is Theirs and mod.Alias is Theirs and mod.AsyncScheduler is TheirsAsync
    assert mod.Picked is VllmSubclass and mod.other == 3
    # Idempotent: a second pass (before the next test) finds nothing left to change.
    assert swapper.swap_module(mod) == []
    # Upstream swapped for itself changes nothing and records nothing.
    same = Swapper({Upstream: Upstream})
    mod2 = types.ModuleType("m2")
    mod2.Scheduler = Upstream
    assert same.swap_module(mod2) == [] and mod2.Scheduler is Upstream


def test_swap_only_touches_modules_under_the_release_tree(tmp_path):
    inside = types.ModuleType("tests.v1.core.utils")
    inside.__file__ = str(tmp_path / "tests" / "v1" / "core" / "utils.py")
    outside = types.ModuleType("vllm.v1.core.sched.scheduler")
    outside.__file__ = "/elsewhere/vllm/v1/core/sched/scheduler.py"
    builtin = types.ModuleType("builtin_thing")
    found = release_modules(tmp_path, {"a": inside, "b": outside, "c": builtin})
    assert found == [inside]


# ---- JUnit ------------------------------------------------------------------------------

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="2" failures="1" skipped="2" tests="7">
 <testcase classname="tests.v1.core.test_scheduler" name="test_ok" time="0.1"/>
 <testcase classname="tests.v1.core.test_scheduler" name="test_bad[True]" time="0.1">
  <failure message="assert 1 == 2">trace</failure></testcase>
 <testcase classname="tests.v1.core.test_scheduler" name="test_fixture" time="0">
  <error message="failed on setup with fixture 'x' not found">trace</error></testcase>
 <testcase classname="tests.v1.core.test_scheduler" name="test_skip" time="0">
  <skipped type="pytest.skip" message="needs a GPU">skip</skipped></testcase>
 <testcase classname="tests.v1.core.test_scheduler" name="test_xfail" time="0">
  <skipped type="pytest.xfail" message="known"/></testcase>
 <testcase classname="tests.v1.core.test_kv.TestProbe" name="test_in_class" time="0"/>
 <testcase classname="" name="tests.v1.core.prefix_cache.test_broken" time="0">
  <error message="collection failure">ImportError</error></testcase>
</testsuite></testsuites>
"""


def test_junit_parses_into_node_ids_and_counts(tmp_path):
    for rel in (
        "tests/v1/core/test_scheduler.py",
        "tests/v1/core/test_kv.py",
        "tests/v1/core/prefix_cache/test_broken.py",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    outcomes = ut.parse_junit(JUNIT, ut.module_paths(tmp_path))
    assert outcomes == {
        "tests/v1/core/test_scheduler.py::test_ok": "passed",
        "tests/v1/core/test_scheduler.py::test_bad[True]": "failed",
        "tests/v1/core/test_scheduler.py::test_fixture": "errors",
        "tests/v1/core/test_scheduler.py::test_skip": "skipped",
        "tests/v1/core/test_scheduler.py::test_xfail": "skipped",
        "tests/v1/core/test_kv.py::TestProbe::test_in_class": "passed",
        "tests/v1/core/prefix_cache/test_broken.py": "errors",
    }
    assert ut.counts(outcomes) == {
        "passed": 2,
        "failed": 1,
        "skipped": 2,
        "errors": 2,
        "total": 7,
    }


# ---- taking the tests out of an sdist ------------------------------------------------------

SCHED_TEST = (
    b"from vllm.v1.core.sched.scheduler import Scheduler\nfrom .utils import create_scheduler\n"
)
PLAIN_TEST = b"from .utils import create_requests\n"
UTILS = b"from tests.v1.kv_connector.unit.utils import MockKVConfig\nimport torch\n"


def _sdist(path: Path, version: str = "0.33.0") -> Path:
    files = {
        "PKG-INFO": f"Metadata-Version: 2.4\nName: vllm\nVersion: {version}\n".encode(),
        "pyproject.toml": b'[tool.pytest.ini_options]\nmarkers = ["cpu_test: CPU"]\naddopts = "-x"\n',
        "tests/__init__.py": b"",
        "tests/conftest.py": b"import needs_everything\n",
        "tests/v1/__init__.py": b"",
        "tests/v1/core/__init__.py": b"",
        "tests/v1/core/utils.py": UTILS,
        "tests/v1/core/test_scheduler.py": SCHED_TEST,
        "tests/v1/core/test_plain.py": PLAIN_TEST,
        "tests/v1/core/prefix_cache/test_hits.py": b"from vllm.v1.core.sched.async_scheduler import AsyncScheduler\n",
        "tests/v1/kv_connector/__init__.py": b"",
        "tests/v1/kv_connector/unit/__init__.py": b"",
        "tests/v1/kv_connector/unit/utils.py": b"X = 1\n",
        "tests/v1/engine/test_unrelated.py": b"",
        "vllm/__init__.py": b"",
    }
    with tarfile.open(path, "w:gz") as tar:
        for rel, data in files.items():
            info = tarfile.TarInfo(f"vllm-{version}/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_sdist_extraction_takes_core_tests_and_their_imports(tmp_path):
    sdist = _sdist(tmp_path / "vllm-0.33.0.tar.gz")
    cache = tmp_path / "cache"
    got = ut.ensure_tests(cache, "0.33.0", offline=True, sdist=sdist)
    assert got.tests_source == "vllm-0.33.0.tar.gz"
    taken = json.loads((got.root / "source.json").read_text())["files"]
    assert taken == sorted(
        [
            "tests/__init__.py",
            "tests/v1/__init__.py",
            "tests/v1/core/__init__.py",
            "tests/v1/core/utils.py",
            "tests/v1/core/test_scheduler.py",
            "tests/v1/core/test_plain.py",
            "tests/v1/core/prefix_cache/test_hits.py",
            "tests/v1/kv_connector/__init__.py",
            "tests/v1/kv_connector/unit/__init__.py",
            "tests/v1/kv_connector/unit/utils.py",
        ]
    )
    ini = (got.tree / "pytest.ini").read_text()
    assert "cpu_test: CPU" in ini and "addopts" not in ini
    assert (got.models / "facebook" / "opt-125m" / "config.json").is_file()
    # Cached now: an offline run finds it without the sdist.
    assert ut.cached(cache, "0.33.0") == got
    assert ut.ensure_tests(cache, "0.33.0", offline=True) == got
    names = [p.relative_to(got.core).as_posix() for p in ut.select_tests(got.core, None)]
    assert names == ["prefix_cache/test_hits.py", "test_scheduler.py"]
    assert len(ut.select_tests(got.core, "all")) == 3
    with pytest.raises(ut.TestsUnavailable, match="no test file"):
        ut.select_tests(got.core, ["test_missing.py"])


def test_sdist_of_another_release_is_refused(tmp_path):
    sdist = _sdist(tmp_path / "vllm-0.1.0.tar.gz", version="0.1.0")
    with pytest.raises(ut.TestsUnavailable, match="is vLLM 0.1.0"):
        ut.ensure_tests(tmp_path / "cache", "0.33.0", offline=True, sdist=sdist)


def test_pip_fetch_uses_the_tree_pip_leaves_behind(tmp_path):
    """pip fails at the metadata step but leaves the unpacked sdist under TMPDIR."""

    def fake_pip(cmd, env, **kw):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-build-isolation" in cmd
        tree = Path(env["TMPDIR"]) / "pip-download-x" / "vllm_abc"
        (tree / "tests" / "v1" / "core").mkdir(parents=True)
        (tree / "PKG-INFO").write_text("Name: vllm\nVersion: 0.33.0\n")
        (tree / "tests" / "v1" / "core" / "test_scheduler.py").write_bytes(SCHED_TEST)
        log = Path(cmd[cmd.index("--log") + 1])
        log.write_text("Found link https://files.example/p/vllm-0.33.0.tar.gz#sha256=00 (from x)\n")
        return subprocess.CompletedProcess(cmd, 1, "error: metadata-generation-failed\n")

    got = ut.ensure_tests(tmp_path, "0.33.0", offline=False, run=fake_pip)
    assert got.tests_source == "https://files.example/p/vllm-0.33.0.tar.gz"
    assert (got.core / "test_scheduler.py").read_bytes() == SCHED_TEST

    def no_network(cmd, env, **kw):
        out = "ERROR: Could not find a version that satisfies the requirement vllm==0.34.0\n"
        return subprocess.CompletedProcess(cmd, 1, out)

    with pytest.raises(ut.TestsUnavailable) as err:
        ut.ensure_tests(tmp_path, "0.34.0", offline=False, run=no_network)
    assert "\n" not in str(err.value) and "Could not find a version" in str(err.value)


# ---- the command's environment exits -------------------------------------------------------


def test_offline_with_an_empty_cache_is_one_line_and_exit_2(tmp_path, capsys):
    rc = main(
        ["upstream-tests", "--subject", "upstream", "--offline", "--cache-dir", str(tmp_path)]
    )
    out, err = capsys.readouterr()
    assert rc == 2
    assert len(err.strip().splitlines()) == 1, err
    assert "not cached" in err and "--offline" in err and "Traceback" not in err
    assert out == ""


def test_unknown_subject_is_one_line_and_exit_2(tmp_path, capsys):
    rc = main(["upstream-tests", "--subject", "no-such-runtime", "--cache-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "unknown subject" in err


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(ut.CACHE_ENV, str(tmp_path))
    assert ut.default_cache_dir() == tmp_path / "upstream-tests"
    monkeypatch.delenv(ut.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ut.default_cache_dir() == tmp_path / "xdg" / "omni-conformance" / "upstream-tests"


def test_every_option_has_help_and_a_shown_default():
    from conformance.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    p = sub.choices["upstream-tests"]  # type: ignore[attr-defined]
    text = p.format_help()
    for action in p._actions:
        if action.dest == "help":
            continue
        assert action.help, action.dest
    assert text.count("(default:") >= len(p._actions) - 1


# ---- one real run ---------------------------------------------------------------------------

REAL_FILES = ["test_scheduler.py", "test_prefix_caching.py", "test_async_scheduler.py"]


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError:
        return False
    return True


@pytest.mark.slow
def test_vllm_0_33_scheduler_tests_pass_on_omni_scheduler(tmp_path):
    from conformance._core.vllm_compat import vllm_version

    if vllm_version() != "0.33.0":
        pytest.skip(f"this run pins vLLM 0.33.0's tests; vLLM {vllm_version()} is installed")
    cache = ut.default_cache_dir()
    if ut.cached(cache, "0.33.0") is None and not _pypi_reachable():
        pytest.skip(f"vLLM 0.33.0's tests are not cached in {cache} and pypi.org is unreachable")
    out = tmp_path / "result.json"
    cmd = [
        sys.executable, "-m", "conformance.cli", "upstream-tests",
        "--subject", "omni-scheduler", "--cache-dir", str(cache), "--json", str(out), "-q",
        "--tests", *REAL_FILES,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    assert out.is_file(), proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    _check_shape(doc)
    assert doc["vllm"] == "0.33.0" and doc["subject"] == "omni-scheduler"
    assert doc["tests_source"].endswith("vllm-0.33.0.tar.gz")
    assert doc["total"] > 500
    assert "names rebound" in proc.stdout, proc.stdout
    # Every failure is one that upstream's own classes share.
    assert doc["failing"] == doc["baseline_failing"], proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
