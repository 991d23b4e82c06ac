"""The one process-group runner (``conformance._core.processes``), with real processes and real
signals: a timeout takes the grandchildren with it, a child that ignores SIGTERM is killed after
the grace, a signal this process gets reaches the child's group, the exit status and output come
back, and nothing of a group outlives its leader.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from conformance._core import processes


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")  # a zombie awaiting its (re)parent is dead too


def _wait_gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _gone(pid)


def _pid_in(path: Path, within: float = 10.0) -> int:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        text = path.read_text().strip() if path.exists() else ""
        if text:
            return int(text)
        time.sleep(0.02)
    raise AssertionError(f"{path} never got a pid")


@pytest.fixture
def short_grace(monkeypatch):
    monkeypatch.setattr(processes, "GRACE_S", 1.0)


def test_exit_status_and_separate_output_are_returned():
    done = processes.run(["sh", "-c", "echo out; echo err >&2; exit 3"], capture=True)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
    assert not done.timed_out and done.interrupted_by is None


def test_merged_streamed_and_file_output():
    merged = processes.run(["sh", "-c", "echo a; echo b >&2"], capture=True, merge_stderr=True)
    assert merged.stdout == "a\nb\n" and merged.stderr == ""
    chunks: list[bytes] = []
    streamed = processes.run(["sh", "-c", "echo c; echo d >&2; exit 4"], on_output=chunks.append)
    assert streamed.returncode == 4 and b"".join(chunks) == b"c\nd\n"
    sink = io.BytesIO()
    with pytest.raises(ValueError, match="choose one"):
        processes.run(["true"], capture=True, on_output=sink.write)


def test_a_timed_out_child_takes_its_grandchild_with_it(tmp_path, short_grace):
    pid_file = tmp_path / "pid"
    started = time.monotonic()
    done = processes.run(
        ["sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], timeout_s=0.5, capture=True
    )
    assert done.timed_out and done.returncode == -signal.SIGTERM
    assert time.monotonic() - started < 10
    assert _wait_gone(_pid_in(pid_file))


def test_a_child_ignoring_sigterm_is_killed_after_the_grace(tmp_path, short_grace):
    ready = tmp_path / "ready"
    started = time.monotonic()
    done = processes.run(
        ["sh", "-c", f'trap "" TERM; echo $$ > {ready}; sleep 60 & wait'], timeout_s=0.5
    )
    took = time.monotonic() - started
    assert done.timed_out and done.returncode == -signal.SIGKILL
    # It was given the whole grace after the stop signal, and no more than a little over it.
    assert processes.GRACE_S + 0.5 <= took < processes.GRACE_S + 8, took


def test_a_group_another_session_started_is_killed_too(tmp_path, short_grace):
    """A nested runner whose own child is in a session of its own: killing the nested runner
    (it ignored SIGTERM) must not leave its child behind."""
    pid_file = tmp_path / "pid"
    code = (
        "import signal, subprocess, sys\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "p = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "p.wait()\n"
    )
    done = processes.run([sys.executable, "-c", code], timeout_s=1.0)
    assert done.returncode == -signal.SIGKILL
    assert _wait_gone(_pid_in(pid_file))


def test_nothing_of_the_group_outlives_its_leader(tmp_path):
    pid_file = tmp_path / "pid"
    # The leader exits at once; its background child would run on, holding the output pipe.
    done = processes.run(["sh", "-c", f"sleep 60 & echo $! > {pid_file}; echo left"], capture=True)
    assert done.returncode == 0 and done.stdout == "left\n"
    assert _wait_gone(_pid_in(pid_file))


@pytest.mark.parametrize("received", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_relayed_signal_reaches_the_group_as_the_stop_signal(tmp_path, received):
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are set from the main thread only")
    ready = tmp_path / "ready"
    # What this process had before (SIG_IGN when it was started in the background by a shell).
    before = signal.getsignal(received)
    # The leader ignores SIGINT and waits for its child (same group), which says it got the
    # signal and exits 7: the leader's exit status is the grandchild's.
    grandchild = (
        "import os, signal, sys, time\n"
        "def got(*_):\n"
        "    print('grandchild got INT', flush=True)\n"
        "    sys.exit(7)\n"
        "signal.signal(signal.SIGINT, got)\n"
        f"open({str(ready)!r}, 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n"
    )
    leader = (
        "import signal, subprocess, sys\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        f"sys.exit(subprocess.call([sys.executable, '-c', {grandchild!r}]))\n"
    )

    def send() -> None:
        _pid_in(ready)
        time.sleep(0.3)  # the inner shell has set its trap
        os.kill(os.getpid(), received)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    done = processes.run(
        [sys.executable, "-c", leader],
        capture=True,
        relay=True,
        stop_signal=signal.SIGINT,
        timeout_s=60,
    )
    sender.join()
    assert done.interrupted_by == received and not done.timed_out
    assert "grandchild got INT" in done.stdout
    assert done.returncode == 7
    # The parent's own handlers are back.
    assert signal.getsignal(received) == before
