"""Faults in the harness's own code, told apart from the subject's.

Some of the harness's code runs where a subject's fault would show. The token sources stand in
for the model between ``schedule`` and ``update_from_output``, and the generated chunk processors
are called by the subject's own scheduler. An exception there is the harness's bug, but it would
be read as the subject's: the lock-step comparison records a crash as an observed difference, and
a subject's fault containment fails the request whose processor raised, which the checks then
report as the subject's finding (or, when both sides crash alike, the two crashes compare equal
and the run goes on checking nothing).

``harness_code`` marks a function as the harness's own. An exception it raises becomes a
``HarnessError`` (the original as its cause) and is also remembered, because the subject may
catch it before the harness sees it. ``raise_pending`` re-raises a remembered one; the lock-step
session calls it after every operation, and checks that drive a scheduler themselves call it
after every step. Such an error names the harness function that raised, and the run stops.

One case is the subject's after all. The token source reads the subject's ``SchedulerOutput``,
and a malformed one can make it raise. The lock-step session runs the same code on upstream's
output too, so it decides by that side: raised on upstream's input, it is the gate's bug and
the run stops; raised on the subject's alone, the crash is observed and reported as the
subject's difference, as any crash of the subject's own code would be (``Lockstep.apply``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class HarnessError(RuntimeError):
    """The harness's own code raised: a bug in the gate, not a finding about the subject."""


_lock = threading.Lock()
_pending: list[HarnessError] = []


def harness_code(fn: F) -> F:
    """Mark ``fn`` as the harness's own code (see the module docstring)."""

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except HarnessError:
            raise  # already marked by a guarded callee
        except Exception as exc:
            error = HarnessError(
                f"harness error in {fn.__qualname__}: {type(exc).__name__}: {exc} "
                "(a bug in the gate, not a finding about the subject)"
            )
            with _lock:
                _pending.append(error)
            raise error from exc

    return guarded  # type: ignore[return-value]


def raise_pending() -> None:
    """Raise the first harness error remembered since the last call (and forget them all)."""
    if not _pending:  # the common case, on every lock-step operation: no lock taken
        return
    pending = forget_pending()
    if pending:
        raise pending[0]


def forget_pending() -> list[HarnessError]:
    """Forget the remembered harness errors and return them (a new session starts clean: an
    error that reached its caller directly has been seen there)."""
    with _lock:
        pending = _pending[:]
        _pending.clear()
    return pending
