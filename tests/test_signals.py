"""SIGINT and SIGTERM to both commands, with real processes and real signals.

Each case starts the command as a child process with a fresh ``TMPDIR``, waits until the run is
demonstrably under way (a progress line for ``omni-runtime run``, a passed test for
``omni-conformance check``), records every descendant it has meanwhile, sends the signal once,
and checks:

* the exit code is 128 + the signal's number (130, 143), and one line says it was interrupted,
  with no traceback from the command itself;
* no descendant survives it: the pipe connector's relay children, multiprocessing's resource
  tracker, the suite's pytest, its xdist workers and oracle processes;
* nothing new is left in the temporary folder (torch's inductor cache, which torch creates on
  import whatever happens, is pointed elsewhere), and no half-written WAV file;
* for ``check``: the report of the tests that finished is there, valid against the schema,
  ``"complete": false`` with status ``incomplete``, INCOMPLETE at the top of the Markdown and an
  error case in the JUnit XML.

The ``check`` cases run the suite's ``smoke`` profile on two workers, about 40 s each: slow.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from conformance._core.report import validate


def _command(name: str, module: str) -> list[str]:
    script = Path(sys.executable).parent / name
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", module]


def _env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    temp = tmp_path / "tmpdir"
    temp.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_", "OMNI_CONFORMANCE_", "VIRTUAL_ENV"))
    }
    env.update(
        HF_HUB_OFFLINE="1",
        PYTHONHASHSEED="0",
        TMPDIR=str(temp),
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache"),
    )
    return env, temp


@dataclass
class Interrupted:
    returncode: int
    output: str
    descendants: set[int] = field(default_factory=set)
    seconds_to_signal: float = 0.0


def interrupt_when(
    cmd: list[str], env: dict[str, str], cwd: Path, ready: str, sig: int, timeout: float
) -> Interrupted:
    """Run ``cmd``; once a line containing ``ready`` is printed, send ``sig`` to it (only to
    it, as a supervisor would); return its exit code, output and every descendant seen."""
    proc = subprocess.Popen(
        cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        # Descendants come and go (workers, oracle processes): sample them all along.
        while not done.is_set():
            try:
                seen.update(c.pid for c in psutil.Process(proc.pid).children(recursive=True))
            except psutil.NoSuchProcess:
                return
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    timer = threading.Timer(timeout, proc.kill)  # a hung command fails the test, not CI
    timer.start()
    start = time.monotonic()
    lines: list[str] = []
    signalled_at = 0.0
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if not signalled_at and ready in line:
                time.sleep(0.3)  # let the watcher see what is running now
                signalled_at = time.monotonic() - start
                proc.send_signal(sig)
        returncode = proc.wait()
    finally:
        timer.cancel()
        done.set()
        watcher.join()
    assert signalled_at, f"never saw {ready!r}:\n{''.join(lines)[-3000:]}"
    return Interrupted(returncode, "".join(lines), seen, signalled_at)


def assert_no_survivors(pids: set[int], grace: float = 10.0) -> None:
    """Every pid has ended (a zombie has ended: only its parent's bookkeeping remains)."""
    deadline = time.monotonic() + grace
    alive: list[str] = []
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{pid} {' '.join(p.cmdline())[:120]}")
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return
        time.sleep(0.1)
    raise AssertionError(f"descendants outlived the command: {alive}")


def assert_one_line(output: str, start: str) -> str:
    ours = [line for line in output.splitlines() if line.startswith(start)]
    assert len(ours) == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    return ours[0]


SIGNALS = [(signal.SIGINT, 130), (signal.SIGTERM, 143)]
SIGNAL_IDS = ["SIGINT", "SIGTERM"]


@pytest.mark.parametrize("sig,code", SIGNALS, ids=SIGNAL_IDS)
def test_run_interrupted_exits_cleanly(tmp_path, sig, code) -> None:
    env, temp = _env(tmp_path)
    out = tmp_path / "wav" / "out.wav"
    cmd = _command("omni-runtime", "omni_runtime.cli") + ["run", "--connector", "pipe"]
    for i in range(4):
        cmd += ["--prompt", f"interrupt me {i}"]
    cmd += ["--max-text-tokens", "30", "--max-codec-tokens", "400", "--out", str(out)]
    run = interrupt_when(cmd, env, tmp_path, "step ", sig, timeout=300)
    line = assert_one_line(run.output, "omni-runtime: interrupted")
    assert run.returncode == code, run.output[-3000:]
    assert line == f"omni-runtime: interrupted by {signal.Signals(sig).name} (exit {code})"
    # Two relay children (one per edge) and the resource tracker were running when it came.
    assert len(run.descendants) >= 2, run.descendants
    assert_no_survivors(run.descendants)
    assert list(temp.iterdir()) == []
    assert not out.parent.exists() or list(out.parent.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", SIGNALS, ids=SIGNAL_IDS)
def test_check_interrupted_writes_an_incomplete_report(tmp_path, sig, code) -> None:
    env, temp = _env(tmp_path)
    report_dir = tmp_path / "report"
    cmd = _command("omni-conformance", "conformance.cli") + [
        "check",
        "--subject",
        "omni",
        "--profile",
        "smoke",
        "-n",
        "2",
        "--report-dir",
        str(report_dir),
        "--failures-dir",
        str(tmp_path / "failures"),
    ]
    run = interrupt_when(cmd, env, tmp_path, " PASSED", sig, timeout=900)
    name = signal.Signals(sig).name
    ours = [ln for ln in run.output.splitlines() if ln.startswith("omni-conformance check: int")]
    assert ours == [
        f"omni-conformance check: interrupted by {name}; partial report marked incomplete: "
        f"{report_dir / 'compat-report.json'} (exit {code})"
    ], run.output[-3000:]
    assert run.returncode == code
    # pytest and its two xdist workers at least.
    assert len(run.descendants) >= 3, run.descendants
    assert_no_survivors(run.descendants)
    assert list(temp.iterdir()) == []

    report = json.loads((report_dir / "compat-report.json").read_text())
    validate(report)
    assert report["complete"] is False
    assert report["incomplete_reason"] == f"interrupted by {name}"
    assert report["status"] == "incomplete"
    assert report["summary"]["tests"] >= 1  # the test that passed before the signal is in it
    markdown = (report_dir / "compat-report.md").read_text()
    assert markdown.startswith("## omni-conformance: INCOMPLETE")
    assert f"INCOMPLETE: interrupted by {name}" in markdown
    junit = ET.fromstring((report_dir / "compat-report.junit.xml").read_text())
    marks = [
        error.get("message")
        for case in junit.iter("testcase")
        if case.get("name") == "run complete"
        for error in case.findall("error")
    ]
    assert marks == [f"INCOMPLETE: interrupted by {name}"]


def test_a_check_interrupted_before_pytest_wrote_anything_still_leaves_a_report(tmp_path):
    """pytest killed before its session ended (the grace ran out): the check writes an empty
    report, marked incomplete, valid against the schema."""
    from argparse import Namespace

    from conformance.cli.check import _write_incomplete

    report_json = tmp_path / "compat-report.json"
    _write_incomplete(
        Namespace(subject="omni", profile="smoke"), report_json, "interrupted by SIGTERM"
    )
    report = json.loads(report_json.read_text())
    validate(report)
    assert (report["complete"], report["status"]) == (False, "incomplete")
    assert report["summary"]["tests"] == 0
    assert "INCOMPLETE: interrupted by SIGTERM" in (tmp_path / "compat-report.md").read_text()


def test_an_interrupted_run_that_already_failed_stays_failed() -> None:
    from conformance._core.report import mark_incomplete

    marked = mark_incomplete({"status": "fail"}, "interrupted by SIGINT")
    assert marked == {
        "status": "fail",
        "complete": False,
        "incomplete_reason": "interrupted by SIGINT",
    }
