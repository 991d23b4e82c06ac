"""``omni-conformance matrix``: the gate per vLLM release x subject, each cell in its own
environment, merged into one report (the cells, environments and merge are
``conformance.release.matrix``'s; the layout is in docs/compat-matrix.md). Exit 0 when every
cell passed, is not applicable or unsupported, 1 otherwise (with ``--release-diff only``: 0 when
every pair of releases was compared); 2 for bad arguments, an unwritable ``--out`` or unreadable
cells; 130 when interrupted (SIGINT, or SIGTERM: a CI job being cancelled), after merging the
cells that finished.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from conformance._core.vllm_compat.versions import SUPPORTED_VLLM, release
from conformance.cli._options import PROFILES
from conformance.release.envs import default_envs_dir, disk_usage
from conformance.release.matrix import (
    RELEASE_DIFF_DIR,
    RELEASE_DIFF_FILE,
    MatrixOptions,
    duration_text,
    merge_into,
    parse_with,
    plan_cells,
    release_changes_of,
    run_matrix,
    run_release_diff,
    supported,
)


@contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (a CI job being cancelled) ends the matrix like Ctrl-C: finished cells stay."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def cmd_matrix(args: argparse.Namespace) -> int:
    def say(line: str) -> None:
        print(line, flush=True)

    try:
        with_ = parse_with(args.with_ or [])
        for v in args.vllm:
            release(v)
    except ValueError as exc:
        print(f"omni-conformance: error: {exc}", file=sys.stderr)
        return 2
    unsupported = [v for v in args.vllm if not supported(v)]
    if unsupported and not args.allow_untested_vllm:
        print(
            f"omni-conformance: error: vLLM {', '.join(unsupported)} not supported by the harness "
            f"(supported: {', '.join(SUPPORTED_VLLM)}); --allow-untested-vllm runs it anyway",
            file=sys.stderr,
        )
        return 2
    opts = MatrixOptions(
        out=Path(args.out),
        envs_dir=Path(args.envs_dir) if args.envs_dir else default_envs_dir(),
        installer=args.installer,
        profile=args.profile,
        workers=args.workers,
        allow_untested=args.allow_untested_vllm,
        upstream_tests=not args.no_upstream_tests,
        resume=args.resume,
        reuse_current=not args.no_reuse_current,
        timeout_s=args.cell_timeout,
        python=args.python,
        release_diff=args.release_diff,
        corpus_seed=args.corpus_seed,
        corpus_size=args.corpus_size,
        corpus_traces=args.corpus_traces,
    )
    if args.corpus_size < 0:
        print(
            f"omni-conformance: error: --corpus-size {args.corpus_size}: must be 0 or more",
            file=sys.stderr,
        )
        return 2
    if args.corpus_traces is not None and not Path(args.corpus_traces).is_dir():
        print(
            f"omni-conformance: error: --corpus-traces {args.corpus_traces}: not a folder",
            file=sys.stderr,
        )
        return 2
    try:
        opts.out.mkdir(parents=True, exist_ok=True)
        probe = opts.out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        print(f"omni-conformance: error: cannot write to --out {opts.out}: {exc}", file=sys.stderr)
        return 2
    cells = [] if opts.release_diff == "only" else plan_cells(args.subject, args.vllm, with_)
    say(
        f"omni-conformance matrix: {len(cells)} cell(s): subjects {', '.join(args.subject)} x "
        f"vLLM {', '.join(sorted(args.vllm, key=release))}; environments in {opts.envs_dir}"
        + (f"; release-diff of {len(args.vllm)} releases" if opts.release_diff else "")
    )
    interrupted = False
    started = time.monotonic()
    with _terminate_as_interrupt():
        try:
            if args.ray:
                from conformance.cluster.ray_matrix import run_matrix_ray

                run_matrix_ray(
                    cells, opts, say, args.ray, args.ray_retries, envs_given=bool(args.envs_dir)
                )
            else:
                run_matrix(cells, opts, say)
            if opts.release_diff:
                run_release_diff(args.vllm, opts, say)
        except KeyboardInterrupt:
            interrupted = True
            say("matrix interrupted: merging the cells finished so far")
    envs = sorted({p for p in opts.envs_dir.glob("vllm-*") if p.is_dir()})
    if envs:
        gib = disk_usage(envs) / 2**30
        say(f"environments: {len(envs)} in {opts.envs_dir}, {gib:.1f} GiB on disk")
    say(f"matrix wall time: {duration_text(time.monotonic() - started)}")
    if (opts.out / "cells").is_dir():
        rc = merge_into(opts.out, say)
    elif opts.release_diff == "only":
        # No cells to merge: the release-diff alone, which succeeded if every pair was compared
        # (a behaviour change between releases is a finding, not a failure of the matrix).
        pairs = release_changes_of(opts.out)
        rc = 0 if pairs and all("report" in p for p in pairs) else 1
        say(f"release-diff: {opts.out / RELEASE_DIFF_DIR / RELEASE_DIFF_FILE}")
    else:
        rc = 1
    return 130 if interrupted else rc


def register(sub: Any) -> None:
    m = sub.add_parser(
        "matrix",
        help="run the gate per vLLM release x subject, each in its own environment",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m.add_argument(
        "--vllm", nargs="+", default=list(SUPPORTED_VLLM), help="vLLM releases (columns)"
    )
    m.add_argument("--subject", nargs="+", default=["upstream"], help="subjects (rows)")
    m.add_argument(
        "--with",
        dest="with_",
        action="append",
        metavar="SUBJECT=REQ",
        help="an extra requirement for SUBJECT's environments; {vllm} becomes the release",
    )
    m.add_argument("--out", default="matrix-report", help="cells and the merged report go here")
    m.add_argument(
        "--envs-dir",
        default=None,
        help=f"where environments are kept (default: ${'OMNI_CONFORMANCE_ENVS'} or "
        "~/.cache/omni-conformance/envs)",
    )
    m.add_argument(
        "--installer", choices=("auto", "uv", "pip"), default="auto", help="uv when available"
    )
    m.add_argument("--python", default=None, help="base interpreter (default: this one)")
    m.add_argument(
        "--profile",
        choices=PROFILES,
        default="ci",
        help="hypothesis profile of every cell's check",
    )
    m.add_argument("-n", "--workers", type=int, default=2, help="pytest-xdist workers per cell")
    m.add_argument(
        "--allow-untested-vllm",
        action="store_true",
        help="accept releases outside the supported range; their cells say 'untested vLLM'",
    )
    m.add_argument(
        "--no-upstream-tests",
        action="store_true",
        help="skip vLLM's own scheduler tests with the subject's classes in each cell",
    )
    m.add_argument("--resume", action="store_true", help="keep cells already finished in --out")
    m.add_argument(
        "--no-reuse-current",
        action="store_true",
        help="build an environment even for the release this interpreter already has",
    )
    m.add_argument(
        "--cell-timeout", type=float, default=3600.0, help="seconds per check / upstream-tests"
    )
    m.add_argument(
        "--release-diff",
        nargs="?",
        const="also",
        choices=("also", "only"),
        default=None,
        help="record upstream's schedulers on a corpus in each release's environment and diff "
        "consecutive releases (after the cells; 'only': without the cells)",
    )
    m.add_argument(
        "--ray",
        metavar="ADDRESS",
        default=None,
        help="run each cell as a Ray task on the cluster at ADDRESS ('auto': the cluster on this "
        "machine, else a local Ray instance); each node builds or reuses the cell's environment "
        "(docs/cluster.md); the release-diff still runs here",
    )
    m.add_argument(
        "--ray-retries", type=int, default=3, help="times Ray runs a cell again whose node died"
    )
    m.add_argument("--corpus-seed", type=int, default=0, help="release-diff corpus seed")
    m.add_argument("--corpus-size", type=int, default=200, help="release-diff generated workloads")
    m.add_argument(
        "--corpus-traces", default=None, help="release-diff: saved traces added to the corpus"
    )
    m.set_defaults(func=cmd_matrix)
