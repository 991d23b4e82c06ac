"""Process-wide pins for the test run (offline hub, V1 runner flavour, one torch thread, our CPU
platform), and the ``run_check`` fixture: ``omni-conformance check`` in a subprocess, the one way
the tests that run the gate end to end call it (``run_check(tmp_path, subject, ...)`` returns a
``CheckRun``).

Thread pinning lives here and in the other conftest files only: with two xdist workers on two
cores, more than one torch thread each oversubscribes the machine and makes tiny ops ~100x
slower. Child processes inherit ``OMP_NUM_THREADS`` from this environment.
"""

import importlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

from conformance._core import pristine  # noqa: E402
from omni_runtime.platform import install_for_process  # noqa: E402

install_for_process()

ROOT = Path(__file__).resolve().parents[1]
CHECK_TIMEOUT = 1800


def gate_command() -> list[str]:
    """The installed console script when there is one (an absolute path: it runs with an empty
    ``PATH`` and no activated environment), else the module."""
    script = Path(sys.executable).parent / "omni-conformance"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "conformance.cli"]


def check_env(tmp_path: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without the outer pytest's, a developer's gate settings or an activated
    environment; modules planted in ``tmp_path`` and this checkout (``tests.mutants``) import."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_", "OMNI_CONFORMANCE_", "VIRTUAL_ENV"))
    }
    env["HF_HUB_OFFLINE"] = "1"
    env["PYTHONHASHSEED"] = "0"
    paths = [str(tmp_path), str(ROOT)]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(extra or {})
    return env


@dataclass
class CheckRun:
    """What one ``omni-conformance check`` run did: exit code, output, and its compat report."""

    returncode: int
    stdout: str
    stderr: str
    report: dict[str, Any] | None
    report_dir: Path
    failures_dir: Path
    seconds: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def tail(self, n: int = 4000) -> str:
        return self.output[-n:]

    def records(self) -> list[dict[str, Any]]:
        assert self.report is not None, f"no compat report written:\n{self.tail()}"
        return list(self.report["tests"])


def run_gate_check(
    tmp_path: Path,
    subject: str,
    *,
    workers: int = 1,
    profile: str = "ci",
    tests: tuple[str, ...] = (),
    pytest_args: tuple[str, ...] = (),
    extra_env: dict[str, str] | None = None,
    quiet: bool = False,
) -> CheckRun:
    """``omni-conformance check --subject SUBJECT`` from ``tmp_path``, its report and failure
    traces under ``tmp_path``: ``tests`` (none: the installed suite), ``pytest_args`` after
    ``--``, in ``check_env(tmp_path, extra_env)``."""
    report_dir = tmp_path / "compat-report"
    failures_dir = tmp_path / "failures"
    cmd = [*gate_command(), "check", "--subject", subject, "--profile", profile]
    cmd += ["-n", str(workers), "--report-dir", str(report_dir)]
    cmd += ["--failures-dir", str(failures_dir)]
    cmd += ["-q"] if quiet else []
    cmd += ["--tests", *tests] if tests else []
    cmd += ["--", *pytest_args] if pytest_args else []
    start = time.monotonic()
    proc = subprocess.run(
        cmd,
        cwd=tmp_path,
        env=check_env(tmp_path, extra_env),
        capture_output=True,
        text=True,
        timeout=CHECK_TIMEOUT,
    )
    report_json = report_dir / "compat-report.json"
    report = json.loads(report_json.read_text()) if report_json.is_file() else None
    return CheckRun(
        proc.returncode,
        proc.stdout,
        proc.stderr,
        report,
        report_dir,
        failures_dir,
        time.monotonic() - start,
    )


@pytest.fixture
def run_check() -> Callable[..., CheckRun]:
    """``run_check(tmp_path, subject, *, workers=1, profile="ci", tests=(), pytest_args=(),
    extra_env=None, quiet=False) -> CheckRun`` (see ``run_gate_check``)."""
    return run_gate_check


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """``plant(source) -> "module:subject"``: a subject module in tmp_path, importable; vLLM's
    classes and module bindings are put back afterwards whatever the module changed."""
    before = pristine.fingerprint()
    names: list[str] = []
    monkeypatch.syspath_prepend(str(tmp_path))

    def plant(source: str) -> str:
        name = f"planted_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(source)
        importlib.invalidate_caches()
        names.append(name)
        return f"{name}:subject"

    try:
        yield plant
    finally:
        for name in names:
            sys.modules.pop(name, None)
        for cls, _bases, members in before.classes.values():
            for key in [k for k in vars(cls) if k not in members]:
                delattr(cls, key)
            for key, value in members.items():
                if vars(cls).get(key) is not value:
                    setattr(cls, key, value)
        for mod_name, mod in before.modules.items():
            for key, value in before.bindings[mod_name].items():
                if vars(mod).get(key) is not value:
                    setattr(mod, key, value)
        assert pristine.changes_since(before) == []
        # vLLM is exactly as before, so what loading the plant recorded no longer holds.
        pristine.reset_placement()
