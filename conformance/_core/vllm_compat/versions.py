"""Which vLLM releases the harness supports, and how a per-release difference is keyed.

The harness runs on every vLLM minor in ``SUPPORTED_VLLM``. Anything the harness reads that
differs between those releases is a ``ByRelease`` table in the module of its concern
(``state``, ``outputs``, ``config``): a base value plus one ``Change`` per release that changed
it, each with a one-line note of what changed. Code asks the table for the value of the
installed release and never compares version strings itself.

A vLLM outside the range is refused with one line listing the supported releases; an explicit
opt-in (``--allow-untested-vllm`` or ``OMNI_CONFORMANCE_ALLOW_UNTESTED_VLLM=1``) runs it anyway,
taking the newest table entries, and the report is marked "untested vLLM".
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Generic, TypeVar

T = TypeVar("T")

SUPPORTED_VLLM: tuple[str, ...] = (
    "0.26.0",
    "0.28.0",
    "0.29.0",
    "0.30.0",
    "0.31.0",
    "0.32.0",
    "0.33.0",
)
ALLOW_UNTESTED_ENV = "OMNI_CONFORMANCE_ALLOW_UNTESTED_VLLM"


class EnvironmentProblem(RuntimeError):
    """The environment cannot run the harness (vLLM missing or an unsupported version)."""


def vllm_version() -> str:
    """The installed vLLM version, or ``EnvironmentProblem`` with a one-line reason."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        raise EnvironmentProblem(
            f"vLLM is not installed: pip install 'vllm=={SUPPORTED_VLLM[-1]}' "
            f"(supported: {', '.join(SUPPORTED_VLLM)})"
        ) from None


def release(version: str) -> tuple[int, int, int]:
    """``"0.30.0"``, ``"0.30.0+cpu"``, ``"0.30.1rc2"`` -> ``(0, 30, 0)`` / ``(0, 30, 1)``."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        raise ValueError(f"not a vLLM version: {version!r}")
    return int(m[1]), int(m[2]), int(m[3] or 0)


def supported_minor(version: str) -> bool:
    """A patch release of a supported minor counts as supported (0.30.1 behaves as 0.30.0)."""
    return release(version)[:2] in {release(v)[:2] for v in SUPPORTED_VLLM}


def untested_allowed() -> bool:
    return os.environ.get(ALLOW_UNTESTED_ENV, "") not in ("", "0", "false", "no")


def check_vllm(*, allow_untested: bool = False) -> str:
    """The installed vLLM version when the harness can run on it; ``EnvironmentProblem`` if not."""
    v = vllm_version()
    if supported_minor(v) or allow_untested or untested_allowed():
        return v
    raise EnvironmentProblem(
        f"vLLM {v} is installed but this harness supports vLLM {', '.join(SUPPORTED_VLLM)} "
        f"(--allow-untested-vllm or {ALLOW_UNTESTED_ENV}=1 runs it anyway, "
        "marking the report 'untested vLLM')"
    )


@cache
def installed_release() -> tuple[int, int, int]:
    return release(vllm_version())


def is_untested() -> bool:
    try:
        return not supported_minor(vllm_version())
    except EnvironmentProblem:
        return True


def environment_versions() -> dict[str, str]:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("vllm", "torch", "hypothesis"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "missing"
    if out["vllm"] != "missing":
        out["vllm_support"] = "untested" if is_untested() else "supported"
    return out


@dataclass(frozen=True)
class Change(Generic[T]):
    """From release ``since`` on, the value is ``value``; ``what`` says in one line what changed."""

    since: str
    value: T
    what: str


class ByRelease(Generic[T]):
    """A value that depends on the vLLM release: ``base`` before the first ``Change``."""

    def __init__(self, name: str, base: T, changes: Sequence[Change[T]] = ()) -> None:
        self.name = name
        self.base = base
        self.changes = tuple(sorted(changes, key=lambda c: release(c.since)))

    def at(self, version: str | tuple[int, int, int]) -> T:
        rel = release(version) if isinstance(version, str) else version
        value = self.base
        for change in self.changes:
            if release(change.since) <= rel:
                value = change.value
        return value

    def value(self) -> T:
        """The value for the installed vLLM (an untested newer release takes the newest).

        Read on every observed step, so it is resolved once per process (the installed
        release cannot change under a running harness)."""
        if not hasattr(self, "_installed"):
            self._installed = self.at(installed_release())
        return self._installed

    def describe(self) -> list[str]:
        return [f"{self.name}: {c.since}: {c.what}" for c in self.changes]

    def __repr__(self) -> str:
        return f"ByRelease({self.name!r}, {len(self.changes)} changes)"


def absent_paths(table: ByRelease[frozenset[str]]) -> frozenset[str]:
    """The paths of a table of recorded field paths that some supported release records and the
    installed one lacks."""
    known = table.base.union(*(c.value for c in table.changes))
    return frozenset(known - table.value())


def introductions(table: ByRelease[frozenset[str]]) -> dict[str, tuple[str, str]]:
    """Each path of a table of recorded field paths -> (the release that added or dropped it,
    that change's note)."""
    out: dict[str, tuple[str, str]] = {}
    before = table.base
    for c in table.changes:
        for path in before ^ c.value:
            out[path] = (c.since, c.what)
        before = c.value
    return out
