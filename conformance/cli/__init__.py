"""``omni-conformance``: the CI gate and its tools.

A command group, one module per command, each with a ``register(sub)`` that adds its parser and
handler: ``check``, ``replay``, ``report``, ``merge``, ``matrix``, ``subjects``, ``record``,
``release-diff``, ``upstream-tests``, ``reach`` (their exit codes are in their modules). This package owns
the group: the parser, ``main`` (the console script) and re-running a real command line with a
fixed ``PYTHONHASHSEED``. The commands' machinery lives in ``conformance._core`` and
``conformance.release``, which never import this package.

Environment problems (vLLM missing, an unsupported vLLM version, an unknown subject, a subject
that cannot be loaded) end with one line on stderr and exit code 2, never a traceback; a usage
error too.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from conformance._core import hash_seed
from conformance._core.processes import Interrupted
from conformance.cli import (
    check,
    matrix,
    merge,
    reach,
    record,
    release_diff,
    replay,
    report,
    subjects,
    upstream_tests,
)

# In the order ``--help`` lists them.
COMMANDS = (
    check,
    replay,
    report,
    merge,
    matrix,
    subjects,
    record,
    release_diff,
    upstream_tests,
    reach,
)


class _Parser(argparse.ArgumentParser):
    """A usage error is one line (and exit 2), like every other bad input to the gate."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="omni-conformance", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return p


def _pin_hash_seed() -> None:
    """Re-run this command under the gate's fixed hash seed unless one is fixed: vLLM frees the
    blocks of a multi-id abort in set order, so step counts (and an oracle in its own process)
    depend on it. Only for a real command line, before anything heavy is imported."""
    hash_seed.restart_pinned(["-m", "conformance.cli", *sys.argv[1:]])


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        _pin_hash_seed()
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except Interrupted as exc:  # a child's group was stopped on this signal
        return 128 + exc.signum
    except KeyboardInterrupt:
        return 130
