"""The pytest plugin that runs vLLM's own scheduler tests against a subject's scheduler classes.

``omni-conformance upstream-tests`` loads it into a child pytest (``-p
conformance.release.upstream_swap``) over an installed release's test files. With
``--upstream-swap-subject SPEC`` it loads that subject in the child and, before every test,
rebinds the names in the release's test modules (``tests.*`` under the rootdir) that refer to
vLLM's ``Scheduler`` or ``AsyncScheduler`` to the subject's sync and async classes. vLLM's own
modules are never touched: the tests' helpers read those module globals when they run, so
rebinding them is enough and the oracle stays pristine. Without the option nothing is rebound
(the baseline). Not rebound, on purpose: a class a test passes explicitly, and a name a test
imports inside its own body. It also supplies ``caplog_vllm``, a fixture of vLLM's root
``conftest.py`` (not run: it needs vLLM's whole test requirements); ``--upstream-swap-record
PATH`` writes which classes were swapped in and which names rebound (JSON), so the caller can
tell a swap that happened from one that silently matched nothing.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SUBJECT_OPTION = "--upstream-swap-subject"
RECORD_OPTION = "--upstream-swap-record"
UPSTREAM_SYNC = ("vllm.v1.core.sched.scheduler", "Scheduler")
UPSTREAM_ASYNC = ("vllm.v1.core.sched.async_scheduler", "AsyncScheduler")


def qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def subject_classes(spec: str) -> tuple[type, type]:
    """The (sync, async) scheduler classes of the subject ``spec``."""
    from conformance._core.config import HarnessConfig
    from conformance._core.subjects import load_subject

    subject = load_subject(spec)
    cfg = HarnessConfig()
    return (
        subject.scheduler_class(cfg.with_(async_scheduling=False)),
        subject.scheduler_class(cfg.with_(async_scheduling=True)),
    )


def upstream_classes() -> tuple[type, type]:
    import importlib

    sync_mod, sync_name = UPSTREAM_SYNC
    async_mod, async_name = UPSTREAM_ASYNC
    return (
        getattr(importlib.import_module(sync_mod), sync_name),
        getattr(importlib.import_module(async_mod), async_name),
    )


class Swapper:
    """Rebinds, in the modules it is shown, every name bound to an upstream class."""

    def __init__(self, replacements: dict[type, type]) -> None:
        # Identity, not equality or subclassing: only the exact upstream classes are replaced,
        # never a vLLM subclass a test picks on purpose.
        self.replacements = {id(old): (old, new) for old, new in replacements.items()}
        self.rebound: set[str] = set()

    def swap_module(self, module: ModuleType) -> list[str]:
        changed = []
        for name, value in list(vars(module).items()):
            hit = self.replacements.get(id(value))
            if hit is None or hit[0] is not value or hit[1] is value:
                continue
            setattr(module, name, hit[1])
            changed.append(f"{module.__name__}.{name}")
        self.rebound.update(changed)
        return changed

    def swap_modules(self, modules: list[ModuleType]) -> list[str]:
        changed: list[str] = []
        for module in modules:
            changed += self.swap_module(module)
        return changed


def release_modules(root: Path, names: dict[str, ModuleType] | None = None) -> list[ModuleType]:
    """Imported modules whose file lies under ``root`` (the release's extracted tests)."""
    return ReleaseModules(root).current(names)


class ReleaseModules:
    """``release_modules``, remembering each module's verdict: the scan runs before every test
    over thousands of imported modules (torch, vLLM), and resolving their paths every time costs
    more than the tests themselves."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self._seen: dict[str, ModuleType | None] = {}

    def _under_root(self, module: ModuleType) -> bool:
        file = getattr(module, "__file__", None)
        if not file:
            return False
        try:
            Path(file).resolve().relative_to(self.root)
        except ValueError:
            return False
        return True

    def current(self, names: dict[str, ModuleType] | None = None) -> list[ModuleType]:
        modules = names if names is not None else sys.modules
        out = []
        for name, module in list(modules.items()):
            known = self._seen.get(name, False)
            if known is False or (known is not None and known is not module):
                known = module if self._under_root(module) else None
                self._seen[name] = known
            if known is not None:
                out.append(known)
        return out


class _SwapPlugin:
    def __init__(self, config: pytest.Config, spec: str) -> None:
        self.config = config
        self.spec = spec
        self.modules = ReleaseModules(Path(str(config.rootpath)))
        sync_cls, async_cls = subject_classes(spec)
        up_sync, up_async = upstream_classes()
        self.classes = {"sync": sync_cls, "async": async_cls}
        self.swapper = Swapper({up_sync: sync_cls, up_async: async_cls})

    def _swap(self) -> None:
        self.swapper.swap_modules(self.modules.current())

    # Test modules are imported at collection; helpers a test imports inside its body are
    # imported later, so the scan runs again before every test (a few dozen dict lookups).
    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._swap()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        self._swap()

    def record(self) -> dict[str, Any]:
        return {
            "subject": self.spec,
            "sync": qualname(self.classes["sync"]),
            "async": qualname(self.classes["async"]),
            "rebound": sorted(self.swapper.rebound),
        }


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("upstream-swap", "run vLLM's scheduler tests on a subject's classes")
    group.addoption(
        SUBJECT_OPTION,
        default=None,
        help="subject whose scheduler classes replace vLLM's in the test modules "
        "(default: none, upstream's own classes)",
    )
    group.addoption(
        RECORD_OPTION,
        default=None,
        help="write the swapped classes and rebound names here as JSON (default: none)",
    )


def pytest_configure(config: pytest.Config) -> None:
    spec = config.getoption(SUBJECT_OPTION)
    if not spec:
        return
    try:
        plugin = _SwapPlugin(config, spec)
    except Exception as exc:  # any failure to load the subject is a usage problem of this run
        detail = " ".join(str(exc).split()) or "no message"
        raise pytest.UsageError(
            f"cannot load subject {spec!r}: {type(exc).__name__}: {detail}"
        ) from None
    config.pluginmanager.register(plugin, "upstream-swap")


def pytest_unconfigure(config: pytest.Config) -> None:
    path = config.getoption(RECORD_OPTION)
    if not path:
        return
    plugin = config.pluginmanager.get_plugin("upstream-swap")
    record = plugin.record() if isinstance(plugin, _SwapPlugin) else {"subject": None}
    Path(path).write_text(json.dumps(record, indent=1) + "\n")


@pytest.fixture()
def caplog_vllm(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """vLLM's log records in ``caplog`` (INFO and up).

    vLLM's logger does not propagate to the root logger, where ``caplog`` listens; let it for
    the duration of the test.
    """
    logger = logging.getLogger("vllm")
    saved = logger.propagate
    logger.propagate = True
    try:
        with caplog.at_level(logging.INFO):
            yield caplog
    finally:
        logger.propagate = saved
