"""Shrinking a release-diff change against both releases (``release-diff --shrink-with``).

This module owns running one trace on two vLLM releases side by side and shrinking a change's
trace with the gate's ``Shrinker`` (``conformance._core.lockstep``) against them. Each release's
interpreter is a child process (``python -m conformance.release.release_shrink``) that runs the
trace on its own vLLM exactly as ``record`` does (``record.workload_steps``) and serves the
normalised observations an operation at a time over a pipe, as the isolated oracle does
(``conformance._core.oracle_process``). The parent compares the two streams as they come and
stops at their first difference, found with ``release_diff.first_difference``; a candidate
reduction is kept only when that first difference is still the same change (its field pattern
and operation kind). Only plain data crosses the pipes (a trace as JSON, normalised
observations), so the two children may run different vLLM and torch releases. The shrinker gets
two passes of its own (``ReleaseShrinker``). docs/compat-matrix.md ("Upstream changes between
releases") has the details.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from conformance._core.lockstep import FailsCheck, Shrinker, shrink_seconds
from conformance._core.oracle_process import PipedChild, child_ends, error_reply
from conformance._core.workload import AddRequest, Step, Trace
from conformance.release.first_difference import (
    Change,
    DiffResult,
    FirstDifference,
    TraceMaker,
    first_difference,
    iter_field_differences,
)

# How long a child may take to answer: starting (importing vLLM and torch) and one operation.
START_TIMEOUT_S = 600.0
OP_TIMEOUT_S = 120.0
# How often a dead or hung child is started again within one pair before the pair gives up.
MAX_RESTARTS = 3
# Above this many operations a trace gets the shrinker's joint pass over each request's prompt
# and max_tokens (``ReleaseShrinker._retime_adds``): a release-diff trace should read in at most
# 12 operations.
JOINT_ABOVE = 12
# The planted configuration changes a child applies (``ReleaseProcess(config_changes=...)``).
CHANGES_ENV = "OMNI_CONFORMANCE_RELEASE_CONFIG_CHANGES"


class ReleaseProcessError(RuntimeError):
    """A release's child interpreter died, hung or failed; one line naming it."""


def _package_root() -> str:
    import conformance

    return str(Path(conformance.__file__).resolve().parents[1])


class ReleaseProcess(PipedChild):
    """One release's interpreter running traces for the parent (see the module docstring).

    ``config_changes`` are applied to every trace's configuration in this child only: a
    planted difference between two sides that run the same release (the self-tests)."""

    def __init__(
        self,
        python: str | Path,
        config_changes: Mapping[str, Any] | None = None,
    ) -> None:
        from conformance._core.oracle_process import hash_seed_problem

        problem = hash_seed_problem()
        if problem:
            raise ReleaseProcessError(problem)
        self.python = str(python)
        self.config_changes = dict(config_changes or {})
        env = dict(os.environ)
        # The children run this copy of the harness whatever the environment has installed, so
        # both ends of the pipe speak the same protocol and run the same recording code.
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_package_root(), env.get("PYTHONPATH", "")) if p
        )
        env.pop(CHANGES_ENV, None)
        if self.config_changes:
            env[CHANGES_ENV] = json.dumps(self.config_changes)
        try:
            super().__init__(
                self.python, "conformance.release.release_shrink", "omni-conformance-release-", env
            )
        except OSError as exc:
            raise ReleaseProcessError(f"cannot start {self.python}: {exc}") from None
        self.info: dict[str, Any] = {}
        self.send("hello")

    def send(self, *message: Any) -> None:
        try:
            self._out.send(message)
        except (OSError, ValueError) as exc:
            raise ReleaseProcessError(self._died(message[0])) from exc

    def recv(self, what: str, timeout_s: float = OP_TIMEOUT_S) -> Any:
        try:
            if not self._in.poll(timeout_s):
                self.kill()
                raise ReleaseProcessError(
                    f"{self.python}: no answer to {what!r} in {timeout_s:.0f} s (stopped it)"
                )
            status, value = self._in.recv()
        except (EOFError, OSError) as exc:
            raise ReleaseProcessError(self._died(what)) from exc
        if status != "ok":
            raise ReleaseProcessError(f"{self.python} failed on {what!r}: {value}")
        return value

    def ready(self) -> dict[str, Any]:
        """Wait for the child's greeting: its vLLM release and the fields it lacks."""
        if not self.info:
            self.info = self.recv("hello", START_TIMEOUT_S)
        return self.info

    def _died(self, what: str) -> str:
        return f"{self.python} ended (exit {self.proc.poll()}) on {what!r}: {self.log_tail()}"


class ReleasePair:
    """Two releases' interpreters, A and B, that run one trace side by side and report the
    first difference of their observations (``first_difference``)."""

    def __init__(
        self,
        python_a: str | Path,
        python_b: str | Path,
        *,
        changes_a: Mapping[str, Any] | None = None,
        changes_b: Mapping[str, Any] | None = None,
    ) -> None:
        self._specs = ((python_a, changes_a), (python_b, changes_b))
        self.restarts = 0
        self.sides: list[ReleaseProcess] = []
        try:
            # Both start at once: each spends its first seconds importing vLLM and torch.
            self.sides = [ReleaseProcess(p, c) for p, c in self._specs]
            for side in self.sides:
                side.ready()
        except BaseException:
            self.close()
            raise

    @property
    def versions(self) -> tuple[str, str]:
        a, b = (str(s.ready()["vllm"]) for s in self.sides)
        return a, b

    def _absent(self) -> tuple[frozenset[str], frozenset[str]]:
        a, b = (frozenset(s.ready()["absent_fields"]) for s in self.sides)
        return a, b

    def _revive(self) -> None:
        """Start again a child that died or was stopped, at most ``MAX_RESTARTS`` times."""
        for i, side in enumerate(self.sides):
            if side.alive():
                continue
            if self.restarts >= MAX_RESTARTS:
                raise ReleaseProcessError(f"{side.python}: ended {self.restarts} times; gave up")
            self.restarts += 1
            side.close()
            python, changes = self._specs[i]
            self.sides[i] = ReleaseProcess(python, changes)
            self.sides[i].ready()

    def _both(self, what: str, *message: Any) -> list[Any]:
        for side in self.sides:
            side.send(what, *message)
        # Opening a session may be a child's first use of vLLM's scheduler (its imports).
        timeout = START_TIMEOUT_S if what == "open" else OP_TIMEOUT_S
        replies: list[Any] = []
        errors: list[ReleaseProcessError] = []
        for side in self.sides:
            # Every side's reply is read even when one fails, or it would answer the next call.
            try:
                replies.append(side.recv(what, timeout))
            except ReleaseProcessError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        return replies

    def run(self, trace: Trace, mode: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """``trace``'s operations (no drain: a trace ends where its difference is) on both
        releases in ``mode``, as recorded runs, up to and including the first operation after
        which they differ."""
        self._revive()
        opened = self._both("open", trace.to_dict(), mode)
        runs: list[dict[str, Any]] = [{"ops": [], "drain": 0, "steps": []} for _ in self.sides]
        if any(o is not None for o in opened):
            for run, why in zip(runs, opened, strict=True):
                if why is not None:
                    run["not_applicable"] = why
            return runs[0], runs[1]
        absent_a, absent_b = self._absent()
        while True:
            got = self._both("next")
            for run, item in zip(runs, got, strict=True):
                if item is not None:
                    run["ops"].append(item[0])
                    run["steps"].append(item[1])
            if got[0] is None or got[1] is None:
                break
            if got[0][0] != got[1][0]:
                break
            if next(iter_field_differences(got[0][1], got[1][1], absent_a, absent_b), None):
                break
        return runs[0], runs[1]

    def first_difference(
        self, trace: Trace, mode: str, name: str = "shrink"
    ) -> FirstDifference | None:
        run_a, run_b = self.run(trace, mode)
        absent_a, absent_b = self._absent()
        return first_difference(name, mode, run_a, run_b, absent_a, absent_b)

    def close(self) -> None:
        for side in self.sides:
            side.close()
        self.sides = []

    def __enter__(self) -> ReleasePair:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---- shrinking one change -----------------------------------------------------------------


class ReleaseShrinker(Shrinker):
    """The gate's ``Shrinker`` with one more trade: a step for a few more tokens (1 to a block
    less one) of some earlier request's prompt. The gate trades a whole block at a time, which
    suits KV-cache pressure; a change between releases often shows when a request reaches a
    block boundary (a block filled and hashed), and the decode steps that walk it there go
    only when the prompt ends just short of the boundary."""

    def _trade_steps(self) -> None:
        super()._trade_steps()
        block = max(1, self.config.block_size)
        j = len(self.ops) - 1
        while j > 0:
            if j < len(self.ops) and isinstance(self.ops[j], Step):
                self._trade_step_for_tokens(j, block)
            j -= 1
        if len(self.ops) > JOINT_ABOVE:
            self._retime_adds()

    def _retime_adds(self) -> None:
        """Each request with every shorter prompt and smaller ``max_tokens`` together, the pair
        whose run shows the change soonest kept (as the pool pass picks its pool). A change at
        a request's end (the order its blocks are freed in) needs its prompt and output to end
        on the right steps: shortening either alone moves the end off them, so the one-field
        passes stop at a longer trace. Quadratic in the request's size, hence only for a
        trace still longer than ``JOINT_ABOVE``."""
        i = 0
        while i < len(self.ops):
            op = self.ops[i]
            if isinstance(op, AddRequest):
                current = self._size(self.ops)
                best: tuple[tuple[int, ...], list[Any]] | None = None
                for n in range(1, len(op.prompt) + 1):
                    for m in range(1, op.max_tokens + 1):
                        changed = replace(op, prompt=op.prompt[:n], max_tokens=m)
                        candidate = [*self.ops[:i], changed, *self.ops[i + 1 :]]
                        key = (self.config.num_blocks, tuple(candidate))
                        if changed == op or key in self._tried:
                            continue
                        if self._spent():
                            return  # the next pass's ``_try`` ends the search
                        self._tried.add(key)
                        kept = self._verdict(candidate)
                        if kept is not None and (best is None or self._size(kept) < best[0]):
                            best = (self._size(kept), kept)
                if best is not None and best[0] < current:
                    self.ops = best[1]
            i += 1

    def _trade_step_for_tokens(self, j: int, block: int) -> bool:
        for i in range(j):
            op = self.ops[i] if j < len(self.ops) else None
            if not isinstance(op, AddRequest) or not op.prompt:
                continue
            for k in range(1, block):
                longer = op.prompt + tuple(op.prompt[m % len(op.prompt)] for m in range(k))
                candidate = [*self.ops[:i], replace(op, prompt=longer), *self.ops[i + 1 :]]
                if self._try(candidate[:j] + candidate[j + 1 :]):
                    return True
        return False


def same_change(pair: ReleasePair, mode: str, pattern: str, op_kind: str) -> FailsCheck:
    """A ``Shrinker`` check: the candidate's operations up to its first difference between the
    two releases when that difference is at ``pattern`` after an operation of ``op_kind`` (the
    change), else False."""

    def check(t: Trace) -> Trace | bool:
        d = pair.first_difference(t, mode)
        if d is None or d.pattern != pattern or d.op_kind != op_kind:
            return False
        return Trace(t.config, list(t.ops[: d.length]), dict(t.prefixes), dict(t.meta))

    return check


@dataclass
class ShrinkOutcome:
    """How a change's trace was made. ``status``: "shrunk" (reduced against both releases, as
    far as the time bound allowed), "cut" (no interpreters: the found workload cut after its
    difference), "not reproduced" (the two interpreters do not show the change on the found
    trace, which is written as found), "failed" (a release's interpreter failed)."""

    status: str
    found_length: int
    length: int
    why: str | None = None
    seconds: float | None = None
    runs: int | None = None
    complete: bool | None = None
    difference: FirstDifference | None = None  # the written trace's, when shrunk

    def to_dict(self) -> dict[str, Any]:
        d = self.difference
        return {
            "status": self.status,
            "found_length": self.found_length,
            "length": self.length,
            "why": self.why,
            "seconds": None if self.seconds is None else round(self.seconds, 1),
            "runs": self.runs,
            "complete": self.complete,
            "step": None if d is None else d.step,
            "op": None if d is None else d.op,
            "path": None if d is None else d.path,
            "a": None if d is None else d.a,
            "b": None if d is None else d.b,
        }


NO_INTERPRETERS = "no release interpreters given (release-diff --shrink-with A_PYTHON B_PYTHON)"


def cut(found: Trace, why: str = NO_INTERPRETERS) -> ShrinkOutcome:
    return ShrinkOutcome("cut", len(found.ops), len(found.ops), why)


def _describe(d: FirstDifference | None) -> str:
    if d is None:
        return "no difference"
    return f"first difference {d.path} after {d.op_kind} (operation {d.step})"


def shrink_change(
    pair: ReleasePair, change: Change, found: Trace, seconds: float | None = None
) -> tuple[Trace, ShrinkOutcome]:
    """The shortest trace the ``Shrinker`` finds in ``seconds`` (``shrink_seconds()`` if None)
    whose first difference between the pair's releases is still ``change``; with how it went.
    The trace's meta says where the releases now differ and how it was shrunk."""
    mode = str(found.meta.get("mode") or ("async" if found.config.async_scheduling else "sync"))
    check = same_change(pair, mode, change.pattern, change.op_kind)
    budget = shrink_seconds() if seconds is None else seconds
    started = time.monotonic()

    def unshrunk(status: str, why: str, runs: int | None = None) -> tuple[Trace, ShrinkOutcome]:
        spent = time.monotonic() - started
        return found, ShrinkOutcome(status, len(found.ops), len(found.ops), why, spent, runs)

    try:
        result = ReleaseShrinker(found, check, time_budget=budget).run()
        if not result.reproduced:
            got = pair.first_difference(found, mode)
            why = f"on these interpreters the found trace shows {_describe(got)}"
            return unshrunk("not reproduced", why, result.runs)
        final = pair.first_difference(result.trace, mode)
    except ReleaseProcessError as exc:
        return unshrunk("failed", str(exc))
    if final is None or (final.pattern, final.op_kind) != (change.pattern, change.op_kind):
        # The shrinker keeps only candidates that showed the change, and runs are deterministic:
        # reaching here means they are not, which the report must say rather than hide.
        why = f"the shrunk trace ran again shows {_describe(final)}: runs are not deterministic"
        return unshrunk("not reproduced", why, result.runs)
    trace = result.trace
    outcome = ShrinkOutcome(
        "shrunk",
        len(found.ops),
        len(trace.ops),
        None if result.complete else f"the time bound ({budget:.0f} s) ended the search",
        time.monotonic() - started,
        result.runs,
        result.complete,
        final,
    )
    meta = dict(trace.meta)
    rd = dict(meta.get("release_diff", {}))
    rd.update(step=final.step, op=final.op, path=final.path, value_a=final.a, value_b=final.b)
    meta["release_diff"] = rd
    meta["shrunk"] = {
        "found_length": outcome.found_length,
        "length": outcome.length,
        "runs": outcome.runs,
        "seconds": round(outcome.seconds or 0.0, 1),
        "complete": outcome.complete,
    }
    if result.original_config is not None:
        meta["shrunk"]["config"] = result.to_dict()
    return Trace(trace.config, list(trace.ops), dict(trace.prefixes), meta), outcome


def _label(python: str | Path) -> str:
    """How a report names an interpreter without naming a local folder: its environment's
    folder name, else "this interpreter" or the executable's name."""
    path = Path(python)
    if path.parent.name in ("bin", "Scripts") and (path.parent.parent / "pyvenv.cfg").exists():
        return path.parent.parent.name
    same = os.path.realpath(path) == os.path.realpath(sys.executable)
    return "this interpreter" if same else path.name


@contextmanager
def shrinking(
    result: DiffResult,
    pythons: tuple[str | Path, str | Path],
    seconds: float | None = None,
    progress: Callable[[str], None] | None = None,
    config_changes: tuple[Mapping[str, Any] | None, Mapping[str, Any] | None] = (None, None),
) -> Iterator[TraceMaker]:
    """A ``release_diff.TraceMaker`` that shrinks each change against the two interpreters
    (started once for all changes); ``result.shrink`` says with what. A pair that cannot start,
    or runs other releases than the recordings', makes every change's outcome "failed" with
    the reason: the diff itself still stands."""
    budget = shrink_seconds() if seconds is None else float(seconds)
    say = progress or (lambda line: None)
    pair: ReleasePair | None = None
    problem: str | None = None
    try:
        pair = ReleasePair(
            pythons[0], pythons[1], changes_a=config_changes[0], changes_b=config_changes[1]
        )
        problem = check_versions(pair, (result.a.vllm, result.b.vllm))
    except ReleaseProcessError as exc:
        problem = str(exc)
    versions = pair.versions if pair is not None else (None, None)
    result.shrink = {
        "a": {"interpreter": _label(pythons[0]), "vllm": versions[0]},
        "b": {"interpreter": _label(pythons[1]), "vllm": versions[1]},
        "seconds_per_change": budget,
        "problem": problem,
    }
    if problem:
        say(f"release-diff: traces not shrunk: {problem}")

    def make(change: Change, found: Trace) -> tuple[Trace, dict[str, Any]]:
        if pair is None or problem:
            n = len(found.ops)
            return found, ShrinkOutcome("failed", n, n, problem).to_dict()
        say(f"release-diff: shrinking {change.id} ({len(found.ops)} ops, at most {budget:g} s) ...")
        trace, outcome = shrink_change(pair, change, found, budget)
        say(
            f"release-diff: {change.id}: {outcome.status} {outcome.found_length} -> "
            f"{outcome.length} ops in {outcome.seconds or 0:.1f} s"
            + (f" ({outcome.why})" if outcome.why else "")
        )
        return trace, outcome.to_dict()

    try:
        yield make
    finally:
        if pair is not None:
            pair.close()


# ---- naming interpreters ------------------------------------------------------------------


def resolve_python(name: str, envs_dir: Path | None = None) -> Path:
    """An interpreter named by ``--shrink-with``: a python executable, an environment folder,
    an environment's name under the environments folder (``vllm-0.30.0`` also finds
    ``vllm-0.30.0+<digest>`` when exactly one such environment exists), or a command on
    ``PATH`` (``python``). ``ValueError`` says why none is found."""
    from conformance.release.envs import default_envs_dir, env_python

    path = Path(name).expanduser()
    if path.is_file():
        return path
    if path.is_dir() and env_python(path).exists():
        return env_python(path)
    root = envs_dir or default_envs_dir()
    if root.is_dir() and "/" not in name:
        exact = root / name
        if env_python(exact).exists():
            return env_python(exact)
        found = sorted(p for p in root.glob(f"{name}+*") if env_python(p).exists())
        if len(found) == 1:
            return env_python(found[0])
        if len(found) > 1:
            names = ", ".join(p.name for p in found)
            raise ValueError(f"{name}: several environments match ({names}); name one")
    on_path = shutil.which(name) if "/" not in name else None
    if on_path:
        return Path(on_path)
    raise ValueError(
        f"{name}: not a python executable, an environment folder, or an environment under {root}"
    )


def check_versions(pair: ReleasePair, wanted: Sequence[str]) -> str | None:
    """Why the pair cannot shrink changes between the releases ``wanted`` (A, B), or None."""
    for label, have, want, side in zip("AB", pair.versions, wanted, pair.sides, strict=True):
        if have != want:
            return (
                f"--shrink-with: {side.python} runs vLLM {have} but recording {label} is of "
                f"vLLM {want}"
            )
    return None


# ---- the child ----------------------------------------------------------------------------


def serve(inbox: Connection, outbox: Connection, config_changes: Mapping[str, Any]) -> int:
    """Answer the parent until it closes the pipe: ``hello``; ``open`` (a trace and a mode:
    None, or why this release cannot run it); ``next`` (the next operation's description and
    normalised observation, None after the last)."""
    import logging

    from conformance._core.vllm_compat import vllm_version
    from conformance.release.record import absent_fields, corpus_config, workload_steps

    # vLLM warns at every refused reset of the prefix cache; here that is an outcome compared.
    logging.getLogger("vllm").setLevel(logging.ERROR)
    steps: Any = None
    while True:
        try:
            message = inbox.recv()
        except EOFError:
            return 0
        kind = message[0]
        try:
            if kind == "hello":
                # Build (and drop) one scheduler now: vLLM's imports take tens of seconds, which
                # would otherwise land in the first change's time bound.
                warm = workload_steps(Trace(corpus_config(), []), "sync", max_drain=0)
                if not isinstance(warm, str):
                    list(warm)
                reply: Any = {
                    "vllm": vllm_version(),
                    "absent_fields": absent_fields(),
                    "pid": os.getpid(),
                }
            elif kind == "open":
                _, data, mode = message
                trace = Trace.from_dict(data)
                if config_changes:
                    trace = Trace(
                        trace.config.with_(**config_changes),
                        trace.ops,
                        trace.prefixes,
                        trace.meta,
                    )
                got = workload_steps(trace, mode, max_drain=0)
                steps, reply = (None, got) if isinstance(got, str) else (got, None)
            elif kind == "next":
                item = next(steps, None) if steps is not None else None
                reply = None if item is None else (item[0], item[1])
            else:
                raise ValueError(f"unknown message {kind!r}")
        except Exception as exc:  # reported to the parent, which raises ReleaseProcessError
            steps = None
            outbox.send(error_reply(exc))
            continue
        outbox.send(("ok", reply))


def main(argv: list[str]) -> int:
    return serve(*child_ends(argv), json.loads(os.environ.get(CHANGES_ENV) or "{}"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
