"""What the commands share: the hypothesis profiles (``check``, ``matrix``, ``reach``), where the
oracle runs (``check``, ``replay``) and the one line that says so, and where the release's own
tests are cached and how long a run of them may take (``upstream-tests``, ``reach``)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

PROFILES = ("ci", "dev", "thorough", "smoke", "deep")
ORACLE_CHOICES = ("auto", "process")


def place_oracle(choice: str) -> None:
    """Apply ``--oracle`` and say, in one line, when upstream runs in its own process."""
    from conformance._core.pristine import isolate_oracle, oracle_placement

    if choice == "process":
        isolate_oracle("requested by --oracle process")
    placement = oracle_placement()
    if placement.isolated:
        print(f"oracle: upstream vLLM runs {placement.describe()}", flush=True)


def add_release_tests_options(p: argparse.ArgumentParser) -> None:
    """``--cache-dir`` and ``--offline``: where the release's ``tests/v1/core`` are cached."""
    from conformance.release.upstream_tests import CACHE_ENV, default_cache_dir

    p.add_argument(
        "--cache-dir",
        type=Path,
        default=default_cache_dir(),
        help=f"where release tests are cached (vllm-<version>/ inside; ${CACHE_ENV} moves the "
        "whole omni-conformance cache)",
    )
    p.add_argument(
        "--offline",
        action="store_true",
        default=bool(os.environ.get("OMNI_CONFORMANCE_OFFLINE")),
        help="never fetch: use the cache only (exit 2 when the release's tests are not there)",
    )


def add_timeout_option(p: argparse.ArgumentParser) -> None:
    from conformance.release.upstream_tests import DEFAULT_TIMEOUT_S

    p.add_argument(
        "--timeout-s",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="time bound for each pytest run; its process group is killed past it",
    )
