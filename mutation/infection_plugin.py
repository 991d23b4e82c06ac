"""The infection probes' runtime, and the pytest plugin of the campaign's infection run.

Instrumented modules (``mutation/infection.py``) call ``truth``, ``value``, ``call`` and ``hit``
at their mutants' spots; each returns what the unmutated code computes there and records, once
per mutant and test, an infection (unless the mutant's guard excuses it): a line ``mutant<TAB>test`` in a file of its process under
``OMNI_INFECTION_DIR``. Loaded as a plugin (``-p infection_plugin``), it names the running test
in ``OMNI_INFECTION_CONTEXT`` around each test, so a process the test starts (a stage engine)
labels its infections with that test too; an infection outside any test is recorded with an
empty name, and the campaign then runs that mutant against every test. Each process also lists
the tests it ran and their outcome (``ran.<pid>.json``).
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

_DIR = "OMNI_INFECTION_DIR"
_CONTEXT = "OMNI_INFECTION_CONTEXT"
_PLAIN = (bool, int, float, complex, str, bytes, type(None))
_seen: set[tuple[str, str]] = set()
_ran: dict[str, str] = {}  # test -> "passed" / "failed" / "skipped", in this process


def _record(mutant: str) -> None:
    test = os.environ.get(_CONTEXT, "")
    if (mutant, test) in _seen:
        return
    _seen.add((mutant, test))
    folder = os.environ.get(_DIR)
    if folder:
        with open(os.path.join(folder, f"hits.{os.getpid()}.tsv"), "a") as f:
            f.write(f"{mutant}\t{test}\n")


def same(a: Any, b: Any) -> bool:
    """Whether two values are interchangeable for what follows: one object, or equal plain
    values (and tuples, lists and dicts of them). Anything else counts as different."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, _PLAIN):
        return bool(a == b)
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return False


def _guarded(mutant: str, when: Callable[[], Any] | None) -> None:
    """Record an infection the probe saw, unless the mutant's guard (a triage ledger entry's
    ``when``) says the difference cannot matter here. A guard that raises does not excuse."""
    try:
        excused = when is not None and not when()
    except Exception:
        excused = False
    if not excused:
        _record(mutant)


def truth(
    mutant: str, value: Any, other: Callable[[], Any], when: Callable[[], Any] | None = None
) -> Any:
    """A condition: infected when the mutant's condition has another truth (or raises)."""
    try:
        infected = bool(value) != bool(other())
    except Exception:
        infected = True
    if infected:
        _guarded(mutant, when)
    return value


def value(
    mutant: str, value: Any, other: Callable[[], Any], when: Callable[[], Any] | None = None
) -> Any:
    """An expression: infected when the mutant's expression has another value (or raises)."""
    try:
        infected = not same(value, other())
    except Exception:
        infected = True
    if infected:
        _guarded(mutant, when)
    return value


def call(
    mutant: str,
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    other: Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]],
    when: Callable[[], Any] | None = None,
) -> Any:
    """A call: infected when the mutant's arguments bind to ``func``'s parameters otherwise
    (defaults applied) than the unmutated ones, or not at all. The call itself is made once,
    with the unmutated arguments."""
    try:
        margs, mkwargs = other(args, kwargs)
        try:
            signature = inspect.signature(func)
        except (TypeError, ValueError):
            infected = not (same(args, margs) and same(kwargs, mkwargs))
        else:
            try:
                mine = signature.bind(*margs, **mkwargs)
            except TypeError:
                infected = True
            else:
                theirs = signature.bind(*args, **kwargs)
                mine.apply_defaults()
                theirs.apply_defaults()
                infected = not same(dict(theirs.arguments), dict(mine.arguments))
    except Exception:
        infected = True
    if infected:
        _guarded(mutant, when)
    return func(*args, **kwargs)


def hit(mutant: str, when: Callable[[], Any] | None = None) -> None:
    """A statement: infected whenever it executes."""
    _guarded(mutant, when)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Iterator[None]:
    os.environ[_CONTEXT] = item.nodeid
    try:
        yield
    finally:
        os.environ[_CONTEXT] = ""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        _ran[report.nodeid] = "failed"
    elif report.when == "call" or (report.skipped and report.nodeid not in _ran):
        _ran.setdefault(report.nodeid, report.outcome)


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = os.environ.get(_DIR)
    if folder and _ran:
        with open(os.path.join(folder, f"ran.{os.getpid()}.json"), "w") as f:
            json.dump(_ran, f)
