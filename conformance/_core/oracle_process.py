"""The upstream oracle in its own process, for subjects that patch vLLM when they load.

When loading the subject changed vLLM's classes here (``conformance._core.pristine``), an oracle
built in this process would be vLLM as the subject patched it. It then runs in a child process
that never imports the subject, started once per process and reused by every session:

* ``OracleProcess`` starts ``python -m conformance._core.oracle_process`` and exchanges pickled
  messages with it over two pipes, its output going to a log whose tail is quoted if it dies;
* ``ProcessSide`` is the session's oracle side (``conformance._core.sides.Side``), answering from
  the child's reply to the last operation;
* ``serve`` is the child: sessions by id, each an in-process ``Side`` over vLLM's schedulers.

Why a child, and how block hashes stay comparable (``NONE_HASH``): docs/design.md, "Inside the
gate"; docs/adopting-the-gate.md, "A subject that patches vLLM".
"""

from __future__ import annotations

import atexit
import itertools
import os
import subprocess
import sys
import tempfile
import weakref
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from conformance._core import hash_seed
from conformance._core.config import HarnessConfig
from conformance._core.observe import Observation
from conformance._core.workload import Op

if TYPE_CHECKING:
    from conformance._core.sides import AttributeNames, Side

# How much of the child's log an error quotes.
LOG_TAIL_CHARS = 2000


class OracleProcessError(RuntimeError):
    """The oracle process died or failed: a harness error, never a difference of the subject."""


def hash_seed_problem() -> str | None:
    """Why a child interpreter cannot reproduce this one's string hashing, or None.

    vLLM's ``finish_requests`` iterates a ``set`` of request ids, so a multi-id abort frees
    blocks in an order that depends on ``PYTHONHASHSEED``: oracle and subject must hash alike,
    and a child inherits the seed only when it is fixed.
    """
    if hash_seed.hashes_at_random() and not hash_seed.chosen():
        return (
            "an oracle in its own process needs a fixed PYTHONHASHSEED (vLLM frees the blocks of "
            "a multi-id abort in set order); run with PYTHONHASHSEED=0, as omni-conformance does"
        )
    return None


class PipedChild:
    """``python -m module`` with a pipe each way and its output in a temporary log: the child
    gets its ends' descriptors as its two arguments (``serve``). Raises ``OSError`` when the
    interpreter cannot start. The oracle process and release-diff's release processes are both."""

    def __init__(
        self, python: str, module: str, log_prefix: str, env: dict[str, str] | None = None
    ) -> None:
        self._log = tempfile.TemporaryFile(prefix=log_prefix)
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [python, "-m", module, str(to_child_r), str(from_child_w)],
                pass_fds=(to_child_r, from_child_w),
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=self._log,
                env=env,
            )
        except OSError:
            for fd in (to_child_w, from_child_r):
                os.close(fd)
            self._log.close()
            raise
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self._out = Connection(to_child_w, readable=False)
        self._in = Connection(from_child_r, writable=False)

    def alive(self) -> bool:
        return self.proc.poll() is None and not self._out.closed

    def log_tail(self) -> str:
        self._log.flush()
        self._log.seek(0)
        text = self._log.read().decode("utf-8", "replace")
        return " ".join(text[-LOG_TAIL_CHARS:].split()) or "no output"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        for conn in (self._out, self._in):
            if not conn.closed:
                conn.close()
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=10)  # the child exits on end of input
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


def child_ends(argv: list[str]) -> tuple[Connection, Connection]:
    """In a ``PipedChild``: the end it receives on and the end it replies on."""
    return Connection(int(argv[0]), writable=False), Connection(int(argv[1]), readable=False)


def error_reply(exc: BaseException) -> tuple[str, str]:
    """The reply that tells the parent a request failed, and how (one line)."""
    import traceback

    return ("error", "".join(traceback.format_exception_only(exc)).strip())


class OracleProcess(PipedChild):
    """A child interpreter serving upstream sides (see the module docstring)."""

    def __init__(self) -> None:
        problem = hash_seed_problem()
        if problem:
            raise OracleProcessError(problem)
        super().__init__(
            sys.executable, "conformance._core.oracle_process", "omni-conformance-oracle-"
        )
        self._ids = itertools.count(1)
        self.call("hello", _none_hash())

    def new_id(self) -> int:
        return next(self._ids)

    def call(self, *message: Any) -> Any:
        try:
            self._out.send(message)
            status, value = self._in.recv()
        except (EOFError, OSError) as exc:
            raise OracleProcessError(
                f"the oracle process ended (exit {self.proc.poll()}): {self.log_tail()}"
            ) from exc
        if status != "ok":
            raise OracleProcessError(f"the oracle process failed on {message[0]!r}: {value}")
        return value

    def notify(self, *message: Any) -> None:
        """Send without waiting for a reply (closing a session); quiet if the child is gone."""
        try:
            self._out.send(message)
        except (OSError, ValueError):
            pass


_SHARED: list[OracleProcess] = []


def shared_oracle() -> OracleProcess:
    """This process's oracle process, started on first use (and again if it died)."""
    if _SHARED and _SHARED[0].alive():
        return _SHARED[0]
    if _SHARED:
        _SHARED.pop().close()
    _SHARED.append(OracleProcess())
    return _SHARED[0]


@atexit.register
def _close_shared() -> None:
    while _SHARED:
        _SHARED.pop().close()


def _none_hash() -> Any:
    from conformance._core import vllm_compat as vc
    from conformance._core.config import block_hasher

    block_hasher(16)  # initialises this process's NONE_HASH if nothing has yet
    return vc.none_hash()


class ProcessSide:
    """The oracle side of one session, served by the shared ``OracleProcess``."""

    def __init__(self, config: HarnessConfig) -> None:
        self._proc = shared_oracle()
        self._id = self._proc.new_id()
        self._status: dict[str, Any] = self._proc.call("open", self._id, config)
        self.last_abort_states: dict[str, str] = {}
        # Tell the child to drop this session once the session is garbage.
        weakref.finalize(self, self._proc.notify, "close", self._id)

    @property
    def mode(self) -> str:
        return str(self._status["mode"])

    def apply(self, op: Op, prompt: list[int] | None, cfg: HarnessConfig, arrival: float) -> dict:
        snap, self._status, self.last_abort_states = self._proc.call(
            "apply", self._id, op, prompt, arrival
        )
        return snap

    def observe(
        self, op: Op, prompt: list[int] | None, cfg: HarnessConfig, arrival: float
    ) -> Observation:
        """``apply``'s snapshot as an observation (the child sends finished snapshots)."""
        return Observation.of_snapshot(self.apply(op, prompt, cfg, arrival))

    def live_ids(self) -> list[str]:
        return list(self._status["live_ids"])

    def busy(self) -> bool:
        return bool(self._status["busy"])

    def free_blocks(self) -> int:
        return int(self._status["free_blocks"])

    def omni_ids(self) -> set[str]:
        return set(self._status["omni_ids"])

    def attribute_names(self) -> AttributeNames:
        """The names as of the last reply. Only an audited session asks: the first call fetches
        them and has the child send them with every later reply, so sessions without the
        declared-attribute audits never pay for reading every live request's attributes."""
        if "attribute_names" not in self._status:
            self._status = self._proc.call("names", self._id)
        return self._status["attribute_names"]


# ---- the child ---------------------------------------------------------------------------


def _status(side: Side, with_names: bool) -> dict[str, Any]:
    status = {
        "mode": side.mode,
        "live_ids": side.live_ids(),
        "busy": side.busy(),
        "free_blocks": side.free_blocks(),
        "omni_ids": sorted(side.omni_ids()),
    }
    if with_names:
        # The declared-attribute audits (C-10..C-12) compare the subject's objects with these.
        status["attribute_names"] = side.attribute_names()
    return status


def serve(inbox: Connection, outbox: Connection) -> int:
    """Answer the parent's messages until it closes the pipe."""
    from conformance._core import vllm_compat as vc
    from conformance._core.config import block_hasher
    from conformance._core.sides import make_side
    from conformance._core.subjects import UpstreamSubject

    sides: dict[int, Side] = {}
    configs: dict[int, HarnessConfig] = {}
    audited: set[int] = set()  # sessions that asked for attribute names (``"names"``)
    while True:
        try:
            message = inbox.recv()
        except EOFError:
            return 0
        kind = message[0]
        if kind == "close":
            sides.pop(message[1], None)
            audited.discard(message[1])
            configs.pop(message[1], None)
            continue
        try:
            if kind == "hello":
                block_hasher(16)
                vc.set_none_hash(message[1])
                reply: Any = os.getpid()
            elif kind == "open":
                _, sid, config = message
                sides[sid] = make_side(UpstreamSubject(), config, None)
                configs[sid] = config
                reply = _status(sides[sid], False)
            elif kind == "apply":
                _, sid, op, prompt, arrival = message
                side = sides[sid]
                side.last_abort_states = {}
                snap = side.apply(op, prompt, configs[sid], arrival)
                reply = (snap, _status(side, sid in audited), side.last_abort_states)
            elif kind == "names":
                _, sid = message
                audited.add(sid)
                reply = _status(sides[sid], True)
            else:
                raise ValueError(f"unknown message {kind!r}")
        except Exception as exc:  # reported to the parent, which raises OracleProcessError
            outbox.send(error_reply(exc))
            continue
        outbox.send(("ok", reply))


def main(argv: list[str]) -> int:
    return serve(*child_ends(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
