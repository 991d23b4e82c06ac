"""Loads the omni-conformance pytest plugin for ``pytest -m invariants`` even when its
``pytest11`` entry point is not installed (a source checkout, or before the first pip install).

``pytest_addoption`` is a historic hook, so registering the plugin here still gives it its
command-line options; when the entry point already loaded it, nothing happens.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")


def pytest_addoption(parser, pluginmanager):
    import conformance.plugin as plugin

    if not pluginmanager.is_registered(plugin):
        pluginmanager.register(plugin, "omni_conformance")
