"""The one fixed string-hash seed of every process the gate runs or compares.

vLLM frees the blocks of a multi-id abort in ``set`` order, so step counts depend on
``PYTHONHASHSEED``; an oracle in its own process and xdist workers must hash as the parent does.
Every entry point (``omni-conformance``, the pytest conftests, the mutation campaign) pins the
seed through this module; shell scripts and CI files set nothing themselves.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

VARIABLE = "PYTHONHASHSEED"
SEED = "0"


def chosen() -> bool:
    """Whether the environment fixes the seed (any value the caller chose counts)."""
    return os.environ.get(VARIABLE, "random") not in ("", "random")


def hashes_at_random() -> bool:
    """This interpreter hashes strings at random: its seed was not fixed when it started. (The
    variable may read ``SEED`` all the same: ``pin_for_children`` sets it for children only.)
    A non-zero seed the caller chose counts as fixed."""
    seed = os.environ.get(VARIABLE, "random")
    return bool(sys.flags.hash_randomization) and seed in ("", "random", SEED)


def this_process_uses_seed() -> bool:
    """Whether this interpreter hashes strings with ``SEED`` (read from the interpreter: the
    variable may have been set for children after it started)."""
    return sys.flags.hash_randomization == 0


def pinned(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the seed fixed, unless the caller chose one."""
    out = dict(os.environ if env is None else env)
    if out.get(VARIABLE, "random") in ("", "random"):
        out[VARIABLE] = SEED
    return out


def pin_for_children() -> None:
    """Fix the seed for every child this process starts from now on (xdist workers included)."""
    os.environ.update(pinned())


def restart_pinned(argv: Sequence[str]) -> None:
    """Replace this process with ``python argv...`` under the fixed seed, when it hashes at random
    (a command line run by hand); return when the seed is already fixed."""
    if not hashes_at_random():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], pinned())
