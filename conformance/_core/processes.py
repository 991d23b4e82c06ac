"""Every child process the gate runs to completion goes through ``run``: one way to start, bound,
interrupt, stop and reap a child.

A child runs in a session (so a process group) of its own: a Ctrl-C at the terminal reaches this
process only, which decides what the group gets. Stopping a group is the same everywhere: its
``stop_signal``, ``GRACE_S`` for it to end, then SIGKILL, for the group and for any group one of
its descendants started (a nested runner's children go too); once the leader has ended, what is
left of its group is killed and waited for, so no grandchild outlives a run.

No library: the whole job is ``subprocess`` plus ``os.killpg``, and a dependency would reach
every matrix cell's environment.

Not here: the oracle process (``conformance._core.oracle_process``) lives as long as the session
using it and stays in the suite's own process group, which a check stops as a whole.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any

# From a stop signal to SIGKILL. The slowest legitimate stop is pytest after an interrupt: it
# ends its session (xdist workers and oracle processes shut down, on two shared cores) and
# writes the report of the tests that finished, a few seconds; 20 s leaves room for a loaded
# machine, and a child that ignores its stop costs no more than that.
GRACE_S = 20.0
# After SIGKILL, how long to wait for the group to disappear (the kernel is quick; a process in
# uninterruptible sleep is not, and must not hang the caller).
REAP_S = 10.0
# How often the wait wakes to check the timeout and relayed signals.
POLL_S = 0.2
# What a caller that asks for it relays to the group. SIGHUP too: in a session of its own the
# child no longer hears a closing terminal.
RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """A relayed signal stopped the run; the command exits ``128 + signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass(frozen=True)
class Completed:
    """How a run ended: the leader's exit status (negative: killed by that signal), whether the
    timeout or a relayed signal stopped it, and what was captured."""

    returncode: int
    timed_out: bool = False
    interrupted_by: int | None = None
    stdout: str = ""
    stderr: str = ""


def run(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout_s: float | None = None,
    output: IO[Any] | None = None,
    on_output: Callable[[bytes], None] | None = None,
    capture: bool = False,
    merge_stderr: bool = False,
    relay: bool = False,
    stop_signal: int = signal.SIGTERM,
) -> Completed:
    """Run ``cmd`` in its own process group until it ends; stop the group past ``timeout_s``.

    Output: this process's own (default); ``output``, a file that gets stdout and stderr; or
    ``on_output``, called with each chunk of both as it comes; or ``capture``, returned as text
    (stderr into stdout with ``merge_stderr``). With ``relay`` (main thread only), the first
    SIGINT/SIGTERM/SIGHUP this process gets meanwhile stops the group and is returned as
    ``interrupted_by``; the group gets ``stop_signal`` whichever came (pytest writes its report
    on SIGINT, dies silently on SIGTERM). Any exception while waiting stops the group, then
    propagates.
    """
    if sum((output is not None, on_output is not None, capture)) > 1:
        raise ValueError("choose one of output, on_output and capture")
    if output is not None or on_output is not None:
        stdout: Any = output if output is not None else subprocess.PIPE
        stderr: Any = subprocess.STDOUT
    elif capture:
        stdout = subprocess.PIPE
        stderr = subprocess.STDOUT if merge_stderr else subprocess.PIPE
    else:
        stdout = stderr = None
    got: list[int] = []
    proc: subprocess.Popen[bytes] | None = None
    stop_at: list[float] = []  # when the stop signal went out (at most once)
    killed: list[bool] = []

    def stop() -> None:
        if proc is not None and not stop_at:
            stop_at.append(time.monotonic())
            _signal_group(proc.pid, stop_signal)

    def handler(signum: int, frame: FrameType | None) -> None:
        if not got:  # a second signal changes nothing: the grace already runs
            got.append(signum)
            stop()

    with _relaying(handler if relay else None):
        proc = subprocess.Popen(
            list(cmd),
            env=dict(env) if env is not None else None,
            cwd=cwd,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
        pump = _pump(proc, on_output) if on_output is not None else None
        captured: list[tuple[bytes | None, bytes | None]] = []
        started = time.monotonic()
        timed_out = False
        try:
            if got:  # the signal came while the child was being started
                stop()
            while True:
                try:
                    rc = _wait_step(proc, capture, captured)
                    break
                except subprocess.TimeoutExpired:
                    if proc.poll() is not None:  # ended; a grandchild holds its pipes open
                        rc = proc.returncode
                        break
                now = time.monotonic()
                if timeout_s is not None and not stop_at and now - started > timeout_s:
                    timed_out = True
                    stop()
                if stop_at and not killed and now - stop_at[0] > GRACE_S:
                    killed.append(True)
                    _kill_tree(proc.pid)
        except BaseException:
            stop()
            _finish_stop(proc, stop_at)
            raise
        finally:
            reap(proc.pid)
            if capture and not captured:
                _drain(proc, captured)
            if pump is not None:
                pump.join(timeout=REAP_S)
    out, err = captured[0] if captured else (None, None)
    return Completed(rc, timed_out, got[0] if got else None, _text(out), _text(err))


def reap(pgid: int) -> None:
    """SIGKILL what is left of group ``pgid`` (and of the groups its members started) and wait
    until none of it exists, at most ``REAP_S``."""
    groups = _kill_tree(pgid)
    deadline = time.monotonic() + REAP_S
    while groups and time.monotonic() < deadline:
        groups = {g for g in groups if _group_exists(g)}
        if groups:
            time.sleep(0.05)


def _finish_stop(proc: subprocess.Popen[Any], stop_at: list[float]) -> None:
    """After the stop signal: wait out what is left of the grace, then kill."""
    left = GRACE_S - (time.monotonic() - stop_at[0]) if stop_at else 0.0
    try:
        proc.wait(timeout=max(left, 0.0))
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        proc.wait()


def _kill_tree(pid: int) -> set[int]:
    """SIGKILL the group led by ``pid`` and every group its descendants started (a nested
    runner killed here cannot stop its own group any more); the groups signalled."""
    groups = {pid} | _groups_under(pid)
    for group in groups:
        _signal_group(group, signal.SIGKILL)
    return groups


def _wait_step(
    proc: subprocess.Popen[bytes], capture: bool, captured: list[tuple[bytes | None, bytes | None]]
) -> int:
    if capture:
        # communicate keeps what it read before a timeout and returns all of it at the end.
        captured.append(proc.communicate(timeout=POLL_S))
        return proc.returncode
    return proc.wait(timeout=POLL_S)


def _drain(
    proc: subprocess.Popen[bytes], captured: list[tuple[bytes | None, bytes | None]]
) -> None:
    """The output of a child whose pipes outlived it, now that its group is gone."""
    try:
        captured.append(proc.communicate(timeout=REAP_S))
    except (subprocess.TimeoutExpired, ValueError, OSError):
        pass  # a pipe held open by a process outside the group: its output is lost


def _text(data: bytes | None) -> str:
    return data.decode(errors="replace") if data else ""


def _pump(proc: subprocess.Popen[bytes], sink: Callable[[bytes], None]) -> threading.Thread:
    stream = proc.stdout
    assert stream is not None

    def copy() -> None:
        while chunk := os.read(stream.fileno(), 65536):
            sink(chunk)

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread


@contextmanager
def _relaying(handler: Callable[[int, FrameType | None], None] | None) -> Iterator[None]:
    if handler is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in RELAYED}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _signal_group(pgid: int, sig: int) -> None:
    if pgid == os.getpgrp():  # never this process's own group
        return
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _groups_under(pgid: int) -> set[int]:
    """The process groups of every descendant of group ``pgid``'s members (Linux ``/proc``;
    empty where there is none), this process's own group excepted."""
    children: dict[int, list[int]] = {}
    group_of: dict[int, int] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return set()
    for name in names:
        if not name.isdigit():
            continue
        try:
            stat = Path("/proc", name, "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()  # the command name may contain anything
        if len(fields) < 3:
            continue
        pid, ppid, group = int(name), int(fields[1]), int(fields[2])
        children.setdefault(ppid, []).append(pid)
        group_of[pid] = group
    todo = [pid for pid, group in group_of.items() if group == pgid]
    found: set[int] = set()
    seen: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        for child in children.get(pid, ()):
            found.add(group_of[child])
            todo.append(child)
    found.discard(pgid)
    found.discard(os.getpgrp())
    return found
