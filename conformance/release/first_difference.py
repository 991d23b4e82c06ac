"""The first difference between two releases' runs of one workload, and the behaviour changes
such differences make: what ``release-diff`` reports and what its cross-release shrinker keeps.

An observation is walked field by field in a fixed order (``SECTION_ORDER``, ``FIELD_ORDER``);
the first differing leaf, with request ids replaced by ``*`` in its path (``pattern_of``) and the
kind of operation after which it showed, names the change. A field one release lacks (its
recording's ``absent_fields``, paths in which ``*`` stands for any key or list position) is not
compared: a release that adds a field to a class differs by it in every run that records it, which
says nothing about that run and would hide what differs after it (``release_diff`` reports each
such field once, with where the other release records it).
"""

from __future__ import annotations

import functools
import itertools
import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from conformance.release.record import MODES, Recording


def _short(value: Any, limit: int = 90) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# The order fields are walked in within one observation: what the scheduler decided, what the
# client received, then the state behind it. "First field" means first in this order.
SECTION_ORDER = (
    "exception",
    "sched_out",
    "outputs",
    "updated",
    "result",
    "requests",
    "queues",
    "block_pool",
    "audit",
)
# Within a section, the fields that say most come first (what was scheduled before which
# blocks it got; a request's status before its blocks); fields not named follow, sorted.
FIELD_ORDER: dict[tuple[str, ...], tuple[str, ...]] = {
    ("sched_out",): (
        "num_scheduled_tokens",
        "scheduled_new",
        "scheduled_cached",
        "preempted",
        "resumed",
        "finished",
        "total_tokens",
        "num_computed_tokens",
        "num_output_tokens",
        "block_ids",
    ),
    ("outputs", "*"): ("new_token_ids", "finish_reason", "stop_reason", "prefill_stats"),
    ("requests", "*"): (
        "status",
        "num_computed_tokens",
        "output_token_ids",
        "num_output_placeholders",
        "num_in_flight_tokens",
        "num_stale_output_tokens",
        "drop_stale_output",
        "num_preemptions",
        "stop_reason",
        "block_ids",
    ),
    ("queues",): ("waiting", "running"),
    ("block_pool",): ("num_free", "ref_counts", "free_order", "num_cached_hashes"),
}
# How many further differing fields of the shortest run's differing step a change lists.
OTHER_FIELDS = 12
ABSENT_MARK = "<absent>"


_ABSENT: Any = object()
_REQUEST_KEYED = ("requests", "outputs")


@dataclass
class FirstDifference:
    workload: str
    mode: str
    step: int  # index of the operation (drain steps included) after which the runs differ
    op: str  # that operation, as described in the recording
    op_kind: str
    path: str
    pattern: str
    a: Any
    b: Any
    # The further fields that differ after the same operation (at most ``OTHER_FIELDS``).
    also: list[str] = field(default_factory=list)

    @property
    def length(self) -> int:
        """Operations in the shortest prefix of the run that shows this difference."""
        return self.step + 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Change:
    id: str
    pattern: str
    op_kind: str
    differences: list[FirstDifference]
    shortest: FirstDifference
    trace: str | None = None  # the written trace, relative to the report folder
    # How the trace was made (``release_shrink.ShrinkOutcome.to_dict``): found and written
    # lengths, and whether it was shrunk against both releases or only cut.
    shrink: dict[str, Any] | None = None

    @property
    def summary(self) -> str:
        s = self.shortest
        runs = len(self.differences)
        workloads = len({d.workload for d in self.differences})
        modes = "/".join(m for m in MODES if any(d.mode == m for d in self.differences))
        return (
            f"{self.pattern} after {self.op_kind}: {workloads} workload(s), {runs} run(s) "
            f"[{modes}]; shortest {s.length} ops ({s.workload} {s.mode}, {s.path}: "
            f"{_short(s.a)} -> {_short(s.b)})" + self._trace_text()
        )

    def _trace_text(self) -> str:
        if not self.trace:
            return ""
        how = self.shrink or {}
        if how.get("status") == "shrunk":
            return f"; trace {self.trace} (shrunk {how['found_length']} -> {how['length']} ops)"
        if how.get("status") in ("not reproduced", "failed"):
            return f"; trace {self.trace} (cut, not shrunk: {how['status']})"
        return f"; trace {self.trace} (cut)"

    def to_dict(self) -> dict[str, Any]:
        modes = sorted({d.mode for d in self.differences}, key=MODES.index)
        return {
            "id": self.id,
            "pattern": self.pattern,
            "op_kind": self.op_kind,
            "workloads": sorted({d.workload for d in self.differences}),
            "runs": len(self.differences),
            "modes": modes,
            "shortest": {**self.shortest.to_dict(), "length": self.shortest.length},
            "trace": self.trace,
            "shrink": self.shrink,
            "summary": self.summary,
        }


def _natural(key: str) -> tuple[Any, ...]:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key))


def _ordered_keys(keys: set[str], segs: tuple[str, ...]) -> list[str]:
    if not segs:
        first: Sequence[str] = SECTION_ORDER
    else:
        first = FIELD_ORDER.get(tuple(pattern_of(segs).split(".")), ())
    known = [k for k in first if k in keys]
    return known + sorted(keys - set(known), key=_natural)


def _matches(pattern: tuple[str, ...], segs: Sequence[str]) -> bool:
    return len(pattern) == len(segs) and all(
        p in ("*", s) for p, s in zip(pattern, segs, strict=True)
    )


@functools.cache
def _patterns(absent: frozenset[str]) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(p.split(".")) for p in sorted(absent))


def is_absent(absent: frozenset[str], segs: Sequence[str]) -> bool:
    """Whether the field at ``segs`` is one of ``absent`` (exact paths or ``*`` patterns)."""
    return ".".join(segs) in absent or any(_matches(p, segs) for p in _patterns(absent))


def _below(patterns: Sequence[tuple[str, ...]], segs: Sequence[str]) -> list[tuple[str, ...]]:
    """What is left of each pattern that reaches past ``segs`` through it."""
    n = len(segs)
    return [p[n:] for p in patterns if len(p) > n and _matches(p[:n], segs)]


def _strip(value: Any, tails: Sequence[tuple[str, ...]]) -> Any:
    """``value`` without the fields ``tails`` name (``*``: any key or list position)."""
    if not tails:
        return value
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if any(len(t) == 1 and t[0] in ("*", k) for t in tails):
                continue
            out[k] = _strip(v, [t[1:] for t in tails if len(t) > 1 and t[0] in ("*", k)])
        return out
    if isinstance(value, list):
        inner = [t[1:] for t in tails if len(t) > 1 and t[0] == "*"]
        return [_strip(v, inner) for v in value] if inner else value
    return value


def iter_field_differences(
    a: Any,
    b: Any,
    absent_a: frozenset[str] = frozenset(),
    absent_b: frozenset[str] = frozenset(),
    segs: tuple[str, ...] = (),
) -> Iterator[tuple[tuple[str, ...], Any, Any]]:
    """(path segments, value in A, value in B) of every differing leaf, in walk order; a field
    a recording's release lacks (its ``absent_fields``) is skipped where that release lacks it.
    Lists are leaves: a field a release lacks inside list items (KV events' attributes) is left
    out of the other release's items before they are compared."""
    if a == b:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for k in _ordered_keys(set(a) | set(b), segs):
            path = (*segs, k)
            va, vb = a.get(k, _ABSENT), b.get(k, _ABSENT)
            if (va is _ABSENT and is_absent(absent_a, path)) or (
                vb is _ABSENT and is_absent(absent_b, path)
            ):
                continue
            yield from iter_field_differences(va, vb, absent_a, absent_b, path)
        return
    if isinstance(a, list) or isinstance(b, list):
        tails_a, tails_b = _below(_patterns(absent_b), segs), _below(_patterns(absent_a), segs)
        if tails_a or tails_b:
            a, b = _strip(a, tails_a), _strip(b, tails_b)
            if a == b:
                return
    yield segs, (ABSENT_MARK if a is _ABSENT else a), (ABSENT_MARK if b is _ABSENT else b)


def absent_values(
    step: Any, absent: frozenset[str], segs: tuple[str, ...] = ()
) -> Iterator[tuple[str, Any]]:
    """(pattern, value) of every field of one observation that ``absent`` names: what a release
    records of the fields the other lacks."""
    tails = _below(_patterns(absent), segs) if segs else list(_patterns(absent))
    if not tails:
        return
    if isinstance(step, dict):
        items: Iterator[tuple[str, Any]] = iter(step.items())
    elif isinstance(step, list):
        items = ((str(i), v) for i, v in enumerate(step))
    else:
        return
    for k, v in items:
        here = [t for t in tails if t[0] in ("*", k)]
        if any(len(t) == 1 for t in here):
            path = (*segs, k)
            yield next(".".join(p) for p in _patterns(absent) if _matches(p, path)), v
        elif here:
            yield from absent_values(v, absent, (*segs, k))


def pattern_of(segs: Sequence[str]) -> str:
    """The field path with request ids replaced by ``*``."""
    out = list(segs)
    if len(out) >= 2 and out[0] in _REQUEST_KEYED:
        out[1] = "*"
    elif len(out) >= 3 and out[0] == "sched_out":
        out[2] = "*"
    return ".".join(out)


def op_kind(description: str) -> str:
    m = re.match(r"[a-z_]+", description)
    return m.group(0) if m else description


# The field path of a workload whose scheduler axis one release runs and the other cannot.
AXIS_CHANGE = "__axis__"


def first_difference(
    name: str,
    mode: str,
    run_a: Mapping[str, Any],
    run_b: Mapping[str, Any],
    absent_a: frozenset[str],
    absent_b: frozenset[str],
) -> FirstDifference | None:
    na_a, na_b = run_a.get("not_applicable"), run_b.get("not_applicable")
    if na_a is not None or na_b is not None:
        # An axis one release cannot run: no behaviour to compare when neither runs it; when
        # one does, what changed is that the release gained (or lost) the axis.
        if na_a is not None and na_b is not None:
            return None
        a_val = "not applicable" if na_a is not None else "runs"
        b_val = "not applicable" if na_b is not None else "runs"
        return FirstDifference(
            name, mode, 0, "(axis)", "axis", AXIS_CHANGE, AXIS_CHANGE, a_val, b_val
        )
    ops_a, ops_b = run_a["ops"], run_b["ops"]
    steps_a, steps_b = run_a["steps"], run_b["steps"]
    for i in range(max(len(steps_a), len(steps_b))):
        if i >= len(steps_a) or i >= len(steps_b):
            op = ops_b[i] if i >= len(steps_a) else ops_a[i]
            a_val = "ended" if i >= len(steps_a) else "continues"
            b_val = "ended" if i >= len(steps_b) else "continues"
            return FirstDifference(
                name, mode, i, op, op_kind(op), "__end__", "__end__", a_val, b_val
            )
        if ops_a[i] != ops_b[i]:
            return FirstDifference(
                name, mode, i, ops_a[i], op_kind(ops_a[i]), "__op__", "__op__", ops_a[i], ops_b[i]
            )
        found = iter_field_differences(steps_a[i], steps_b[i], absent_a, absent_b)
        for segs, va, vb in found:
            also = [".".join(p) for p, _, _ in itertools.islice(found, OTHER_FIELDS)]
            return FirstDifference(
                name,
                mode,
                i,
                ops_a[i],
                op_kind(ops_a[i]),
                ".".join(segs),
                pattern_of(segs),
                va,
                vb,
                also,
            )
    return None


# (``release_shrink.ShrinkOutcome.to_dict``).
TraceMaker = Callable[[Change, Any], tuple[Any, dict[str, Any]]]


@dataclass
class DiffResult:
    """The comparison. ``a`` and ``b`` carry the headers; their ``workloads`` hold only the
    workloads that differ, without their observations (what the traces and report need)."""

    a: Recording
    b: Recording
    runs: list[tuple[str, str, FirstDifference | None]] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)
    workloads: int = 0
    # With which releases' interpreters the traces were shrunk (None: they were cut).
    shrink: dict[str, Any] | None = None
    # Each field one release lacks -> where the other records it (``release_diff.FieldTally``).
    one_sided: dict[str, Any] = field(default_factory=dict)

    @property
    def differences(self) -> list[FirstDifference]:
        return [d for _, _, d in self.runs if d is not None]

    @property
    def identical(self) -> bool:
        return not self.differences
