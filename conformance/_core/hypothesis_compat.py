"""The one place the gate reaches into hypothesis's internals: emptying its local-constants pool,
and seeding the search of a shard of a sharded run (``seed_search``).

Since the 6.13x releases hypothesis draws, about once in twenty draws, literals it collects from
the project's non-test modules that happen to be imported. Which modules those are differs
between ``omni-conformance check``, ``pytest -m invariants`` from a checkout, each xdist worker and
a non-editable install, so one derandomized profile would generate different examples in each.
With the pool empty, the examples depend only on hypothesis's version (pinned by the gate) and
the profile. The change is made only on releases up to the pinned one, whose internals were read
for it; on a newer release nothing is patched and the report says the pool is on.
"""

from __future__ import annotations

from typing import Any

# The newest hypothesis release whose ``providers`` module was checked for the names used below:
# the gate's pin (pyproject.toml). A newer release must be checked before this is raised.
CHECKED_UP_TO = (6, 155, 2)

_frozen = False


def version() -> tuple[int, ...]:
    from hypothesis.version import __version_info__

    return tuple(__version_info__)


def freeze_local_constants() -> bool:
    """Empty hypothesis's local-constants pool for this process; whether it is now empty (False on
    a release newer than ``CHECKED_UP_TO``, or one without the pool)."""
    global _frozen
    if version() > CHECKED_UP_TO:
        return _frozen
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # older releases kept their internals elsewhere and had no pool
        return _frozen
    if not hasattr(providers, "_get_local_constants") or not hasattr(providers, "Constants"):
        return _frozen
    empty: Any = providers.Constants()
    providers._get_local_constants = lambda: empty  # type: ignore[attr-defined]
    cache = getattr(providers, "CONSTANTS_CACHE", None)
    if cache is not None and hasattr(cache, "cache"):
        cache.cache.clear()  # anything cached from a pool read before the freeze
    _frozen = True
    return True


def local_constants_frozen() -> bool:
    """Whether ``freeze_local_constants`` took effect in this process (the report records it)."""
    return _frozen


def seed_search(seed: int) -> bool:
    """Seed the random source hypothesis draws each non-derandomized test's seed from, so one
    shard of a sharded run (``check --ray``) searches the same examples wherever it runs. Unlike
    ``--hypothesis-seed`` this keeps the example database in use (hypothesis turns the database
    off under a forced seed), so a failure saved by one shard is replayed first by the next run.
    Whether it took effect (False on a release newer than ``CHECKED_UP_TO``)."""
    if version() > CHECKED_UP_TO:
        return False
    from random import Random

    from hypothesis import core

    local = getattr(core, "threadlocal", None)
    if local is None or not hasattr(local, "_hypothesis_global_random"):
        return False
    local._hypothesis_global_random = Random(seed)
    return True
