"""The guard of one ``matrix --ray`` cell task: no process of the cell outlives the task's worker.

A cell's task runs ``check`` as a child, and ``check`` runs pytest in a session of its own. When
the worker dies (its node lost, the task cancelled, the driver gone), Ray kills the worker's own
children only: the cell's pytest and its workers would go on as orphans, using the CPUs a retry
of the cell needs. Every process the cell starts carries the task's token (``TOKEN_ENV``); the
guard, started outside the worker's process tree, waits for the worker to end and then kills
every process carrying the token and removes the cell's scratch folder. It ends by itself when
the task removes that folder. Linux only (``/proc``); elsewhere no guard starts. Standard library
only: it runs as ``python -m conformance.cluster.cell_guard``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

TOKEN_ENV = "OMNI_CONFORMANCE_CELL_TOKEN"
POLL_S = 1.0


def _start_time(pid: int) -> str | None:
    """``pid``'s start time (so a reused pid is not taken for the worker), None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # the command name may contain anything
    if fields and fields[0] == "Z":
        return None  # a zombie has ended
    return fields[19] if len(fields) > 19 else None


def carrying(prefix: str = "", exact: bool = False) -> list[int]:
    """The live processes whose environment holds ``TOKEN_ENV`` set to a value starting with
    ``prefix`` (a token is ``<cell folder>-<uuid>``), or equal to it with ``exact``; this one
    excepted."""
    needle = f"{TOKEN_ENV}={prefix}".encode()
    found = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            entries = Path("/proc", name, "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            any(e == needle if exact else e.startswith(needle) for e in entries)
            and _start_time(int(name)) is not None
        ):
            found.append(int(name))
    return found


def kill_carrying(token: str) -> None:
    """SIGKILL every process carrying ``token`` until none is left (a dying parent may have
    started one more), at most a few seconds."""
    for _ in range(50):
        pids = carrying(token, exact=True)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.1)


def watch(worker: int, scratch: Path, token: str) -> None:
    """Until ``scratch`` is gone (the task ended): if ``worker`` ends first, kill the cell's
    processes and remove ``scratch``."""
    born = _start_time(worker)
    while scratch.exists():
        if born is None or _start_time(worker) != born:
            kill_carrying(token)
            shutil.rmtree(scratch, ignore_errors=True)
            return
        time.sleep(POLL_S)


def start(worker: int, scratch: Path, token: str) -> None:
    """Start the guard of ``worker``'s cell, outside this process's tree: the child started here
    forks the guard and ends at once, so the guard is no child of the worker's for Ray to kill."""
    if not Path("/proc/self/stat").exists():
        return
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    try:
        subprocess.run(
            [sys.executable, "-m", __name__, str(worker), str(scratch), token],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            check=False,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        pass  # the cell runs unguarded: only a dead worker's leftovers are at stake, not its result


def main(argv: list[str]) -> None:
    worker, scratch, token = int(argv[0]), Path(argv[1]), argv[2]
    if os.fork():
        os._exit(0)  # the starter returns; the guard, reparented, watches
    watch(worker, scratch, token)


if __name__ == "__main__":
    main(sys.argv[1:])
