"""A sharded check's plan and its merge, with no Ray in them: the suite's tests x seeds as shards,
the example database carried to and from a shard as files, one test's records from several
shards folded into one, and the shards' compat reports turned into the one report a local run
writes (``conformance._core.report.ReportBuilder``, the same builder). ``check --ray``
(``conformance.cluster.ray_check``) runs the shards; docs/cluster.md has the layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conformance._core.report import ReportBuilder, TestRecord

# Profiles whose search does not depend on a seed: one shard per test.
DERANDOMIZED = frozenset({"ci", "smoke"})
DEEP_SEEDS_PER_TEST = 8
# A test's outcome across its shards: the first of these any shard had.
_OUTCOME_ORDER = ("failed", "error", "not_run", "passed", "not_applicable")


@dataclass(frozen=True)
class Shard:
    index: int
    nodeids: tuple[str, ...]  # relative to the folder holding the ``invariants`` package
    seed: int | None  # None: the profile's own (derandomized) search

    @property
    def id(self) -> str:
        return f"s{self.index:04d}"

    @property
    def label(self) -> str:
        first = self.nodeids[0].split("::")[0] if len(self.nodeids) > 1 else self.nodeids[0]
        more = f" ({len(self.nodeids)} tests)" if len(self.nodeids) > 1 else ""
        return first + more + (f" seed {self.seed}" if self.seed is not None else "")

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "nodeids": list(self.nodeids), "seed": self.seed}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Shard:
        return cls(int(d["index"]), tuple(d["nodeids"]), d.get("seed"))


def seeds_for(profile: str, seeds_per_test: int | None) -> int:
    """How many seeds each test runs under: one for a derandomized profile (every seed would
    search the same examples), else ``seeds_per_test`` (deep's default: 8)."""
    if profile in DERANDOMIZED:
        return 1
    if seeds_per_test is not None:
        return max(1, seeds_per_test)
    return DEEP_SEEDS_PER_TEST if profile == "deep" else 1


SHARD_BY = ("file", "test")


def plan_shards(
    nodeids: Sequence[str],
    profile: str,
    base_seed: int,
    seeds_per_test: int | None = None,
    by: str = "file",
) -> list[Shard]:
    """Tests x seeds, in collection order and seed-major (every test's first seed comes first,
    so a run cut short has searched every test). ``by``: a shard holds a test file's tests
    (one pytest start for them: the start, vLLM's import, costs seconds) or one test. Seeds are
    ``base_seed * 1000 + k``."""
    if by not in SHARD_BY:
        raise ValueError(f"shard by {by!r}: expected one of {', '.join(SHARD_BY)}")
    groups: dict[str, list[str]] = {}
    for nodeid in nodeids:
        key = nodeid.split("::")[0] if by == "file" else nodeid
        groups.setdefault(key, []).append(nodeid)
    shards: list[Shard] = []
    for k in range(seeds_for(profile, seeds_per_test)):
        seed = None if profile in DERANDOMIZED else base_seed * 1000 + k
        for members in groups.values():
            shards.append(Shard(len(shards), tuple(members), seed))
    return shards


def pack_folder(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` as relative path -> bytes (an example database to carry)."""
    if not folder.is_dir():
        return {}
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


def unpack_folder(files: Mapping[str, bytes], folder: Path) -> int:
    """Write ``files`` (from ``pack_folder``) under ``folder``; how many were new or changed."""
    changed = 0
    for rel, data in files.items():
        target = (folder / rel).resolve()
        if folder.resolve() not in target.parents:
            raise ValueError(f"database entry outside its folder: {rel}")
        if target.is_file() and target.read_bytes() == data:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        changed += 1
    return changed


def _add_counts(into: dict[str, int], more: Mapping[str, int] | None) -> None:
    for k, v in (more or {}).items():
        into[k] = into.get(k, 0) + int(v)


def fold_records(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One test's records from its shards (one per seed) as one: examples, steps, durations and
    counts summed; the outcome the worst any shard had; the cause, trace and reason of the
    first shard with that outcome."""
    if len(records) == 1:
        return dict(records[0])
    outcomes = [str(r["outcome"]) for r in records]
    worst = min(outcomes, key=lambda o: _OUTCOME_ORDER.index(o) if o in _OUTCOME_ORDER else 0)
    lead = next(r for r in records if r["outcome"] == worst)
    out = dict(lead)
    out["examples"] = sum(int(r.get("examples") or 0) for r in records)
    out["steps_compared"] = sum(int(r.get("steps_compared") or 0) for r in records)
    out["duration"] = sum(float(r.get("duration") or 0.0) for r in records)
    tolerated: dict[str, int] = {}
    exercised: dict[str, int] = {}
    for r in records:
        _add_counts(tolerated, r.get("tolerated"))
        _add_counts(exercised, r.get("exercised"))
    out["tolerated"] = tolerated
    out["exercised"] = exercised
    clauses: set[str] = set()
    for r in records:
        clauses.update(r.get("clauses") or ())
    out["clauses"] = sorted(clauses)
    return out


def merged_report(
    *,
    subject: str,
    profile: str,
    seed: Any,
    environment: Mapping[str, str],
    records: Iterable[Mapping[str, Any]],
    order: Sequence[str] = (),
) -> dict[str, Any]:
    """The compat report of a sharded run, built as a local run's is: every shard's records of
    one test folded (``fold_records``), in ``order`` (collection order) then any others."""
    by_test: dict[str, list[Mapping[str, Any]]] = {}
    for r in records:
        by_test.setdefault(str(r["nodeid"]), []).append(r)
    ranked = [n for n in order if n in by_test] + [n for n in by_test if n not in set(order)]
    builder = ReportBuilder(subject=subject, profile=profile, seed=seed, environment=environment)
    for nodeid in ranked:
        builder.add(TestRecord.from_dict(fold_records(by_test[nodeid])))
    return builder.build()


def lost_record(nodeid: str, cause: str) -> dict[str, Any]:
    """The record of a test whose shard never came back (lost, timed out, crashed): an error
    with its cause, never a pass."""
    return {
        "nodeid": nodeid,
        "outcome": "error",
        "clauses": [],
        "examples": 0,
        "steps_compared": 0,
        "tolerated": {},
        "message": cause[:300],
    }


class Progress:
    """Shards done, running and failed, per node, as the driver learns of them."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.running: dict[str, str] = {}  # shard id -> node
        self.done: dict[str, str] = {}
        self.failed: dict[str, str] = {}
        self.attempts: dict[str, list[str]] = {}  # shard id -> the nodes it started on

    def started(self, shard_id: str, node: str) -> None:
        self.attempts.setdefault(shard_id, []).append(node)
        if shard_id not in self.done and shard_id not in self.failed:  # news can come late
            self.running[shard_id] = node

    def finished(self, shard_id: str, node: str | None, failed: bool) -> None:
        where = node or self.running.get(shard_id) or "?"
        self.running.pop(shard_id, None)
        (self.failed if failed else self.done)[shard_id] = where

    def retried(self) -> dict[str, list[str]]:
        return {k: v for k, v in self.attempts.items() if len(v) > 1}

    def line(self) -> str:
        nodes = sorted({*self.running.values(), *self.done.values(), *self.failed.values()})
        per = []
        for n in nodes:
            d = sum(1 for v in self.done.values() if v == n)
            r = sum(1 for v in self.running.values() if v == n)
            f = sum(1 for v in self.failed.values() if v == n)
            per.append(f"{n}: {d} done, {r} running, {f} failed")
        finished = len(self.done) + len(self.failed)
        head = (
            f"shards {finished}/{self.total}: {len(self.done)} done, {len(self.running)} "
            f"running, {len(self.failed)} failed"
        )
        return head + ("  |  " + "; ".join(per) if per else "")
