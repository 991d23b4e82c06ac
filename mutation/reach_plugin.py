"""pytest plugin of the mutation campaign's reach run: which test executes which runtime line.

Loaded (``-p reach_plugin``) only in the campaign's work folder, for one run of the suite with no
mutant active. It measures line coverage with one coverage.py context per test (the test's node
id), and each test's wall clock. Lines run in a process the test starts through multiprocessing
(a stage engine in a process of its own) count for the test too: the configuration file
(``OMNI_REACH_RCFILE``) expands ``${OMNI_REACH_CONTEXT}`` into the static context, and this
plugin sets that variable around each test, so a child started during the test inherits it. In
the test's own process the plugin switches the dynamic context instead.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import coverage
import pytest

_ENV = "OMNI_REACH_CONTEXT"
_cov: coverage.Coverage | None = None
_seconds: dict[str, float] = {}  # each test's wall clock in this run (the re-check's timeouts)


def pytest_configure(config: pytest.Config) -> None:
    global _cov
    rcfile = os.environ.get("OMNI_REACH_RCFILE")
    controller = getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput")
    if rcfile is None or controller:
        return  # xdist's controller runs no test: only its workers measure
    os.environ[_ENV] = ""
    _cov = coverage.Coverage(config_file=rcfile, data_suffix=True)
    _cov.start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Iterator[None]:
    if _cov is None:
        yield
        return
    os.environ[_ENV] = item.nodeid
    _cov.switch_context(item.nodeid)
    start = time.monotonic()
    try:
        yield
    finally:
        _seconds[item.nodeid] = time.monotonic() - start
        os.environ[_ENV] = ""
        _cov.switch_context("")


def pytest_unconfigure(config: pytest.Config) -> None:
    global _cov
    if _cov is not None:
        _cov.stop()
        _cov.save()
        with open(f"{_cov.config.data_file}.seconds.{os.getpid()}.json", "w") as f:
            json.dump(_seconds, f)
        _cov = None
