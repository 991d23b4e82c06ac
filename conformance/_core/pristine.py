"""The pristine oracle: whether loading a subject left upstream vLLM untouched, and where the
oracle runs when it did not.

A subject that monkeypatches vLLM when imported or built changes the in-process oracle too, and
lock step would then agree with a broken runtime. This module owns the check:

* ``fingerprint()`` — the identity of everything that defines vLLM's scheduler, request,
  KV-cache and output classes and the modules that hold them;
* ``guard_load(label)`` — fingerprints around a load, records what changed and, unless told
  otherwise, raises ``VllmPatched`` naming the subject and the change;
* ``oracle_placement()`` — in process while nothing patched vLLM here, else in a child that
  never loaded the subject (``conformance._core.oracle_process``).

What is fingerprinted and what is deliberately not: docs/design.md, "Inside the gate"; what an
adopter sees: docs/adopting-the-gate.md, "A subject that patches vLLM".
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

# Modules whose classes (all classes they define) and name bindings are fingerprinted.
REQUIRED_MODULES: tuple[str, ...] = (
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.core.sched.async_scheduler",
    "vllm.v1.request",
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.core.block_pool",
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.core.sched.output",
    "vllm.v1.outputs",
    "vllm.v1.engine",
)
# Fingerprinted when this vLLM has them (the coordinator layer is newer than the rest).
OPTIONAL_MODULES: tuple[str, ...] = (
    "vllm.v1.core.kv_cache_coordinator",
    "vllm.v1.core.single_type_kv_cache_manager",
)
# Classes that must exist: a missing one means the fingerprint would silently cover less.
REQUIRED_CLASSES: tuple[str, ...] = (
    "vllm.v1.core.sched.scheduler:Scheduler",
    "vllm.v1.core.sched.async_scheduler:AsyncScheduler",
    "vllm.v1.request:Request",
    "vllm.v1.request:RequestStatus",
    "vllm.v1.core.kv_cache_manager:KVCacheManager",
    "vllm.v1.core.block_pool:BlockPool",
    "vllm.v1.core.kv_cache_utils:FreeKVCacheBlockQueue",
    "vllm.v1.core.kv_cache_utils:KVCacheBlock",
    "vllm.v1.core.sched.output:SchedulerOutput",
    "vllm.v1.outputs:ModelRunnerOutput",
    "vllm.v1.engine:EngineCoreOutput",
    "vllm.v1.engine:EngineCoreOutputs",
)
MAX_LISTED = 6  # changes named in a VllmPatched message before "+N more"


class VllmPatched(RuntimeError):
    """Loading a subject changed vLLM's classes or module bindings (one-line message)."""

    def __init__(self, subject: str, changes: Sequence[str]) -> None:
        self.subject = subject
        self.changes = list(changes)
        shown = ", ".join(self.changes[:MAX_LISTED])
        more = len(self.changes) - MAX_LISTED
        if more > 0:
            shown += f", +{more} more"
        super().__init__(f"subject {subject!r} patched vLLM when loaded: {shown}")


@dataclass
class Fingerprint:
    """Strong references (kept alive, so identities cannot be reused) to what was observed."""

    modules: dict[str, ModuleType] = field(default_factory=dict)
    # module name -> attribute name -> the class or function it named
    bindings: dict[str, dict[str, Any]] = field(default_factory=dict)
    # class label -> (class object, its bases, copy of its __dict__)
    classes: dict[str, tuple[type, tuple[type, ...], dict[str, Any]]] = field(default_factory=dict)


def import_targets() -> list[ModuleType]:
    """Import every fingerprinted module (optional ones only if this vLLM has them)."""
    mods = [importlib.import_module(name) for name in REQUIRED_MODULES]
    for name in OPTIONAL_MODULES:
        try:
            mods.append(importlib.import_module(name))
        except ImportError:
            continue
    for spec in REQUIRED_CLASSES:
        mod, _, attr = spec.partition(":")
        if not inspect.isclass(getattr(sys.modules[mod], attr, None)):
            raise ImportError(f"pristine oracle: {mod}.{attr} is not a class in this vLLM")
    return mods


def _is_binding(value: Any) -> bool:
    return inspect.isclass(value) or inspect.isfunction(value) or inspect.isbuiltin(value)


def _label(cls: type, taken: dict[str, Any]) -> str:
    short = cls.__qualname__
    owner = taken.get(short)
    return short if owner is None or owner[0] is cls else f"{cls.__module__}.{short}"


def fingerprint() -> Fingerprint:
    fp = Fingerprint()
    for mod in import_targets():
        name = mod.__name__
        fp.modules[name] = mod
        fp.bindings[name] = {k: v for k, v in vars(mod).items() if _is_binding(v)}
        for value in fp.bindings[name].values():
            if inspect.isclass(value) and value.__module__ == name:
                label = _label(value, fp.classes)
                fp.classes[label] = (value, value.__bases__, dict(vars(value)))
    return fp


def changes_since(before: Fingerprint) -> list[str]:
    """What differs now from ``before``, each as a short phrase (class first, then modules)."""
    found: list[str] = []
    for label, (cls, bases, members) in before.classes.items():
        now = vars(cls)
        if cls.__bases__ != bases:
            found.append(f"{label}.__bases__ replaced")
        for key, value in members.items():
            if key not in now:
                found.append(f"{label}.{key} deleted")
            elif now[key] is not value:
                found.append(f"{label}.{key} replaced")
        found.extend(f"{label}.{key} added" for key in now if key not in members)
    for name, mod in before.modules.items():
        current = sys.modules.get(name)
        if current is not mod:
            found.append(f"sys.modules[{name!r}] replaced")
            continue
        now_vars = vars(mod)
        for key, value in before.bindings[name].items():
            if key not in now_vars:
                found.append(f"{name}.{key} deleted")
            elif now_vars[key] is not value:
                found.append(f"{name}.{key} rebound")
    return found


@contextmanager
def guard_load(label: str, *, refuse: bool = True) -> Iterator[Fingerprint]:
    """Fingerprint vLLM around the body and record what the body changed.

    With ``refuse`` (the default) a change raises ``VllmPatched``. Without it the change is
    recorded for the process (``note_patched``), so every lock-step session from then on runs
    its oracle in a separate process (``oracle_placement``). An exception from the body
    propagates unchanged (it says more than a fingerprint would).
    """
    before = fingerprint()
    yield before
    changed = changes_since(before)
    if changed:
        note_patched(label, changed)
        if refuse:
            raise VllmPatched(label, changed)


# ---- where the oracle runs -------------------------------------------------------------------
#
# Whether vLLM in *this process* is still upstream is a fact about the process, not about one
# pytest session or one command: once a subject has patched it, no in-process oracle is
# trustworthy again, whoever asks. So it is kept here, once per process.

_PATCHED: dict[str, list[str]] = {}
_ISOLATION_REQUESTED: list[str] = []


def note_patched(label: str, changes: Sequence[str]) -> None:
    """Record that loading ``label`` changed vLLM in this process (``changes`` as phrases)."""
    _PATCHED.setdefault(label, []).extend(changes)


def reset_placement() -> None:
    """Forget recorded patches and requests: only for a caller that has itself put vLLM back
    exactly as it was (the guard's own tests do, and check ``changes_since`` first)."""
    _PATCHED.clear()
    _ISOLATION_REQUESTED.clear()


def isolate_oracle(reason: str) -> None:
    """Run every later oracle in its own process, although vLLM here is pristine (a user's
    choice, ``--oracle process``; the harness's tests use it to check both placements agree)."""
    if reason not in _ISOLATION_REQUESTED:
        _ISOLATION_REQUESTED.append(reason)


@dataclass(frozen=True)
class Placement:
    """Where lock-step sessions run upstream vLLM, and why."""

    isolated: bool
    reason: str

    def describe(self) -> str:
        if not self.isolated:
            return "in process"
        return f"in a separate process ({self.reason})"

    def report_value(self) -> str:
        return "in-process" if not self.isolated else f"separate process: {self.reason}"


def oracle_placement() -> Placement:
    """In process while vLLM here is pristine; in a separate process once a subject patched it
    (or isolation was asked for)."""
    if _PATCHED:
        label, changes = next(iter(_PATCHED.items()))
        shown = ", ".join(changes[:3]) + (f", +{len(changes) - 3} more" if len(changes) > 3 else "")
        return Placement(True, f"loading subject {label!r} patched vLLM here: {shown}")
    if _ISOLATION_REQUESTED:
        return Placement(True, _ISOLATION_REQUESTED[0])
    return Placement(False, "vLLM in this process is unpatched")


def require_oracle_in_process(what: str) -> None:
    """Raise ``NotApplicable`` when ``what`` needs upstream's live objects in this process (it
    hands both sides the same executor, say) and the oracle runs in its own process."""
    placement = oracle_placement()
    if placement.isolated:
        from conformance._core.capabilities import NotApplicable

        raise NotApplicable(
            f"{what} needs the oracle in this process; it runs {placement.describe()}"
        )
