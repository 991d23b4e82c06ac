"""How a request records output that a preemption made stale, per vLLM release.

Under async scheduling a request's next output is in flight when it is preempted. vLLM 0.26
counts, on the request, the in-flight output frames to throw away, and only when
``reset_prefix_cache`` forces the preemption (``async_tokens_to_discard``: the async scheduler
drops one frame per delivery until it reaches 0; an ordinary preemption keeps none). From 0.28
every preemption records its in-flight tokens as stale (``num_stale_output_tokens``, drained
step by step) and whether they are delivered or dropped (``drop_stale_output``).

``stale_row`` reads the release's fields off a request, in the order ``STALE_FIELDS`` names
them; ``state`` puts them in the per-request snapshot (C-01) and compares them pairwise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import cache
from operator import attrgetter
from typing import Any

from conformance._core.vllm_compat.versions import ByRelease, Change

STALE_FIELDS: ByRelease[tuple[str, ...]] = ByRelease(
    "stale-output fields",
    ("async_tokens_to_discard",),
    [
        Change(
            "0.28.0",
            ("num_stale_output_tokens", "drop_stale_output"),
            "async_tokens_to_discard (frames dropped after reset_prefix_cache only) became "
            "num_stale_output_tokens + drop_stale_output, set by every preemption",
        )
    ],
)


def stale_fields() -> tuple[str, ...]:
    """The installed release's stale-output field names (snapshot keys, attribute names)."""
    return STALE_FIELDS.value()


@cache
def stale_row() -> Callable[[Any], tuple[Any, ...]]:
    """A reader of ``stale_fields()`` off one request, as a tuple in that order (made once: it
    is read for every request of every compared step)."""
    names = stale_fields()
    get = attrgetter(*names)
    return get if len(names) > 1 else lambda request: (get(request),)


def has_stale(request: Any) -> bool:
    """Whether the request still has stale in-flight output to drain (its first field)."""
    return bool(stale_row()(request)[0])


def stale_in_fields(fields: Mapping[str, Any]) -> bool:
    """``has_stale`` of a request read from its snapshot fields (``request_fields``)."""
    return bool(fields[stale_fields()[0]])
