"""The installed vLLM release's own tests, taken from its source distribution and cached.

The sdist (``vllm-<version>.tar.gz``) is fetched once with pip, the registry's ordinary client
(or given with ``--sdist``), and kept under ``<cache>/vllm-<version>/``: ``tree/tests/...``
(``tests/v1/core/**``, the ``tests`` modules those files import and the package ``__init__.py``
files on the way; never vLLM's repository-root ``conftest.py``, which needs its whole test
requirements), ``tree/pytest.ini`` (the release's own pytest settings, its markers above all),
``models/<org>/<name>/`` (configuration-only stand-ins for the models the tests name, from
``conformance/assets/upstream_tests/models.json``: the tests run in ``models/``, so nothing
downloads) and ``source.json`` (release, sdist, files; written last: a cache without it is
incomplete and fetched again). The cache is ``$OMNI_CONFORMANCE_CACHE/upstream-tests`` (default
``~/.cache/omni-conformance/upstream-tests``) or ``--cache-dir``.
"""

from __future__ import annotations

import ast
import configparser
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import conformance
from conformance._core import processes

CACHE_ENV = "OMNI_CONFORMANCE_CACHE"
CORE_DIR = "tests/v1/core"
MODELS_ASSET = Path(conformance.__file__).parent / "assets" / "upstream_tests" / "models.json"
FETCH_TIMEOUT_S = 600
SOURCE_FILE = "source.json"


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


def _pip(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """pip in its own process group, bounded by ``FETCH_TIMEOUT_S``; its output (stdout and
    stderr interleaved) as text."""
    done = processes.run(cmd, env=env, capture=True, merge_stderr=True, timeout_s=FETCH_TIMEOUT_S)
    if done.timed_out:
        raise subprocess.TimeoutExpired(cmd, FETCH_TIMEOUT_S)
    return subprocess.CompletedProcess(cmd, done.returncode, done.stdout)


def pip_download(version: str, work: Path, run: Runner = _pip) -> tuple[Path, str]:
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
        proc = run(cmd, env=env)
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
    run: Runner = _pip,
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
