"""``omni-conformance upstream-tests``: vLLM's own scheduler tests, run on a subject's classes.

This module owns the whole command: fetching the test files of the installed vLLM release from
its PyPI source distribution and caching them, the local stand-ins for the Hugging Face models
those tests name, running the tests in a child pytest with the subject's scheduler classes
swapped in (``conformance.release.upstream_swap``) and once with upstream's own (the baseline), reading
the outcomes from pytest's JUnit XML, and the report (stdout, ``--json``, exit code).

The tests come from the release's sdist (``vllm-<version>.tar.gz``), fetched once with pip, the
registry's ordinary client, and kept under ``<cache>/vllm-<version>/``:

* ``tree/tests/...``: ``tests/v1/core/**`` plus the ``tests`` modules those files import, and
  the package ``__init__.py`` files on the way (vLLM's repository-root ``conftest.py`` is not
  taken: it needs vLLM's whole test requirements); ``tree/pytest.ini`` carries the release's
  own pytest settings (its markers);
* ``models/<org>/<name>/``: configuration-only stand-ins for the models the tests name
  (``conformance/assets/upstream_tests/models.json``); the child pytest runs in ``models/``,
  so ``ModelConfig(model="facebook/opt-125m")`` finds a local folder and nothing downloads;
* ``source.json``: the release, the sdist it came from, the files taken (written last: a cache
  without it is incomplete and is fetched again).

The cache is ``$OMNI_CONFORMANCE_CACHE/upstream-tests`` (default
``~/.cache/omni-conformance/upstream-tests``) or ``--cache-dir``; ``--sdist`` fills it from a
file instead. The child pytest gets vLLM's platform as vLLM resolves it (on a CPU-only host, an
installed platform plugin such as this repository's ``omni_cpu``): the same for both runs.

``--json`` writes ``vllm``, ``subject``, the subject run's ``passed``/``failed``/``skipped``/
``errors``/``total``, ``failing`` (its failed and errored node ids), ``baseline_failing`` (those
of them that fail with upstream's classes too), ``duration_s`` (the subject run's wall time)
and ``tests_source`` (the sdist's URL or file name), and nothing else: other tools read it.

Once cached, a run needs no network. Exit codes: 0 when every test that passes with upstream's
classes passes with the subject's (with ``--no-baseline``: when every test passes); 1 otherwise;
2 with one line on stderr for environment problems (vLLM missing or unsupported, unknown
subject, the tests neither cached nor fetchable, a baseline that cannot run).
"""

from __future__ import annotations

import argparse
import ast
import configparser
import io
import json
import os
import re
import shutil
import signal
import site
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import tomllib
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import conformance

CACHE_ENV = "OMNI_CONFORMANCE_CACHE"
CORE_DIR = "tests/v1/core"
MODELS_ASSET = Path(conformance.__file__).parent / "assets" / "upstream_tests" / "models.json"
DEFAULT_TIMEOUT_S = 900.0
FETCH_TIMEOUT_S = 600
SOURCE_FILE = "source.json"
PLUGIN = "conformance.release.upstream_swap"
# Helpers through which a test module builds a scheduler; importing one (or vLLM's scheduler
# classes themselves) is what makes a module one of "the scheduler tests".
SCHEDULER_NAMES = frozenset({"Scheduler", "AsyncScheduler"})
SCHEDULER_MODULES = ("vllm.v1.core.sched.scheduler", "vllm.v1.core.sched.async_scheduler")
BUILDER_PREFIX = "create_scheduler"
# Scheduler tests left out of the default selection for their cost alone: 0.33.0's randomized
# priority "blast" runs 20,000 steps per parameter set (12 sets, minutes each on a small CPU).
SLOW_MODULES = frozenset({"test_priority_scheduler_random.py"})
SCHEDULER_SELECTION = "scheduler"
# Outcome names, in the order the report counts them.
OUTCOMES = ("passed", "failed", "skipped", "errors")
_SEVERITY = {"passed": 0, "skipped": 1, "errors": 2, "failed": 3}


class TestsUnavailable(RuntimeError):
    """The release's tests are not cached and cannot be fetched (one-line message)."""


# ---- where things live --------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$OMNI_CONFORMANCE_CACHE/upstream-tests``, else ``$XDG_CACHE_HOME`` or ``~/.cache``."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root).expanduser() / "upstream-tests"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "omni-conformance" / "upstream-tests"


def release_dir(cache_dir: Path, version: str) -> Path:
    return cache_dir / f"vllm-{version}"


@dataclass(frozen=True)
class CachedTests:
    """A complete cache entry for one release."""

    root: Path
    version: str
    tests_source: str

    @property
    def tree(self) -> Path:
        return self.root / "tree"

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def core(self) -> Path:
        return self.tree / CORE_DIR


def cached(cache_dir: Path, version: str) -> CachedTests | None:
    root = release_dir(cache_dir, version)
    try:
        meta = json.loads((root / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    if meta.get("vllm") != version or not (root / "tree" / CORE_DIR).is_dir():
        return None
    return CachedTests(root, version, str(meta.get("tests_source", "")))


# ---- taking the tests out of a source tree ------------------------------------------------


def _module_file(files: Mapping[str, bytes], dotted: str) -> str | None:
    base = dotted.replace(".", "/")
    for candidate in (f"{base}.py", f"{base}/__init__.py"):
        if candidate in files:
            return candidate
    return None


def _package_of(path: str) -> str:
    parts = path[: -len(".py")].split("/")
    return ".".join(parts[:-1])


def _imported_modules(path: str, source: bytes) -> set[str]:
    """Every ``tests.*`` module name ``path`` may import (absolute and relative, any depth)."""
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError:
        return set()
    package = _package_of(path)
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            out.add(base)
            # ``from pkg import name`` may name a submodule.
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in out if name == "tests" or name.startswith("tests.")}


def select_files(files: Mapping[str, bytes]) -> dict[str, bytes]:
    """``tests/v1/core/**`` plus the ``tests`` modules it imports, transitively, with the
    ``__init__.py`` of every package on the way. ``files`` maps paths relative to the source
    root (``tests/...``) to their bytes; vLLM's repository-root conftest is never taken."""
    chosen: dict[str, bytes] = {}
    todo = [p for p in files if p.startswith(CORE_DIR + "/")]
    while todo:
        path = todo.pop()
        if path in chosen:
            continue
        chosen[path] = files[path]
        if not path.endswith(".py"):
            continue
        parts = path.split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            init = "/".join(parts[:depth]) + "/__init__.py"
            if init in files and init not in chosen:
                todo.append(init)
        for name in _imported_modules(path, files[path]):
            found = _module_file(files, name)
            if found is not None and found not in chosen:
                todo.append(found)
    chosen.pop("tests/conftest.py", None)
    return chosen


def _pytest_ini(pyproject: bytes | None) -> str:
    """The release's own ``[tool.pytest.ini_options]`` as a ``pytest.ini`` (markers above all:
    without them every marked test warns)."""
    options: dict[str, Any] = {}
    if pyproject:
        try:
            options = tomllib.loads(pyproject.decode()).get("tool", {}).get("pytest", {})
            options = dict(options.get("ini_options", {}))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError):
            options = {}
    # Only settings that describe the tests; where to look and what to add is this command's.
    for key in ("addopts", "testpaths", "norecursedirs", "python_files", "minversion"):
        options.pop(key, None)
    ini = configparser.ConfigParser(interpolation=None)
    ini["pytest"] = {}
    for key, value in options.items():
        if isinstance(value, list):
            ini["pytest"][key] = "\n" + "\n".join(str(v) for v in value)
        elif isinstance(value, bool):
            ini["pytest"][key] = "true" if value else "false"
        else:
            ini["pytest"][key] = str(value)
    buf = io.StringIO()
    buf.write("# Generated by omni-conformance upstream-tests from the release's pyproject.toml.\n")
    ini.write(buf)
    return buf.getvalue()


def _sdist_files(sdist: Path) -> tuple[dict[str, bytes], bytes | None, str | None]:
    """(``tests/**`` files, ``pyproject.toml``, ``Version``) from an sdist archive."""
    files: dict[str, bytes] = {}
    pyproject: bytes | None = None
    version: str | None = None
    with tarfile.open(sdist, "r:*") as tar:
        for member in tar:
            if not member.isfile():
                continue
            top, _, rel = member.name.partition("/")
            if not top or not rel:
                continue
            if rel.startswith("tests/") or rel in ("pyproject.toml", "PKG-INFO"):
                handle = tar.extractfile(member)
                if handle is None:
                    continue
                data = handle.read()
                if rel == "pyproject.toml":
                    pyproject = data
                elif rel == "PKG-INFO":
                    version = _pkg_info_version(data)
                else:
                    files[rel] = data
    return files, pyproject, version


def _tree_files(root: Path) -> tuple[dict[str, bytes], bytes | None, str | None]:
    """The same from an unpacked source tree."""
    files = {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in (root / "tests").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    pyproject = (
        (root / "pyproject.toml").read_bytes() if (root / "pyproject.toml").is_file() else None
    )
    pkg_info = root / "PKG-INFO"
    version = _pkg_info_version(pkg_info.read_bytes()) if pkg_info.is_file() else None
    return files, pyproject, version


def _pkg_info_version(data: bytes) -> str | None:
    match = re.search(rb"^Version:\s*(\S+)", data, re.MULTILINE)
    return match.group(1).decode() if match else None


def write_cache(
    cache_dir: Path,
    version: str,
    files: Mapping[str, bytes],
    pyproject: bytes | None,
    tests_source: str,
) -> CachedTests:
    """Write a complete cache entry atomically (a sibling folder renamed into place)."""
    chosen = select_files(files)
    if not any(p.startswith(CORE_DIR + "/") and p.endswith(".py") for p in chosen):
        raise TestsUnavailable(f"{tests_source} has no {CORE_DIR}/ test files")
    final = release_dir(cache_dir, version)
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".vllm-{version}-", dir=cache_dir))
    try:
        for rel, data in chosen.items():
            dest = staging / "tree" / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
        (staging / "tree" / "pytest.ini").write_text(_pytest_ini(pyproject))
        meta = {"vllm": version, "tests_source": tests_source, "files": sorted(chosen)}
        (staging / SOURCE_FILE).write_text(json.dumps(meta, indent=1) + "\n")
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    write_models(final / "models")
    return CachedTests(final, version, tests_source)


def write_models(dest: Path, asset: Path = MODELS_ASSET) -> list[str]:
    """Materialize the model stand-ins (idempotent: rewritten on every run, they are tiny)."""
    models = json.loads(asset.read_text())
    written = []
    for name, model_files in models.items():
        if name.startswith("_"):
            continue
        for filename, content in model_files.items():
            path = dest / name / filename
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(content, indent=1) + "\n")
        written.append(name)
    return written


# ---- fetching ----------------------------------------------------------------------------

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


def pip_download(version: str, work: Path, run: Runner = subprocess.run) -> tuple[Path, str]:
    """Fetch ``vllm==version``'s sdist with pip; returns (archive or unpacked tree, its URL or
    file name).

    pip has no "download the file only" mode for an sdist: it prepares the package's metadata,
    which for vLLM needs its build requirements and fails. Without build isolation (so pip never
    installs vLLM's build requirements) the failure is quick, and ``--no-clean`` leaves the
    unpacked tree in pip's temporary folder, which ``TMPDIR`` points into ``work``. Where the
    metadata step does succeed, the archive itself is in the download folder.
    """
    downloads = work / "download"
    scratch = work / "tmp"
    log = work / "pip.log"
    downloads.mkdir(parents=True, exist_ok=True)
    scratch.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", f"vllm=={version}",
        "--no-deps", "--no-binary", ":all:", "--no-build-isolation", "--no-clean",
        "--progress-bar", "off", "--quiet", "--log", str(log), "-d", str(downloads),
        # Offline, pip's configured retries and timeouts would wait for many minutes.
        "--timeout", "30", "--retries", "2",
    ]  # fmt: skip
    env = dict(os.environ, TMPDIR=str(scratch), PIP_NO_INPUT="1")
    try:
        proc = run(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=FETCH_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise TestsUnavailable(
            f"pip did not fetch vllm=={version}'s source distribution within {FETCH_TIMEOUT_S} s"
        ) from None
    source = _source_url(log, version)
    archive = downloads / f"vllm-{version}.tar.gz"
    if archive.is_file():
        return archive, source
    for pkg_info in sorted(scratch.glob("*/*/PKG-INFO")):
        if _pkg_info_version(pkg_info.read_bytes()) == version:
            return pkg_info.parent, source
    lines = [ln.strip() for ln in (proc.stdout or "").splitlines() if ln.strip()]
    reason = next(
        (ln for ln in lines if "ERROR" in ln or "error" in ln.lower()), lines[-1] if lines else ""
    )
    raise TestsUnavailable(
        f"cannot fetch vllm=={version}'s source distribution with pip"
        + (f" ({reason})" if reason else "")
    )


def _source_url(log: Path, version: str) -> str:
    name = f"vllm-{version}.tar.gz"
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return name
    match = re.search(r"https?://[^\s\"'#]+/" + re.escape(name), text)
    return match.group(0) if match else name


def ensure_tests(
    cache_dir: Path,
    version: str,
    *,
    offline: bool,
    sdist: Path | None = None,
    run: Runner = subprocess.run,
) -> CachedTests:
    """The cached tests of ``version``, fetching them first when needed and allowed."""
    if sdist is None:
        hit = cached(cache_dir, version)
        if hit is not None:
            write_models(hit.models)
            return hit
    if sdist is not None:
        if not sdist.exists():
            raise TestsUnavailable(f"--sdist {sdist} does not exist")
        files, pyproject, found = _tree_files(sdist) if sdist.is_dir() else _sdist_files(sdist)
        if found is not None and found != version:
            raise TestsUnavailable(
                f"--sdist {sdist} is vLLM {found}, but vLLM {version} is installed"
            )
        return write_cache(cache_dir, version, files, pyproject, sdist.name)
    if offline:
        raise TestsUnavailable(
            f"vLLM {version}'s tests are not cached in {release_dir(cache_dir, version)} and "
            "--offline forbids fetching them (run once online, or pass --sdist FILE)"
        )
    with tempfile.TemporaryDirectory(prefix="omni-upstream-fetch-") as tmp:
        where, source = pip_download(version, Path(tmp), run=run)
        files, pyproject, found = _tree_files(where) if where.is_dir() else _sdist_files(where)
        if found is not None and found != version:
            raise TestsUnavailable(f"pip fetched vLLM {found}, not {version}")
        return write_cache(cache_dir, version, files, pyproject, source)


# ---- which tests ---------------------------------------------------------------------------


def builds_scheduler(source: bytes) -> bool:
    """Whether a test module imports vLLM's scheduler classes or a ``create_scheduler*``
    helper: the tests a swap can change (the rest run identically on every subject)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name.startswith(BUILDER_PREFIX):
                    return True
                if node.module in SCHEDULER_MODULES and alias.name in SCHEDULER_NAMES:
                    return True
    return False


def select_tests(
    core: Path, requested: str | Iterable[str] | None, *, include_slow: bool = False
) -> list[Path]:
    """The test files to run: the scheduler tests (``"scheduler"`` or nothing; without
    ``SLOW_MODULES`` unless ``include_slow``), ``"all"``, or files relative to ``tests/v1/core``."""
    everything = sorted(p for p in core.rglob("test_*.py") if "__pycache__" not in p.parts)
    wanted = [requested] if isinstance(requested, str) else list(requested or ())
    if not wanted or wanted == [SCHEDULER_SELECTION]:
        return [
            p
            for p in everything
            if builds_scheduler(p.read_bytes()) and (include_slow or p.name not in SLOW_MODULES)
        ]
    if wanted == ["all"]:
        return everything
    out = []
    for name in wanted:
        path = core / name
        if not path.exists():
            known = ", ".join(p.relative_to(core).as_posix() for p in everything)
            raise TestsUnavailable(f"no test file {name!r} in {CORE_DIR}; known: {known}")
        out.append(path)
    return out


# ---- outcomes -----------------------------------------------------------------------------


def module_paths(tree: Path) -> dict[str, str]:
    """Dotted module name (as JUnit's ``classname`` spells it) -> path relative to ``tree``."""
    out = {}
    for path in tree.rglob("*.py"):
        rel = path.relative_to(tree).as_posix()
        out[rel[: -len(".py")].replace("/", ".")] = rel
    return out


def nodeid_of(classname: str, name: str, modules: Mapping[str, str]) -> str:
    """pytest's node id from a JUnit testcase (pytest writes ``classname`` as the module's
    dotted path, then any classes; a collection error has an empty ``classname`` and the
    module's dotted path as ``name``)."""
    if not classname:
        return modules.get(name, name.replace(".", "/") + ".py")
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if module in modules:
            return "::".join([modules[module], *parts[cut:], name])
    return "::".join([classname.replace(".", "/") + ".py", name])


def parse_junit(xml_text: str, modules: Mapping[str, str]) -> dict[str, str]:
    """node id -> outcome (``passed``/``failed``/``skipped``/``errors``) from pytest's JUnit XML.

    A testcase with a ``failure`` failed; one with only an ``error`` (collection, setup or
    teardown) is an error; ``skipped`` (skips and xfails) is skipped; the rest passed.
    """
    root = ET.fromstring(xml_text)
    out: dict[str, str] = {}
    for case in root.iter("testcase"):
        nodeid = nodeid_of(case.get("classname", ""), case.get("name", ""), modules)
        tags = {child.tag for child in case}
        if "failure" in tags:
            outcome = "failed"
        elif "error" in tags:
            outcome = "errors"
        elif "skipped" in tags:
            outcome = "skipped"
        else:
            outcome = "passed"
        # A node reported twice (e.g. by two xdist workers) keeps its worst outcome.
        previous = out.get(nodeid)
        if previous is None or _SEVERITY[outcome] > _SEVERITY[previous]:
            out[nodeid] = outcome
    return out


def counts(outcomes: Mapping[str, str]) -> dict[str, int]:
    c = {o: 0 for o in OUTCOMES}
    for outcome in outcomes.values():
        c[outcome] += 1
    c["total"] = len(outcomes)
    return c


def not_passing(outcomes: Mapping[str, str]) -> list[str]:
    return sorted(n for n, o in outcomes.items() if o in ("failed", "errors"))


@dataclass
class Verdict:
    """The comparison of a subject's outcomes with the baseline's."""

    failing: list[str]
    baseline_failing: list[str]
    # Passed with upstream's classes, did not pass with the subject's (failed, error, skipped
    # or missing): the subject's own findings.
    regressions: list[str] = field(default_factory=list)


def compare(subject: Mapping[str, str], baseline: Mapping[str, str] | None) -> Verdict:
    failing = not_passing(subject)
    if baseline is None:
        return Verdict(failing, [], failing)
    baseline_failing = [n for n in failing if baseline.get(n) in ("failed", "errors")]
    regressions = sorted(
        n for n, o in baseline.items() if o == "passed" and subject.get(n) != "passed"
    )
    return Verdict(failing, baseline_failing, regressions)


def result_json(
    version: str,
    subject: str,
    outcomes: Mapping[str, str],
    verdict: Verdict,
    duration_s: float,
    tests_source: str,
) -> dict[str, Any]:
    """The ``--json`` document; its shape is a contract with the compatibility matrix."""
    c = counts(outcomes)
    return {
        "vllm": version,
        "subject": subject,
        "passed": c["passed"],
        "failed": c["failed"],
        "skipped": c["skipped"],
        "errors": c["errors"],
        "total": c["total"],
        "failing": list(verdict.failing),
        "baseline_failing": list(verdict.baseline_failing),
        "duration_s": round(float(duration_s), 3),
        "tests_source": tests_source,
    }


# ---- running -------------------------------------------------------------------------------


@dataclass
class Run:
    label: str
    outcomes: dict[str, str]
    duration_s: float
    returncode: int
    record: dict[str, Any]
    log: str


class RunProblem(RuntimeError):
    """A child pytest that produced no outcomes (one-line message)."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def _python_path(tests: CachedTests) -> str:
    """The release's tree first (its ``tests`` package must win over any other ``tests`` on the
    path, e.g. a project's own folder), then this package when it is not installed into
    site-packages (an editable checkout), then where the command was started (``module:attr``
    subjects), then what was there already."""
    entries = [str(tests.tree)]
    home = str(Path(conformance.__file__).resolve().parent.parent)
    site_dirs = {
        str(Path(p).resolve()) for p in [*site.getsitepackages(), site.getusersitepackages()]
    }
    if home not in site_dirs:
        entries.append(home)
    entries.append(os.getcwd())
    if os.environ.get("PYTHONPATH"):
        entries.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(entries)


def child_env(tests: CachedTests) -> dict[str, str]:
    env = dict(os.environ)
    # Nothing may download: the model stand-ins are all the tests get.
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    env.setdefault("PYTHONHASHSEED", "0")
    # Two cores shared with others: one torch thread per process.
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = _python_path(tests)
    return env


def pytest_command(
    tests: CachedTests,
    files: list[Path],
    junit: Path,
    record: Path,
    subject: str | None,
    *,
    workers: int = 1,
    extra: Iterable[str] = (),
) -> list[str]:
    cmd = [
        sys.executable, "-m", "pytest",
        "-c", str(tests.tree / "pytest.ini"), "--rootdir", str(tests.tree),
        # vLLM's repository-root conftest needs vLLM's test requirements; it is not extracted,
        # and nothing above the tests' own folder may contribute one either.
        "--confcutdir", str(tests.core),
        "-o", "addopts=", "-p", "no:cacheprovider",
        # This project's gate plugin has its own options and fixtures: none of them apply here.
        "-p", "no:omni_conformance", "-p", PLUGIN,
        "--junitxml", str(junit), "-o", "junit_family=xunit2",
        "--upstream-swap-record", str(record),
        "-q", "-p", "no:warnings", "--tb=line", "-rN",
    ]  # fmt: skip
    if subject is not None:
        cmd += ["--upstream-swap-subject", subject]
    if workers > 1:
        cmd += ["-n", str(workers)]
    cmd += list(extra)
    cmd += [str(f) for f in files]
    return cmd


def _tee(proc: subprocess.Popen[bytes], log: Path, quiet: bool) -> None:
    stream = proc.stdout
    assert stream is not None
    with open(log, "wb") as sink:
        while chunk := os.read(stream.fileno(), 65536):
            sink.write(chunk)
            if not quiet:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_pytest(
    label: str,
    tests: CachedTests,
    files: list[Path],
    subject: str | None,
    *,
    timeout_s: float,
    workers: int = 1,
    quiet: bool = False,
    extra: Iterable[str] = (),
) -> Run:
    """One child pytest in its own process group (killed whole on timeout or interrupt)."""
    with tempfile.TemporaryDirectory(prefix=f"omni-upstream-{label}-") as tmp:
        junit, record, log = Path(tmp) / "junit.xml", Path(tmp) / "swap.json", Path(tmp) / "log"
        cmd = pytest_command(tests, files, junit, record, subject, workers=workers, extra=extra)
        start = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            cwd=tests.models,
            env=child_env(tests),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        # The child's output (pytest's progress, vLLM's logs) is kept for the one-line reason
        # of a failed run, and shown on stdout unless quiet: this command's stderr carries only
        # its own lines.
        pump = threading.Thread(target=_tee, args=(proc, log, quiet), daemon=True)
        pump.start()
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise RunProblem(
                f"the {label} run did not finish within {timeout_s:g} s (killed; raise --timeout-s)",
                timed_out=True,
            ) from None
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            pump.join(timeout=10)
        # Whatever the tests started and left behind goes with the run.
        _kill_group(proc)
        duration = time.monotonic() - start
        text = log.read_text(errors="replace")
        if not junit.is_file():
            tail = [ln for ln in text.splitlines() if ln.strip()]
            why = tail[-1].strip() if tail else f"pytest exited with {returncode}"
            raise RunProblem(f"the {label} run produced no results: {why}")
        outcomes = parse_junit(junit.read_text(), module_paths(tests.tree))
        if not outcomes and returncode not in (0, 5):
            tail = [ln for ln in text.splitlines() if ln.strip()]
            why = tail[-1].strip() if tail else f"pytest exited with {returncode}"
            raise RunProblem(f"the {label} run produced no results: {why}")
        swap = json.loads(record.read_text()) if record.is_file() else {}
        return Run(label, outcomes, duration, returncode, swap, text)


# ---- the command ---------------------------------------------------------------------------


def add_subparser(sub: Any) -> argparse.ArgumentParser:
    """Register ``upstream-tests`` on ``omni-conformance``'s subparsers."""
    p = sub.add_parser(
        "upstream-tests",
        help="run the installed vLLM release's own scheduler tests on a subject's classes",
        description="Run the installed vLLM release's own scheduler tests (tests/v1/core of its "
        "sdist) with the subject's scheduler classes in place of vLLM's, and with upstream's "
        "own as the baseline.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--subject",
        default=os.environ.get("OMNI_CONFORMANCE_SUBJECT", "omni"),
        help="subject whose scheduler classes replace vLLM's (a name or module:attr)",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=default_cache_dir(),
        help=f"where release tests are cached (vllm-<version>/ inside; ${CACHE_ENV} moves the "
        "whole omni-conformance cache)",
    )
    p.add_argument(
        "--offline",
        action="store_true",
        default=bool(os.environ.get("OMNI_CONFORMANCE_OFFLINE")),
        help="never fetch: use the cache only (exit 2 when the release's tests are not there)",
    )
    p.add_argument(
        "--sdist",
        type=Path,
        default=None,
        help="take the tests from this vLLM sdist (.tar.gz) or unpacked source tree instead of "
        "fetching it (refreshes the cache)",
    )
    p.add_argument(
        "--tests",
        nargs="+",
        default=SCHEDULER_SELECTION,
        metavar="FILE",
        help=f"'{SCHEDULER_SELECTION}': the test modules that build a scheduler (they import "
        "vLLM's Scheduler/AsyncScheduler or a create_scheduler helper); 'all': all of "
        "tests/v1/core; or test files relative to tests/v1/core",
    )
    p.add_argument(
        "--include-slow",
        action="store_true",
        help=f"with the default selection, also run {', '.join(sorted(SLOW_MODULES))}",
    )
    p.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the run with upstream's own classes (every failure then counts)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the result here as JSON")
    p.add_argument(
        "--timeout-s",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="time bound for each pytest run; its process group is killed past it",
    )
    p.add_argument(
        "-n", "--workers", type=int, default=1, help="pytest-xdist workers per run (2 cores)"
    )
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="hide the child pytest's progress (only the summary is printed)",
    )
    p.add_argument(
        "-k",
        dest="keyword",
        default=None,
        help="only tests matching this pytest -k expression (both runs)",
    )
    p.set_defaults(func=cmd_upstream_tests)
    return p


def _print_summary(
    version: str, subject: str, run: Run, baseline: Run | None, verdict: Verdict, tests: CachedTests
) -> None:
    def line(r: Run) -> str:
        c = counts(r.outcomes)
        return (
            f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped, "
            f"{c['errors']} errors, {c['total']} total in {r.duration_s:.1f} s"
        )

    print(f"vLLM {version} scheduler tests ({tests.tests_source})")
    if run.record.get("rebound"):
        print(
            f"  swapped in: {run.record.get('sync')} / {run.record.get('async')} "
            f"({len(run.record['rebound'])} names rebound)"
        )
    print(f"  subject {subject}: {line(run)}")
    if baseline is not None:
        print(f"  upstream's own classes: {line(baseline)}")
    base = set(verdict.baseline_failing)
    if verdict.failing:
        print(f"failing with {subject} ({len(verdict.failing)}):")
        for nodeid in verdict.failing:
            note = "  [also fails with upstream's classes]" if nodeid in base else ""
            print(f"  {nodeid}{note}")
    # Passed with upstream's classes, merely skipped or absent with the subject's.
    for nodeid in sorted(set(verdict.regressions) - set(verdict.failing)):
        print(f"  {nodeid}  [{run.outcomes.get(nodeid, 'not run')}; passes with upstream's]")
    if verdict.regressions:
        print(
            f"FAIL: {len(verdict.regressions)} test(s) that pass with upstream's classes do not "
            f"pass with {subject}'s"
        )
    else:
        print(f"OK: every test that passes with upstream's classes passes with {subject}'s")


def cmd_upstream_tests(args: argparse.Namespace) -> int:
    from conformance._core.preflight import (
        check_environment,
        fail_environment,
        load_subject_quietly,
    )
    from conformance._core.vllm_compat import EnvironmentProblem, check_vllm

    problem = check_environment(args.subject)
    if problem is not None:
        return fail_environment(problem)
    try:
        version = check_vllm()
    except EnvironmentProblem as exc:  # pragma: no cover - check_environment said it is fine
        return fail_environment(str(exc))
    try:
        tests = ensure_tests(
            Path(args.cache_dir).expanduser(),
            version,
            offline=args.offline,
            sdist=Path(args.sdist).expanduser() if args.sdist else None,
        )
        files = select_tests(tests.core, args.tests, include_slow=args.include_slow)
    except (TestsUnavailable, OSError, tarfile.TarError) as exc:
        return fail_environment(" ".join(str(exc).split()))
    if not files:
        return fail_environment(f"no scheduler test files in {tests.core}")
    # Loaded here once for its one-line problems (the child loads it again to swap it in).
    subject, problem = load_subject_quietly(args.subject)
    if problem is not None:
        return fail_environment(problem)
    name = str(subject.name)
    extra = ["-k", args.keyword] if args.keyword else []
    common = {"timeout_s": args.timeout_s, "workers": args.workers, "quiet": args.quiet}
    # A subject whose classes are upstream's own (``upstream``) is its own baseline: one run.
    own = _is_upstream(subject)

    baseline: Run | None = None
    try:
        if not args.no_baseline or own:
            baseline = run_pytest("baseline", tests, files, None, extra=extra, **common)
            if not any(o == "passed" for o in baseline.outcomes.values()):
                return fail_environment(
                    f"no test passes with upstream's own classes here ({counts(baseline.outcomes)})"
                    "; the environment cannot run vLLM's tests"
                )
        if own and baseline is not None:
            run = baseline
            if args.no_baseline:
                baseline = None
        else:
            run = run_pytest("subject", tests, files, args.subject, extra=extra, **common)
    except RunProblem as exc:
        if exc.timed_out and baseline is not None:
            # Upstream finished; the subject did not: that is the subject's finding.
            print(f"omni-conformance: {exc}", file=sys.stderr)
            return 1
        return fail_environment(str(exc))
    if not own and not run.record.get("rebound"):
        return fail_environment(
            f"the swap reached no test module (subject {args.subject!r}): nothing was checked"
        )
    verdict = compare(run.outcomes, baseline.outcomes if baseline else None)
    _print_summary(version, name, run, baseline, verdict, tests)
    if args.json:
        doc = result_json(version, name, run.outcomes, verdict, run.duration_s, tests.tests_source)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if not verdict.regressions else 1


def _is_upstream(subject: Any) -> bool:
    """Whether the subject's sync and async scheduler classes are vLLM's own."""
    from conformance._core.config import HarnessConfig
    from conformance.release.upstream_swap import upstream_classes

    cfg = HarnessConfig()
    mine = (
        subject.scheduler_class(cfg.with_(async_scheduling=False)),
        subject.scheduler_class(cfg.with_(async_scheduling=True)),
    )
    return mine == upstream_classes()
