"""Comparison: the first difference between two snapshots that no registry entry tolerates.

Snapshots (``conformance._core.observe``) are compared with ``==`` first, which is C-speed and the
common case; only unequal subtrees are walked, in a fixed order (upstream's keys first, then
keys only the subject has), so the reported first difference is deterministic. Every difference
is offered to the subject's registry; tolerated ones are counted per entry id, the first one no
entry tolerates ends the comparison.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from conformance._core.differences import Registry

_MISSING: Any = object()
_REQUEST_SECTIONS = ("requests", "outputs")


@dataclass
class FieldDifference:
    step: int
    op: str
    path: str
    upstream: Any
    subject: Any
    request_id: str | None = None
    mode: str = "sync"
    not_applicable: tuple[str, ...] = ()

    @property
    def section(self) -> str:
        """The snapshot section the difference is in (``stats``, ``outputs`` ...)."""
        return self.path.split(".", 1)[0]

    @property
    def field(self) -> str:
        """The differing field with its request left open (``field_of``)."""
        return field_of(self.path)

    def headline(self) -> str:
        up, sub = _short(self.upstream), _short(self.subject)
        line = (
            f"first difference at step {self.step} ({self.op}) [{self.mode}]: {self.path}: "
            f"upstream={up} subject={sub}"
        )
        if self.not_applicable:
            line += (
                f" (registry entries {', '.join(self.not_applicable)} name this field but "
                "their condition does not hold)"
            )
        else:
            line += " (no registry entry names this field)"
        return line

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["upstream"] = jsonable(self.upstream)
        d["subject"] = jsonable(self.subject)
        d["not_applicable"] = list(self.not_applicable)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FieldDifference:
        data = dict(d)
        data["not_applicable"] = tuple(data.get("not_applicable", ()))
        return cls(**data)


@dataclass
class Comparison:
    tolerated: dict[str, int] = field(default_factory=dict)
    failure: FieldDifference | None = None


def jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
        return [jsonable(v) for v in items]
    if isinstance(value, bytes):
        return value.hex()[:16]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)


def _short(value: Any, limit: int = 160) -> str:
    text = json.dumps(jsonable(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def iter_differences(
    a: Any, b: Any, segs: tuple[str, ...] = ()
) -> Iterator[tuple[tuple, Any, Any]]:
    if a == b:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for k, va in a.items():
            yield from iter_differences(va, b.get(k, _MISSING), (*segs, str(k)))
        for k, vb in b.items():
            if k not in a:
                yield from iter_differences(_MISSING, vb, (*segs, str(k)))
        return
    yield segs, (None if a is _MISSING else a), (None if b is _MISSING else b)


def request_of(segs: tuple[str, ...]) -> str | None:
    if len(segs) >= 2 and segs[0] in _REQUEST_SECTIONS:
        return segs[1].split("#", 1)[0]
    if len(segs) >= 3 and segs[0] == "sched_out":
        return segs[2]
    return None


def field_of(path: str) -> str:
    """``path`` with the request it names written ``*``: ``requests.r14.output_token_ids`` is
    ``requests.*.output_token_ids``. A shrunk failure is the same failure when it differs in the
    same field: which request meets a defect depends on the workload, not on the defect."""
    segs = path.split(".")
    at = 1 if segs[0] in _REQUEST_SECTIONS else 2 if segs[0] == "sched_out" else None
    if at is None or len(segs) <= at:
        return path
    _, hash_, rest = segs[at].partition("#")
    segs[at] = "*" + hash_ + rest
    return ".".join(segs)


def compare(
    upstream: Mapping[str, Any],
    subject: Mapping[str, Any],
    registry: Registry,
    base_ctx: Mapping[str, Any],
) -> Comparison:
    result = Comparison()
    if upstream == subject:
        return result
    for segs, up, sub in iter_differences(upstream, subject):
        path = ".".join(segs)
        rid = request_of(segs)
        ctx = {**base_ctx, "path": path, "upstream": up, "subject": sub, "request_id": rid}
        judgement = registry.judge(ctx)
        if judgement.tolerated_by is not None:
            result.tolerated[judgement.tolerated_by] = (
                result.tolerated.get(judgement.tolerated_by, 0) + 1
            )
            continue
        result.failure = FieldDifference(
            step=int(base_ctx.get("step", -1)),
            op=str(base_ctx.get("op", "")),
            path=path,
            upstream=up,
            subject=sub,
            request_id=rid,
            mode=str(base_ctx.get("mode", "sync")),
            not_applicable=judgement.matched_but_not_applicable,
        )
        break
    return result
