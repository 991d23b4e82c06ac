"""What every command checks before it runs anything: a supported vLLM, a subject that exists
and loads (and its refusal of this environment, exit 4), a report folder that can be written;
and how such a problem is reported (one line on stderr, the command's exit code)."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

EXIT_ENV = 2
EXIT_REPRODUCED = 1
EXIT_NOT_REPRODUCED = 3
EXIT_UNSUPPORTED = 4


class Unsupported(str):
    """A refusal that is the subject's declared support, not a broken environment (exit 4)."""


def fail_environment(message: str) -> int:
    if isinstance(message, Unsupported):
        print(f"omni-conformance: unsupported: {message}", file=sys.stderr)
        return EXIT_UNSUPPORTED
    print(f"omni-conformance: error: {message}", file=sys.stderr)
    return EXIT_ENV


def check_environment(subject: str | None, allow_untested: bool = False) -> str | None:
    from conformance._core.vllm_compat import EnvironmentProblem, check_vllm

    try:
        check_vllm(allow_untested=allow_untested)
    except EnvironmentProblem as exc:
        return str(exc)
    if subject is not None:
        return subject_problem(subject)
    return None


def subject_problem(spec: str) -> str | None:
    """Cheap existence check (no import: a subject module usually imports vLLM, ~10 s)."""
    import importlib.util

    from conformance._core.subjects import available_subjects, ensure_cwd_importable

    if ":" not in spec:
        if spec in available_subjects():
            return None
        known = ", ".join(sorted(available_subjects()))
        return f"unknown subject {spec!r}; known: {known}, or a module:attr spec"
    module = spec.partition(":")[0]
    ensure_cwd_importable()
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    return None if found is not None else f"subject module {module!r} cannot be imported"


@contextmanager
def _held_stderr() -> Iterator[bytearray]:
    """Hold what is written to file descriptor 2 meanwhile (torch and vLLM log warnings there
    while they import, below Python's ``sys.stderr``); the caller decides whether to pass it on."""
    held = bytearray()
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as sink:
            os.dup2(sink.fileno(), 2)
            try:
                yield held
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                sink.seek(0)
                held.extend(sink.read())
    finally:
        os.close(saved)


def load_subject_quietly(spec: str) -> tuple[Any, str | None]:
    """(subject, None), or (None, a one-line problem) when it cannot be loaded.

    Import-time library warnings are passed on when the subject loads, and dropped when it does
    not: the problem is then the one line an environment error promises. A subject that patches
    vLLM loads; the oracle then runs in its own process (``conformance._core.pristine``).
    """
    from conformance._core.subjects import SubjectUnsupported, load_subject

    subject: Any = None
    problem: str | None = None
    with _held_stderr() as held:
        try:
            subject = load_subject(spec)
        except SubjectUnsupported as exc:
            problem = Unsupported(f"subject {spec!r} does not support this environment: {exc}")
        except (LookupError, ImportError, AttributeError, TypeError, SyntaxError) as exc:
            detail = " ".join(str(exc).split()) or "no message"
            problem = f"cannot load subject {spec!r}: {type(exc).__name__}: {detail}"
    if problem is None and held:
        sys.stderr.flush()
        os.write(2, bytes(held))
    return subject, problem


def folder_problem(folder: str | Path) -> str | None:
    """Why nothing can be written in ``folder`` (created if missing), or None: asked before a
    run, so an unwritable report folder costs one line instead of the run."""
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        return f"cannot write there ({exc.strerror or type(exc).__name__})"
    return None
