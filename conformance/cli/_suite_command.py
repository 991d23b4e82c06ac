"""The suite's pytest command as ``omni-conformance check`` runs it (``check``, ``reach`` and
each shard of ``check --ray`` build it here)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points


def _plugin_installed() -> bool:
    return any(ep.value == "conformance.plugin" for ep in entry_points(group="pytest11"))


def _has_xdist() -> bool:
    try:
        import xdist  # noqa: F401
    except ImportError:
        return False
    return True


def pytest_command(args: argparse.Namespace, launcher: Sequence[str] = ()) -> list[str]:
    """The suite's pytest command; ``launcher`` replaces ``python -m`` in front of ``pytest``
    (``reach`` runs it under coverage.py that way)."""
    cmd = [*(launcher or (sys.executable, "-m")), "pytest", "-m", "invariants"]
    cmd += ["-p", "no:cacheprovider"]
    if not _plugin_installed():
        cmd += ["-p", "conformance.plugin"]
    # Each check option backs the plugin option of the same last word.
    cmd += ["--conformance-subject", args.subject, "--conformance-profile", args.profile]
    cmd += ["--conformance-report-dir", str(args.report_dir)]
    cmd += ["--conformance-failures-dir", str(args.failures_dir)]
    cmd += ["--conformance-oracle", args.oracle]
    cmd += ["-o", "addopts=", "-rfE", "-v" if not args.quiet else "-q"]
    if args.workers and args.workers > 1 and _has_xdist():
        cmd += ["-n", str(args.workers)]
    cmd += list(args.tests) if args.tests else ["--pyargs", "invariants"]
    cmd += list(args.pytest_args or ())
    return cmd
