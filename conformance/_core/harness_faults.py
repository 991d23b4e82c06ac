"""Faults in the harness's own code, told apart from the subject's.

The token sources and the generated chunk processors run where a subject's fault would show, so
an exception of theirs would be read as the subject's. ``harness_code`` marks a function as the
harness's own: what it raises becomes a ``HarnessError`` (the original as its cause) and is also
remembered, since the subject may catch it first; ``raise_pending`` re-raises a remembered one,
after every lock-step operation and every step of a check that drives a scheduler itself. The
error names the harness function, and the run stops.

Why this is needed, and the one case that is the subject's after all (a token source raising on
the subject's malformed ``SchedulerOutput`` alone, ``Lockstep.apply``): docs/design.md, "Inside
the gate"; what an adopter sees: docs/adopting-the-gate.md, section 7.
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
