"""The suite's pytest glue: loads the omni-conformance plugin for ``pytest -m invariants`` even when
its ``pytest11`` entry point is not installed (a source checkout, or before the first pip
install); pins torch to one thread; parametrizes ``feature`` with the subject's own features;
reports a check whose capability the subject does not provide as skipped ("not applicable"),
with the reason.

``pytest_addoption`` is a historic hook, so registering the plugin here still gives it its
command-line options; when the entry point already loaded it, nothing happens.

A pytest process that hashes strings at random (no ``PYTHONHASHSEED`` when it started: plain
``pytest -m invariants`` without ``-n``, or the README's test command in a shell without it)
starts itself again with ``PYTHONHASHSEED=0``, as ``omni-conformance check`` does, when pytest
configures, before anything runs: vLLM frees the blocks of a multi-id abort
in ``set`` order, so without it the examples the suite runs are not the ones the gate runs.
"""

import os
import sys

from conformance._core import hash_seed


def _restart_with_pinned_hash_seed(config: object) -> None:
    """Run this pytest command again under the fixed hash seed when this interpreter hashes at
    random. Not inside a running test (an in-process ``pytest.main`` must not replace its host),
    not in an xdist worker (it inherits the controller's seed).

    pytest captures file descriptors 1 and 2 while it loads conftest files, and an exec'd
    process keeps the descriptors it inherits: the capture is stopped first, or the new run
    would write its whole output into the old run's capture files and show nothing."""
    if not hash_seed.hashes_at_random():
        return
    if os.environ.get("PYTEST_CURRENT_TEST") or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    argv = list(getattr(sys, "orig_argv", ()))[1:]
    if not argv:
        return
    capture = config.pluginmanager.getplugin("capturemanager")  # type: ignore[attr-defined]
    if capture is not None:
        capture.stop_global_capturing()
    hash_seed.restart_pinned(argv)


import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")

# Two xdist workers on two cores: torch's default of one thread per core makes each worker's tiny
# ops wait for the other's (measured: a 2 s property took 100 s).
torch.set_num_threads(1)


def pytest_addoption(parser, pluginmanager):
    import conformance.plugin as plugin

    if not pluginmanager.is_registered(plugin):
        pluginmanager.register(plugin, "omni_conformance")


_SUBJECT = pytest.StashKey[object]()


def collection_subject(config):
    """The subject the run names, loaded once per process for parametrization."""
    if _SUBJECT not in config.stash:
        from conformance._core.subjects import load_subject
        from conformance.plugin import SubjectLoadError

        spec = str(config.getoption("conformance_subject"))
        try:
            config.stash[_SUBJECT] = load_subject(spec)
        except (LookupError, ImportError, AttributeError, TypeError, SyntaxError) as exc:
            raise SubjectLoadError(spec, exc) from exc
    return config.stash[_SUBJECT]


def pytest_generate_tests(metafunc):
    if "feature" in metafunc.fixturenames:
        from conformance._core.needs import features_of
        from conformance.plugin import SPREAD_PROFILES, profile_name

        marker = metafunc.definition.get_closest_marker("features")
        kwargs = {} if marker is None else marker.kwargs
        found = features_of(collection_subject(metafunc.config), worker=kwargs.get("worker"))
        cells = kwargs.get("spread")
        if cells is None:
            metafunc.parametrize("feature", found, ids=[f.name for f in found])
            return
        # `spread=(argnames, [(values, id), ...])`: the test's own cells, crossed with the
        # features, or under a pull-request profile each cell with one feature in turn. The turn
        # advances per cell and per argument set, so every feature meets every mode.
        names, params = cells
        spread = profile_name(metafunc.config) in SPREAD_PROFILES
        rows = []
        for i, (values, ident) in enumerate(params):
            chosen = [found[(i + i // len(found)) % len(found)]] if spread else found
            rows += [pytest.param(*values, f, id=f"{f.name}-{ident}") for f in chosen]
        metafunc.parametrize((*names, "feature"), rows)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # Before anything runs (and before pytest-xdist starts workers, in the session start).
    _restart_with_pinned_hash_seed(config)
    config.addinivalue_line(
        "markers", "features(worker=None): parametrize `feature` with the subject's features"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    from conformance._core.capabilities import CheckNotRun, NotApplicable
    from conformance.plugin import NOT_RUN_PREFIX

    try:
        return (yield)
    except NotApplicable as exc:
        pytest.skip(f"not applicable: {exc}")
    except CheckNotRun as exc:
        pytest.fail(f"{NOT_RUN_PREFIX}{exc}", pytrace=False)
