"""``omni-conformance release-diff A B``: how two vLLM releases schedule one corpus differently.

This module owns the comparison of two recordings (``conformance.release.record``) of one corpus
made on two releases, the grouping of first differences into behaviour changes, the shortest
workload that shows each change (written as a trace that runs on either release), and the report
(JSON, and Markdown from the template ``conformance/templates/release-diff.md.j2``). Given the two
releases' interpreters (``--shrink-with``), each change's trace is then shrunk against both
(``conformance.release.release_shrink``); without them it is the found workload, cut.

Both recordings must be of the same corpus (``IDENTITY``, and each workload's trace), else
``CorpusMismatch`` names the file and the field. First differences and how they group into
changes: ``conformance.release.first_difference``. Recordings are read a workload at a time
(``diff_streams``). Exit codes: 0 identical, 1 different, 2 bad input; docs/compat-matrix.md
("Upstream changes between releases") has the details.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from conformance._core import schemas
from conformance._core.render import render
from conformance.release.first_difference import (
    _ABSENT,
    AXIS_CHANGE,
    Change,
    DiffResult,
    FirstDifference,
    TraceMaker,
    _natural,
    _short,
    absent_values,
    first_difference,
)
from conformance.release.record import MODES, Recording, RecordingError, open_recording

REPORT_SCHEMA = "omni-conformance-release-diff/1"
EXIT_IDENTICAL = 0
EXIT_DIFFERENT = 1
EXIT_INPUT = 2

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


class CorpusMismatch(ValueError):
    """The two recordings are not of the same corpus; one line naming the file and the field."""


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


# How many distinct values of a one-sided field the report shows.
FIELD_EXAMPLES = 3


class FieldTally:
    """Where one release records a field the other lacks: the workloads and runs, and the first
    few distinct values. A field new in a release differs in every run that records it, so it is
    reported once, here, instead of as each run's first difference."""

    def __init__(self, field: str, side: str) -> None:
        self.field, self.side = field, side
        self.workloads: set[str] = set()
        self.runs = 0
        self.distinct: set[str] = set()
        self.examples: list[Any] = []

    def add(self, value: Any) -> None:
        key = json.dumps(value, sort_keys=True)
        if key not in self.distinct:
            self.distinct.add(key)
            if len(self.examples) < FIELD_EXAMPLES:
                self.examples.append(value)

    def to_dict(self, release: str, since: tuple[str, str] | None) -> dict[str, Any]:
        return {
            "field": self.field,
            "only_in": self.side,
            "vllm": release,
            "since": since[0] if since else None,
            "what": since[1] if since else None,
            "workloads": len(self.workloads),
            "runs": self.runs,
            "distinct_values": len(self.distinct),
            "examples": self.examples,
        }


def _tally_one_sided(
    tallies: dict[str, FieldTally],
    side: str,
    fields: frozenset[str],
    name: str,
    run: Mapping[str, Any],
) -> None:
    if not fields:
        return
    seen: set[str] = set()
    for step in run.get("steps", ()):
        for pattern, value in absent_values(step, fields):
            tally = tallies.setdefault(pattern, FieldTally(pattern, side))
            tally.add(value)
            seen.add(pattern)
    for pattern in seen:
        tallies[pattern].workloads.add(name)
        tallies[pattern].runs += 1


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
    only_a, only_b = absent_b - absent_a, absent_a - absent_b
    tallies: dict[str, FieldTally] = {}
    for la, lb in itertools.zip_longest(lines_a, lines_b):
        _same_workload(a, la, b, lb)
        name = la["workload"]
        result.workloads += 1
        differs = False
        for mode in a.header["modes"]:
            _tally_one_sided(tallies, "a", only_a, name, la["modes"][mode])
            _tally_one_sided(tallies, "b", only_b, name, lb["modes"][mode])
            d = first_difference(
                name, mode, la["modes"][mode], lb["modes"][mode], absent_a, absent_b
            )
            result.runs.append((name, mode, d))
            differs = differs or d is not None
        if differs:
            result.a.workloads[name] = _slim(la)
            result.b.workloads[name] = _slim(lb)
    result.changes = group_changes(result.differences)
    result.one_sided = tallies
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


def _one_sided_report(result: DiffResult) -> list[dict[str, Any]]:
    """Each field one release lacks that the other recorded, with the release change that
    added (or dropped) it, as the compat layer's tables say."""
    from conformance._core import vllm_compat as vc

    since: dict[str, tuple[str, str]] = {}
    for table in vc.RECORDED_FIELDS:
        since.update(vc.introductions(table))
    tallies = sorted(result.one_sided.values(), key=lambda t: (-t.runs, t.field))
    return [
        t.to_dict((result.a if t.side == "a" else result.b).vllm, since.get(t.field))
        for t in tallies
    ]


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
        "one_sided_fields": _one_sided_report(result),
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
