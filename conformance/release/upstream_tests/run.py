"""One run of the release's tests: a child pytest in the cached tree, with the subject's
scheduler classes swapped in (``conformance.release.upstream_swap``) or upstream's own (the
baseline), through the process-group runner (``conformance._core.processes``); its outcomes,
swap record, duration and output. Nothing may download in it: the model stand-ins are all the
tests get; vLLM's platform is whatever vLLM resolves (the same for both runs).
"""

from __future__ import annotations

import json
import os
import site
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import conformance
from conformance._core import hash_seed, processes
from conformance.release.upstream_tests.fetch import CachedTests
from conformance.release.upstream_tests.outcomes import module_paths, parse_junit

DEFAULT_TIMEOUT_S = 900.0
PLUGIN = "conformance.release.upstream_swap"


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
    env = hash_seed.pinned()
    # Nothing may download: the model stand-ins are all the tests get.
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
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
    launcher: Sequence[str] = (),
) -> list[str]:
    """The child pytest's command line; ``launcher`` replaces ``python -m`` in front of
    ``pytest`` (``omni-conformance reach`` runs it under coverage.py that way)."""
    cmd = [
        *(launcher or (sys.executable, "-m")), "pytest",
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
    launcher: Sequence[str] = (),
) -> Run:
    """One child pytest in its own process group, stopped whole past ``timeout_s``
    (``RunProblem``) or when this process gets SIGINT/SIGTERM/SIGHUP (``processes.Interrupted``)."""
    with tempfile.TemporaryDirectory(prefix=f"omni-upstream-{label}-") as tmp:
        junit, record, log = Path(tmp) / "junit.xml", Path(tmp) / "swap.json", Path(tmp) / "log"
        cmd = pytest_command(
            tests, files, junit, record, subject, workers=workers, extra=extra, launcher=launcher
        )
        start = time.monotonic()
        # The child's output (pytest's progress, vLLM's logs) is kept for the one-line reason
        # of a failed run, and shown on stdout unless quiet: this command's stderr carries only
        # its own lines.
        with open(log, "wb") as sink:

            def tee(chunk: bytes) -> None:
                sink.write(chunk)
                if not quiet:
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.flush()

            done = processes.run(
                cmd,
                cwd=tests.models,
                env=child_env(tests),
                timeout_s=timeout_s,
                on_output=tee,
                relay=True,
            )
        if done.interrupted_by is not None:
            raise processes.Interrupted(done.interrupted_by)
        if done.timed_out:
            raise RunProblem(
                f"the {label} run did not finish within {timeout_s:g} s (killed; raise --timeout-s)",
                timed_out=True,
            )
        returncode = done.returncode
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


def is_upstream(subject: Any) -> bool:
    """Whether the subject's sync and async scheduler classes are vLLM's own."""
    from conformance._core.config import HarnessConfig
    from conformance.release.upstream_swap import upstream_classes

    cfg = HarnessConfig()
    mine = (
        subject.scheduler_class(cfg.with_(async_scheduling=False)),
        subject.scheduler_class(cfg.with_(async_scheduling=True)),
    )
    return mine == upstream_classes()
