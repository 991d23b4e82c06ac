"""The oracle stays upstream: loading a subject that patches vLLM is noticed.

The harness runs upstream vLLM and the subject in one process when it can. A subject module that
replaces ``Scheduler.schedule`` (or rebinds a name vLLM's scheduler module imported) changes the
in-process oracle too, and every comparison would then agree with the broken runtime.
``conformance._core.pristine`` fingerprints vLLM's scheduler, request, KV-cache and output classes
around loading a subject; these tests plant such a subject in a temporary folder (restoring vLLM
afterwards, so the rest of the run stays pristine) and check the change is named precisely
(``guard_load`` refuses with one line when asked to) and that the pytest plugin then places the
oracle in its own process — while upstream and this project's runtime, which only subclass, load
cleanly. ``tests/test_oracle_process.py`` checks the isolated oracle itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance._core import pristine
from conformance._core.config import HarnessConfig, build_scheduler
from conformance._core.pristine import VllmPatched, guard_load
from conformance._core.subjects import load_subject

pytestmark = pytest.mark.clauses("C-01")
ROOT = Path(__file__).resolve().parents[1]

PATCHING_SCHEDULE = """
from vllm.v1.core.sched.scheduler import Scheduler

from conformance._core.subjects import UpstreamSubject

_original = Scheduler.schedule


def schedule(self):
    return _original(self)


Scheduler.schedule = schedule
subject = UpstreamSubject()
"""

REBINDING_MANAGER = """
import vllm.v1.core.sched.scheduler as sched_module
from vllm.v1.core.kv_cache_manager import KVCacheManager

from conformance._core.subjects import UpstreamSubject


class QuietManager(KVCacheManager):
    pass


sched_module.KVCacheManager = QuietManager
subject = UpstreamSubject()
"""


def _refused(spec: str) -> VllmPatched:
    # load_subject may guard itself; either way the outer guard sees a patched vLLM.
    with pytest.raises(VllmPatched) as info, guard_load(spec):
        load_subject(spec)
    return info.value


# ---- what must load cleanly -------------------------------------------------------------


def test_fingerprint_covers_the_scheduler_request_kv_cache_and_output_classes():
    fp = pristine.fingerprint()
    covered = {(cls.__module__, cls.__name__) for cls, _, _ in fp.classes.values()}
    for spec in pristine.REQUIRED_CLASSES:
        module, _, name = spec.partition(":")
        assert (module, name) in covered, spec
    coordinators = {n for m, n in covered if m.endswith("kv_cache_coordinator")}
    assert {"UnitaryKVCacheCoordinator", "HybridKVCacheCoordinator"} <= coordinators
    # The names the scheduler module imported are bindings too (rebinding one is a patch).
    assert "KVCacheManager" in fp.bindings["vllm.v1.core.sched.scheduler"]


def test_upstream_and_this_projects_runtime_do_not_trip_the_guard():
    with guard_load("upstream"):
        up = load_subject("upstream")
        up.build_scheduler(HarnessConfig())
        up.build_scheduler(HarnessConfig(async_scheduling=True))
    with guard_load("omni_runtime"):
        import omni_runtime.platform  # noqa: F401
        import omni_runtime.sched
        import omni_runtime.worker  # noqa: F401

        build_scheduler(omni_runtime.sched.OmniARScheduler, HarnessConfig())
        build_scheduler(
            omni_runtime.sched.OmniARAsyncScheduler, HarnessConfig(async_scheduling=True)
        )
    with guard_load("omni"):
        load_subject("omni")


# ---- what must be refused ---------------------------------------------------------------


def test_a_subject_that_replaces_a_scheduler_method_is_refused(planted):
    spec = planted(PATCHING_SCHEDULE)
    exc = _refused(spec)
    msg = str(exc)
    assert msg.startswith(f"subject {spec!r} patched vLLM when loaded: ")
    assert "Scheduler.schedule replaced" in msg
    assert "\n" not in msg
    assert exc.changes == ["Scheduler.schedule replaced"]


def test_a_subject_that_rebinds_a_name_the_scheduler_imported_is_refused(planted):
    exc = _refused(planted(REBINDING_MANAGER))
    assert "vllm.v1.core.sched.scheduler.KVCacheManager rebound" in str(exc)


def test_a_long_list_of_changes_stays_one_capped_line():
    exc = VllmPatched("m:s", [f"Scheduler.m{i} replaced" for i in range(9)])
    msg = str(exc)
    assert "\n" not in msg and msg.endswith(", +3 more")
    assert "Scheduler.m5 replaced" in msg and "Scheduler.m6 replaced" not in msg


def _env(tmp_path: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "PYTHONHASHSEED": "0",
        "HF_HUB_OFFLINE": "1",
    }


def test_the_plugin_loads_a_patching_subject_and_isolates_the_oracle(planted, tmp_path):
    spec = planted(PATCHING_SCHEDULE)
    (tmp_path / "test_uses_subject.py").write_text(
        "from conformance._core.pristine import oracle_placement\n\n\n"
        "def test_uses_subject(conformance_subject):\n"
        "    placement = oracle_placement()\n"
        "    assert placement.isolated, placement\n"
        "    assert 'Scheduler.schedule replaced' in placement.reason, placement\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "-q",
            "--conformance-subject",
            spec,
            "test_uses_subject.py",
        ],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "1 passed" in out
