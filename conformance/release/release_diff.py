"""``omni-conformance release-diff A B``: how two vLLM releases schedule one corpus differently.

This module owns the comparison of two recordings (``conformance.release.record``) of one corpus
made on two releases, the grouping of first differences into behaviour changes, the shortest
workload that shows each change (written as a trace that runs on either release), and the report
(JSON, and Markdown from the template ``conformance/templates/release-diff.md.j2``). Given the two
releases' interpreters (``--shrink-with``), each change's trace is then shrunk against both
(``conformance.release.release_shrink``); without them it is the found workload, cut.

Both recordings must be of the same corpus (``IDENTITY``, and each workload's trace), else
``CorpusMismatch`` names the file and the field. Per workload and mode the first difference is
the first observation at which the runs differ, and in it the first field in a fixed walk order
(``SECTION_ORDER``, ``FIELD_ORDER``); fields one release lacks are not compared. Differences
grouped by field pattern and operation kind are the behaviour changes. Recordings are read a
workload at a time (``diff_streams``). Exit codes: 0 identical, 1 different, 2 bad input.
docs/compat-matrix.md ("Upstream changes between releases") has the details.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from conformance._core import schemas
from conformance._core.render import render
from conformance.release.record import MODES, Recording, RecordingError, open_recording

REPORT_SCHEMA = "omni-conformance-release-diff/1"
EXIT_IDENTICAL = 0
EXIT_DIFFERENT = 1
EXIT_INPUT = 2

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
# Header fields two recordings of one corpus must share (dotted paths into the header).
IDENTITY = (
    "corpus.seed",
    "corpus.size",
    "corpus.traces",
    "corpus.digest",
    "config",
    "modes",
    "max_drain",
    "pythonhashseed",
)

_ABSENT: Any = object()
_REQUEST_KEYED = ("requests", "outputs")


class CorpusMismatch(ValueError):
    """The two recordings are not of the same corpus; one line naming the file and the field."""


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

    @property
    def differences(self) -> list[FirstDifference]:
        return [d for _, _, d in self.runs if d is not None]

    @property
    def identical(self) -> bool:
        return not self.differences


# ---- comparing ----------------------------------------------------------------------------


def _get(header: Mapping[str, Any], dotted: str) -> Any:
    value: Any = header
    for part in dotted.split("."):
        value = value.get(part, _ABSENT) if isinstance(value, Mapping) else _ABSENT
    return value


def check_same_corpus(a: Recording, b: Recording) -> None:
    """The headers' corpus identity (``IDENTITY``); workload by workload, ``diff_streams``
    checks the names and traces."""
    for key in IDENTITY:
        va, vb = _get(a.header, key), _get(b.header, key)
        if va != vb:
            raise CorpusMismatch(
                f"{b.path}: header field {key!r} is {_short(vb)} but {a.path} has {_short(va)}: "
                "not recordings of the same corpus"
            )


def _same_workload(a: Recording, la: Any, b: Recording, lb: Any) -> None:
    if la is None or lb is None:
        more = "more" if la is None else "fewer"
        raise CorpusMismatch(f"{b.path}: {more} workloads than {a.path}")
    name = la["workload"]
    if lb["workload"] != name:
        raise CorpusMismatch(
            f"{b.path}: workload {lb['workload']!r} where {a.path} has {name!r} "
            "(different corpora, or workloads in another order)"
        )
    if la["trace"] != lb["trace"]:
        raise CorpusMismatch(f"{b.path}: workload {name!r}: field 'trace' differs from {a.path}'s")


def _slim(line: Mapping[str, Any]) -> dict[str, Any]:
    """A workload line without its observations."""
    runs = {mode: {"ops": run["ops"]} for mode, run in line["modes"].items()}
    return {**{k: v for k, v in line.items() if k != "modes"}, "modes": runs}


def _natural(key: str) -> tuple[Any, ...]:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key))


def _ordered_keys(keys: set[str], segs: tuple[str, ...]) -> list[str]:
    if not segs:
        first: Sequence[str] = SECTION_ORDER
    else:
        first = FIELD_ORDER.get(tuple(pattern_of(segs).split(".")), ())
    known = [k for k in first if k in keys]
    return known + sorted(keys - set(known), key=_natural)


def iter_field_differences(
    a: Any,
    b: Any,
    absent_a: frozenset[str] = frozenset(),
    absent_b: frozenset[str] = frozenset(),
    segs: tuple[str, ...] = (),
) -> Iterator[tuple[tuple[str, ...], Any, Any]]:
    """(path segments, value in A, value in B) of every differing leaf, in walk order; a field
    a recording's release lacks (its ``absent_fields``) is skipped."""
    if a == b:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for k in _ordered_keys(set(a) | set(b), segs):
            path = (*segs, k)
            va, vb = a.get(k, _ABSENT), b.get(k, _ABSENT)
            dotted = ".".join(path)
            if (va is _ABSENT and dotted in absent_a) or (vb is _ABSENT and dotted in absent_b):
                continue
            yield from iter_field_differences(va, vb, absent_a, absent_b, path)
        return
    yield segs, (ABSENT_MARK if a is _ABSENT else a), (ABSENT_MARK if b is _ABSENT else b)


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


def group_changes(differences: Sequence[FirstDifference]) -> list[Change]:
    """One change per (field pattern, operation kind); most runs first."""
    groups: dict[tuple[str, str], list[FirstDifference]] = {}
    for d in differences:
        groups.setdefault((d.pattern, d.op_kind), []).append(d)
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    changes = []
    for n, ((pattern, kind), diffs) in enumerate(ordered, 1):
        shortest = min(diffs, key=lambda d: (d.length, MODES.index(d.mode), _natural(d.workload)))
        changes.append(Change(f"C{n}", pattern, kind, diffs, shortest))
    return changes


def diff_streams(
    a: Recording,
    lines_a: Iterable[dict[str, Any]],
    b: Recording,
    lines_b: Iterable[dict[str, Any]],
) -> DiffResult:
    """Compare two recordings workload by workload as their lines come (``CorpusMismatch`` if
    they are of different corpora, ``RecordingError`` for a malformed line)."""
    check_same_corpus(a, b)
    absent_a = frozenset(a.header["absent_fields"])
    absent_b = frozenset(b.header["absent_fields"])
    result = DiffResult(Recording(a.path, a.header), Recording(b.path, b.header))
    for la, lb in itertools.zip_longest(lines_a, lines_b):
        _same_workload(a, la, b, lb)
        name = la["workload"]
        result.workloads += 1
        differs = False
        for mode in a.header["modes"]:
            d = first_difference(
                name, mode, la["modes"][mode], lb["modes"][mode], absent_a, absent_b
            )
            result.runs.append((name, mode, d))
            differs = differs or d is not None
        if differs:
            result.a.workloads[name] = _slim(la)
            result.b.workloads[name] = _slim(lb)
    result.changes = group_changes(result.differences)
    return result


def diff_recordings(a: Recording, b: Recording) -> DiffResult:
    """Compare two loaded recordings (``load_recording``)."""
    return diff_streams(a, a.workloads.values(), b, b.workloads.values())


# ---- traces of the shortest workloads -----------------------------------------------------


def shortest_trace(result: DiffResult, change: Change) -> Any:
    """The shortest workload of ``change`` as a ``Trace``: its operations up to the differing
    one (drain steps as explicit steps), in the mode it differed in."""
    from conformance._core.workload import Step, Trace

    d = change.shortest
    line = result.a.workloads[d.workload]
    base = Trace.from_dict(line["trace"])
    ops = list(base.ops)
    run = line["modes"][d.mode]
    ops += [Step() for _ in range(max(0, len(run["ops"]) - len(ops)))]
    if d.length > len(ops):  # the run continued on B only: its extra steps are steps too
        ops += [Step() for _ in range(d.length - len(ops))]
    ops = ops[: d.length]
    meta = {
        "kind": "release-diff",
        "subject": "upstream",
        "mode": d.mode,
        "workload": d.workload,
        "release_diff": {
            "change": change.id,
            "pattern": change.pattern,
            "op_kind": change.op_kind,
            "vllm_a": result.a.vllm,
            "vllm_b": result.b.vllm,
            "step": d.step,
            "op": d.op,
            "path": d.path,
            "value_a": d.a,
            "value_b": d.b,
        },
        "how": (
            "a workload, not a diff: record its folder on each release "
            "(omni-conformance record --size 0 --traces DIR --out X.jsonl) and run "
            "omni-conformance release-diff on the two recordings"
        ),
    }
    return Trace(
        config=base.config.with_(async_scheduling=d.mode == "async"),
        ops=ops,
        prefixes=dict(base.prefixes),
        meta=meta,
    )


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")[:80]


# Makes a change's trace from the found one: the trace to write and how it was made
# (``release_shrink.ShrinkOutcome.to_dict``).
TraceMaker = Callable[[Change, Any], tuple[Any, dict[str, Any]]]


def traced(change: Change) -> bool:
    """Whether the change gets a trace: a release that gained or lost an axis has no
    behaviour to replay."""
    return change.pattern != AXIS_CHANGE


def write_traces(result: DiffResult, out_dir: Path, make: TraceMaker | None = None) -> None:
    """Each change's trace: ``make`` (the shrinker) given the found one, else the found one."""
    from conformance.release.release_shrink import cut

    folder = out_dir / "traces"
    for old in folder.glob("change-*.json") if folder.is_dir() else ():
        old.unlink()  # a trace of an earlier diff into this folder must not pass for this one's
    for change in result.changes:
        if not traced(change):
            continue
        what = f"{change.op_kind}-{change.pattern.replace('*', 'each')}"
        name = f"change-{change.id[1:]}-{_slug(what)}.json"
        found = shortest_trace(result, change)
        if make is None:
            trace, how = found, cut(found).to_dict()
        else:
            trace, how = make(change, found)
        trace.save(folder / name)
        change.trace = f"traces/{name}"
        change.shrink = how


# ---- the report ---------------------------------------------------------------------------


def _short(value: Any, limit: int = 90) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _side(rec: Recording) -> dict[str, Any]:
    h = rec.header
    return {
        # The file's name only: a report committed or copied elsewhere names no local folder.
        "file": rec.path.name,
        "vllm": h["vllm"],
        "torch": h["torch"],
        "python": h["python"],
        "seconds": h["seconds"],
        "mode_seconds": h.get("mode_seconds", {}),
        "absent_fields": h["absent_fields"],
    }


def _variants(rec: Recording, change: Change) -> dict[str, int]:
    """How many of the change's workloads ran each configuration variant (saved traces:
    ``saved trace``): a change that only one variant shows usually comes from that setting."""
    counts: dict[str, int] = {}
    for name in sorted({d.workload for d in change.differences}):
        variant = str(rec.workloads[name].get("variant") or "saved trace")
        counts[variant] = counts.get(variant, 0) + 1
    return counts


def build_report(result: DiffResult) -> dict[str, Any]:
    a, b = result.a, result.b
    workloads = result.workloads
    differing = {name for name, _, d in result.runs if d is not None}
    return {
        "schema": REPORT_SCHEMA,
        "status": "identical" if result.identical else "different",
        "a": _side(a),
        "b": _side(b),
        "corpus": a.header["corpus"],
        "modes": a.header["modes"],
        "workloads": workloads,
        "runs": len(result.runs),
        "identical_runs": sum(d is None for _, _, d in result.runs),
        "identical_workloads": workloads - len(differing),
        "not_compared": {
            "only_in_a": sorted(set(b.header["absent_fields"]) - set(a.header["absent_fields"])),
            "only_in_b": sorted(set(a.header["absent_fields"]) - set(b.header["absent_fields"])),
        },
        "shrink": result.shrink,
        "changes": [{**c.to_dict(), "variants": _variants(a, c)} for c in result.changes],
        "first_differences": [d.to_dict() for d in result.differences],
    }


def render_markdown(report: Mapping[str, Any]) -> str:
    return render("release-diff.md.j2", report=report, short=_short)


def summary_entry(report: Mapping[str, Any], where: str | None = None) -> dict[str, Any]:
    """The report as an item of the matrix report's "upstream changes between releases"."""
    if report["status"] == "identical":
        changes: list[Any] = [f"identical on {report['workloads']} workloads"]
    else:
        changes = [
            {"id": c["id"], "summary": f"{c['id']}: {c['summary']}", "trace": c["trace"]}
            for c in report["changes"]
        ]
    return {
        "from": report["a"]["vllm"],
        "to": report["b"]["vllm"],
        "workloads": report["workloads"],
        "identical_workloads": report["identical_workloads"],
        "report": where,
        "changes": changes,
    }


def write_report(
    result: DiffResult, out_dir: str | Path, make: TraceMaker | None = None
) -> dict[str, Any]:
    """Write traces (made by ``make``, else cut), ``release-diff.json`` and ``release-diff.md``
    into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_traces(result, out, make)
    report = build_report(result)
    schemas.validate("release-diff", report)  # a mismatch is this module's bug: say it here
    (out / "release-diff.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    (out / "release-diff.md").write_text(render_markdown(report))
    return report


def release_diff(
    a: str | Path,
    b: str | Path,
    out_dir: str | Path,
    *,
    shrink_with: tuple[str | Path, str | Path] | None = None,
    shrink_seconds: float | None = None,
    progress: Callable[[str], None] | None = None,
    config_changes: tuple[Mapping[str, Any] | None, Mapping[str, Any] | None] = (None, None),
) -> dict[str, Any]:
    """Load, compare and report; ``RecordingError`` / ``CorpusMismatch`` for bad input. With
    ``shrink_with`` (A's and B's python executables) each change's trace is shrunk against both
    releases, at most ``shrink_seconds`` per change; a problem with the interpreters is in the
    report (each change's ``shrink``), not raised. ``config_changes`` plant a configuration
    difference in A's or B's interpreter (the self-tests run one release on both sides)."""
    rec_a, lines_a = open_recording(a)
    rec_b, lines_b = open_recording(b)
    result = diff_streams(rec_a, lines_a, rec_b, lines_b)
    if shrink_with is None or not any(traced(c) for c in result.changes):
        return write_report(result, out_dir)
    from conformance.release.release_shrink import shrinking

    with shrinking(result, shrink_with, shrink_seconds, progress, config_changes) as make:
        return write_report(result, out_dir, make)


# ---- the command --------------------------------------------------------------------------


def _error(message: str) -> int:
    print(f"omni-conformance: error: {message}", file=sys.stderr)
    return EXIT_INPUT


def cmd_release_diff(args: argparse.Namespace) -> int:
    from conformance._core.preflight import folder_problem

    for p in (args.a, args.b):
        if not Path(p).is_file():
            return _error(f"no such recording: {p}")
    out = (
        Path(args.out)
        if args.out
        else Path(f"release-diff-{Path(args.a).stem}-{Path(args.b).stem}")
    )
    problem = folder_problem(out)
    if problem:
        return _error(f"--out {out}: {problem}")
    shrink_with = None
    if args.shrink_with:
        from conformance.release.release_shrink import resolve_python

        try:
            shrink_with = (resolve_python(args.shrink_with[0]), resolve_python(args.shrink_with[1]))
        except ValueError as exc:
            return _error(f"--shrink-with {exc}")
    if args.shrink_seconds is not None and args.shrink_seconds <= 0:
        return _error(f"--shrink-seconds {args.shrink_seconds}: must be more than 0")

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        report = release_diff(
            args.a,
            args.b,
            out,
            shrink_with=shrink_with,
            shrink_seconds=args.shrink_seconds,
            progress=say,
        )
    except (RecordingError, CorpusMismatch) as exc:
        return _error(str(exc))
    if report["status"] == "identical":
        print(
            f"release-diff: vLLM {report['a']['vllm']} -> {report['b']['vllm']}: identical on "
            f"{report['workloads']} workloads ({report['runs']} runs)"
        )
    else:
        print(
            f"release-diff: vLLM {report['a']['vllm']} -> {report['b']['vllm']}: "
            f"{report['workloads'] - report['identical_workloads']} of {report['workloads']} "
            f"workloads differ, {len(report['changes'])} behaviour change(s)"
        )
        for c in report["changes"]:
            print(f"  {c['id']}: {c['summary']}")
    print(f"report: {out / 'release-diff.md'} (+ release-diff.json, traces/)")
    return EXIT_IDENTICAL if report["status"] == "identical" else EXIT_DIFFERENT


def add_parser(sub: Any) -> None:
    d = sub.add_parser(
        "release-diff",
        help="compare two recordings of one corpus made on two vLLM releases",
    )
    d.add_argument("a", help="recording of the older release (omni-conformance record)")
    d.add_argument("b", help="recording of the newer release")
    d.add_argument("--out", default=None, help="report folder (default: release-diff-<A>-<B>)")
    d.add_argument(
        "--shrink-with",
        nargs=2,
        metavar=("A_PYTHON", "B_PYTHON"),
        default=None,
        help="the two releases' interpreters (python executables, environment folders, or "
        "environment names such as vllm-0.30.0): shrink each change's trace against both "
        "(without: the found workload, cut after its difference)",
    )
    d.add_argument(
        "--shrink-seconds",
        type=float,
        default=None,
        help="time bound for shrinking one change (default: $OMNI_CONFORMANCE_SHRINK_SECONDS "
        "or 60)",
    )
    d.set_defaults(func=cmd_release_diff)
