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


def _discard_frames(request: Any) -> tuple[Any, ...]:
    return (request.async_tokens_to_discard,)


def _stale_tokens(request: Any) -> tuple[Any, ...]:
    return (request.num_stale_output_tokens, request.drop_stale_output)


_READERS: dict[tuple[str, ...], Callable[[Any], tuple[Any, ...]]] = {
    ("async_tokens_to_discard",): _discard_frames,
    ("num_stale_output_tokens", "drop_stale_output"): _stale_tokens,
}


def stale_fields() -> tuple[str, ...]:
    """The installed release's stale-output field names (snapshot keys, attribute names)."""
    return STALE_FIELDS.value()


def stale_row() -> Callable[[Any], tuple[Any, ...]]:
    """A reader of ``stale_fields()`` off one request, as a tuple in that order."""
    return _READERS[STALE_FIELDS.value()]


def has_stale(request: Any) -> bool:
    """Whether the request still has stale in-flight output to drain (its first field)."""
    return bool(stale_row()(request)[0])


def stale_in_fields(fields: Mapping[str, Any]) -> bool:
    """``has_stale`` of a request read from its snapshot fields (``request_fields``)."""
    return bool(fields[stale_fields()[0]])


def _check_readers() -> None:
    """Every release's field tuple needs its reader: refuse to import otherwise."""
    tables = [STALE_FIELDS.base, *(c.value for c in STALE_FIELDS.changes)]
    missing = [names for names in tables if names not in _READERS]
    if missing:
        raise AssertionError(f"no stale-output reader for {missing}")


_check_readers()
