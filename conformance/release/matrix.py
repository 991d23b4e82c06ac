"""The compatibility matrix's cells (``omni-conformance matrix``, whose command is
``conformance.cli.matrix``): the gate over several vLLM releases and subjects, one cell each.

For every (subject, vLLM release) cell: an isolated environment for that release
(``conformance.release.envs``, built or reused), ``omni-conformance check`` in it, then (unless
told not to) ``omni-conformance upstream-tests``, each a child run through
``conformance._core.processes``; then the cell's folder ``<out>/cells/<subject>--vllm-<release>/``
(compat report, log, ``cell.json``), written atomically one cell at a time, so an interrupted
matrix keeps every finished cell. A subject's extra packages come from its
``environment_requirements(vllm)`` hook or ``--with SUBJECT=REQ``; its refusal
(``SubjectUnsupported``) makes the cell "unsupported". ``--release-diff`` records upstream's own
schedulers in every release's environment and diffs consecutive releases. Cell statuses, the
folder layout and the merged report: docs/compat-matrix.md.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance._core import hash_seed, processes, schemas
from conformance._core.vllm_compat.versions import SUPPORTED_VLLM, release
from conformance.release.envs import (
    EnvBuildError,
    Environment,
    EnvSpec,
    build_environment,
    current_environment,
)

CELL_SCHEMA = "omni-conformance-matrix-cell/1"
EXIT_UNSUPPORTED = 4  # ``omni-conformance check``: the subject refused this environment
FINAL = frozenset({"pass", "fail", "not_applicable", "incomplete", "unsupported", "error"})


@dataclass(frozen=True)
class Cell:
    subject: str
    vllm: str
    extras: tuple[str, ...] = ()
    unsupported: str | None = None  # the subject's refusal, known before building anything

    @property
    def dirname(self) -> str:
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.subject)
        return f"{safe}--vllm-{self.vllm}"

    @property
    def label(self) -> str:
        return f"{self.subject} @ vLLM {self.vllm}"


@dataclass
class CellResult:
    cell: Cell
    status: str
    duration_s: float
    data: dict[str, Any] = field(default_factory=dict)


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def parse_with(entries: Sequence[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for entry in entries:
        subject, sep, req = entry.partition("=")
        if not sep or not subject or not req:
            raise ValueError(f"--with {entry!r}: expected SUBJECT=REQUIREMENT")
        out.setdefault(subject, []).append(req)
    return out


def declared_requirements(subject: str, vllm: str) -> list[str]:
    """What the subject's entry point says its environment needs on ``vllm``.

    Raises ``SubjectUnsupported`` when the subject declares it does not support ``vllm``. A
    subject that cannot be inspected here (not installed in this environment) declares nothing.
    """
    from importlib.metadata import entry_points

    from conformance._core.subjects import ENTRY_POINT_GROUP

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name != subject:
            continue
        try:
            obj = ep.load()
        except Exception:  # noqa: BLE001 - a subject that cannot load here declares nothing
            return []
        hook: Callable[[str], Sequence[str]] | None = getattr(obj, "environment_requirements", None)
        return list(hook(vllm)) if hook is not None else []
    return []


def plan_cells(
    subjects: Sequence[str], versions: Sequence[str], with_: dict[str, list[str]]
) -> list[Cell]:
    from conformance._core.subjects import SubjectUnsupported

    cells = []
    for v in sorted(versions, key=release):
        for s in subjects:
            extras = [r.replace("{vllm}", v) for r in with_.get(s, [])]
            refusal = None
            try:
                extras += declared_requirements(s, v)
            except SubjectUnsupported as exc:
                refusal = str(exc)
            cells.append(Cell(s, v, tuple(sorted(set(extras))), refusal))
    return cells


def _run_logged(cmd: list[str], log_path: Path, env: dict[str, str], timeout_s: float) -> int:
    """Run ``cmd`` in its own process group, output appended to ``log_path``; the group is
    stopped on interrupt or timeout (-9 then), so no child outlives the matrix."""
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        done = processes.run(cmd, env=env, timeout_s=timeout_s, output=log)
        if done.timed_out:
            log.write(f"\n[matrix] killed after {timeout_s:.0f} s\n")
            return -9
        return done.returncode


def _last_error_line(log_path: Path) -> str:
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines()]
    except OSError:
        return "no log"
    for ln in reversed(lines):
        if ln.startswith("omni-conformance:"):
            return ln
    meaningful = [ln for ln in lines if ln and not ln.startswith("$ ")]
    return meaningful[-1] if meaningful else "no output"


def _child_env() -> dict[str, str]:
    env = hash_seed.pinned()
    for var in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        env.pop(var, None)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def _write_cell(cell_dir: Path, data: dict[str, Any]) -> None:
    """Write ``cell.json`` atomically, after checking it against its schema: a cell the merge
    would refuse is a bug here, and ``CellError`` names the field now rather than at merge time."""
    from conformance.release.matrix_cells import check_cell

    text = json.dumps(data, indent=2, default=str)
    check_cell(json.loads(text), cell_dir / "cell.json")
    tmp = cell_dir / "cell.json.tmp"
    tmp.write_text(text)
    tmp.replace(cell_dir / "cell.json")  # atomic: a reader never sees half a cell


@dataclass
class MatrixOptions:
    out: Path
    envs_dir: Path
    installer: str = "auto"
    profile: str = "ci"
    workers: int = 2
    allow_untested: bool = False
    upstream_tests: bool = True
    resume: bool = False
    reuse_current: bool = True
    timeout_s: float = 3600.0
    python: str | None = None
    release_diff: str | None = None  # "also" (after the cells) or "only"; None: no release-diff
    corpus_seed: int = 0
    corpus_size: int = 200
    corpus_traces: str | None = None
    # Folders the cell's child interpreter also imports from (``matrix --ray``: the source of a
    # ``module:attr`` subject that Ray's runtime environment brought to this node).
    pythonpath: tuple[str, ...] = ()


def run_cell(
    cell: Cell, env: Environment | None, env_error: str | None, opts: MatrixOptions
) -> CellResult:
    cell_dir = opts.out / "cells" / cell.dirname
    cell_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("cell.json", "compat-report.json", "upstream-tests.json"):
        (cell_dir / stale).unlink(missing_ok=True)
    log_path = cell_dir / "cell.log"
    log_path.write_text("")
    started = time.monotonic()
    data: dict[str, Any] = {
        "schema": CELL_SCHEMA,
        "subject": cell.subject,
        "vllm": cell.vllm,
        "extras": list(cell.extras),
        "environment": {},
        "status": "error",
        "untested_vllm": not supported(cell.vllm),
        "exit_code": None,
        "duration_s": 0.0,
        "started_at": _now(),
        "finished_at": None,
        "error": None,
        "log": "cell.log",
        "report": None,
        "upstream_tests": None,
        "env": None,
    }
    if env is not None:
        data["env"] = {
            "path": str(env.path),
            "installer": env.installer,
            "reused": env.reused,
            "build_s": round(env.build_s, 1),
        }
    if cell.unsupported is not None:
        data["status"] = "unsupported"
        data["error"] = cell.unsupported
    elif env is None:
        data["error"] = env_error or "no environment"
    else:
        _check_cell(cell, env, cell_dir, log_path, opts, data)
    data["duration_s"] = round(time.monotonic() - started, 1)
    data["finished_at"] = _now()
    _write_cell(cell_dir, data)
    return CellResult(cell, data["status"], data["duration_s"], data)


def supported(vllm: str) -> bool:
    return release(vllm)[:2] in {release(v)[:2] for v in SUPPORTED_VLLM}


def _check_cell(
    cell: Cell,
    env: Environment,
    cell_dir: Path,
    log_path: Path,
    opts: MatrixOptions,
    data: dict[str, Any],
) -> None:
    child_env = _child_env()
    if opts.pythonpath:
        child_env["PYTHONPATH"] = os.pathsep.join(opts.pythonpath)
    cmd = [
        *env.script("omni-conformance"),
        "check",
        "--subject",
        cell.subject,
        "--profile",
        opts.profile,
        "--report-dir",
        str(cell_dir),
        "--failures-dir",
        str(cell_dir / "failures"),
        "-n",
        str(opts.workers),
        "-q",
    ]
    if opts.allow_untested or not supported(cell.vllm):
        cmd.append("--allow-untested-vllm")
    rc = _run_logged(cmd, log_path, child_env, opts.timeout_s)
    data["exit_code"] = rc
    report_path = cell_dir / "compat-report.json"
    if rc == EXIT_UNSUPPORTED:
        data["status"] = "unsupported"
        data["error"] = _last_error_line(log_path).removeprefix("omni-conformance: unsupported: ")
        return
    if not report_path.exists():
        data["error"] = _last_error_line(log_path)
        return
    try:
        report = json.loads(report_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        data["error"] = f"unreadable compat report: {exc}"
        return
    data["report"] = "compat-report.json"
    data["environment"] = report.get("environment", {})
    data["status"] = report.get("status", "error")
    if data["status"] == "not_run":
        data["status"] = "error"
        data["error"] = "no test ran"
    if opts.upstream_tests:
        _upstream_tests_cell(cell, env, cell_dir, log_path, opts, child_env, data)


def _upstream_tests_cell(
    cell: Cell,
    env: Environment,
    cell_dir: Path,
    log_path: Path,
    opts: MatrixOptions,
    child_env: dict[str, str],
    data: dict[str, Any],
) -> None:
    out = cell_dir / "upstream-tests.json"
    cmd = [
        *env.script("omni-conformance"),
        "upstream-tests",
        "--subject",
        cell.subject,
        "--json",
        str(out),
    ]
    rc = _run_logged(cmd, log_path, child_env, opts.timeout_s)
    if out.exists():
        try:
            data["upstream_tests"] = json.loads(out.read_text())
        except (OSError, json.JSONDecodeError):
            data["upstream_tests_error"] = "unreadable upstream-tests result"
    else:
        data["upstream_tests_error"] = f"exit {rc}: {_last_error_line(log_path)}"


def _existing(cell_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((cell_dir / "cell.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if data.get("status") in FINAL else None


def duration_text(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _environment_for(
    spec: EnvSpec, opts: MatrixOptions, say: Callable[[str], None], index: int, total: int
) -> tuple[Environment | None, str | None]:
    """The environment for ``spec`` (this interpreter when it already is one), or why not."""
    env = current_environment(spec) if opts.reuse_current else None
    if env is not None:
        return env, None
    say(f"[{index}/{total}] environment {spec.name} ({', '.join(spec.requirements())}) ...")
    build_log = opts.out / "envs" / f"{spec.name}.log"
    build_log.parent.mkdir(parents=True, exist_ok=True)
    with open(build_log, "w") as bl:

        def log(line: str) -> None:
            print(line, file=bl, flush=True)

        try:
            env = build_environment(
                spec, opts.envs_dir, installer=opts.installer, python=opts.python, log=log
            )
        except EnvBuildError as exc:
            error = f"environment {spec.name}: {exc}"
            say(f"    {error} (log: {build_log})")
            return None, error
    how = "reused" if env.reused else f"built in {duration_text(env.build_s)}"
    say(f"    environment {env.path}: {how} ({env.installer})")
    return env, None


def run_matrix(cells: Sequence[Cell], opts: MatrixOptions, say: Callable[[str], None]) -> int:
    """Run every cell; return the number of cells finished (interrupted matrices stop early)."""
    groups: dict[EnvSpec, list[Cell]] = {}
    for c in cells:
        groups.setdefault(EnvSpec(c.vllm, c.extras), []).append(c)
    total = len(cells)
    done: list[CellResult] = []
    index = 0
    t0 = time.monotonic()
    for spec, members in groups.items():
        pending = []
        for c in members:
            index += 1
            prior = _existing(opts.out / "cells" / c.dirname) if opts.resume else None
            if prior is not None:
                say(f"[{index}/{total}] {c.label}: {prior['status']} (kept from an earlier run)")
                continue
            pending.append((index, c))
        if not pending:
            continue
        env: Environment | None = None
        env_error: str | None = None
        if any(c.unsupported is None for _, c in pending):
            env, env_error = _environment_for(spec, opts, say, pending[0][0], total)
        for i, c in pending:
            say(f"[{i}/{total}] {c.label}: running ...")
            result = run_cell(c, env, env_error, opts)
            done.append(result)
            detail = f" ({result.data['error']})" if result.data.get("error") else ""
            say(
                f"[{i}/{total}] {c.label}: {result.status} in {duration_text(result.duration_s)}{detail}"
            )
    say(f"matrix: {len(done)} cell(s) run in {duration_text(time.monotonic() - t0)}")
    return len(done)


RELEASE_DIFF_DIR = "release-diff"
RELEASE_DIFF_FILE = "release-diff.json"
RELEASE_DIFF_SCHEMA = "omni-conformance-release-diffs/1"


def run_release_diff(
    versions: Sequence[str], opts: MatrixOptions, say: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Record the corpus in each release's environment, diff consecutive releases; the pairs as
    items of the report's "upstream changes between releases" (also written to
    ``<out>/release-diff/release-diff.json``)."""
    from conformance.release.record import RecordingError
    from conformance.release.release_diff import CorpusMismatch, release_diff, summary_entry

    folder = opts.out / RELEASE_DIFF_DIR
    recordings = folder / "recordings"
    recordings.mkdir(parents=True, exist_ok=True)
    ordered = sorted(dict.fromkeys(versions), key=release)
    made: dict[str, Path] = {}
    pythons: dict[str, Path] = {}  # each release's interpreter, to shrink the changes' traces
    problems: dict[str, str] = {}
    for i, v in enumerate(ordered, 1):
        env, error = _environment_for(EnvSpec(v), opts, say, i, len(ordered))
        if env is None:
            problems[v] = error or "no environment"
            continue
        target = recordings / f"vllm-{v}.jsonl"
        target.unlink(missing_ok=True)
        log_path = recordings / f"vllm-{v}.log"
        log_path.write_text("")
        cmd = [*env.script("omni-conformance"), "record", "--out", str(target)]
        cmd += ["--seed", str(opts.corpus_seed), "--size", str(opts.corpus_size)]
        if opts.corpus_traces:
            cmd += ["--traces", str(opts.corpus_traces)]
        say(f"[release-diff {i}/{len(ordered)}] recording vLLM {v} ...")
        started = time.monotonic()
        rc = _run_logged(cmd, log_path, _child_env(), opts.timeout_s)
        if rc != 0 or not target.exists():
            problems[v] = f"record exit {rc}: {_last_error_line(log_path)}"
            say(f"    vLLM {v}: {problems[v]}")
            continue
        made[v] = target
        pythons[v] = env.python
        say(f"    vLLM {v}: recorded in {duration_text(time.monotonic() - started)}")
    pairs: list[dict[str, Any]] = []
    for a, b in zip(ordered, ordered[1:], strict=False):
        if a not in made or b not in made:
            why = "; ".join(f"vLLM {v}: {problems.get(v, 'not recorded')}" for v in (a, b))
            pairs.append({"from": a, "to": b, "changes": [f"not compared ({why})"]})
            continue
        where = folder / f"{a}--{b}"
        try:
            report = release_diff(
                made[a], made[b], where, shrink_with=(pythons[a], pythons[b]), progress=say
            )
        except (RecordingError, CorpusMismatch) as exc:
            pairs.append({"from": a, "to": b, "changes": [f"not compared ({exc})"]})
            continue
        entry = summary_entry(report, f"{RELEASE_DIFF_DIR}/{where.name}/release-diff.md")
        pairs.append(
            {**entry, "from": a, "to": b}
        )  # the releases asked for, as the grid names them
        say(f"release-diff vLLM {a} -> {b}: " + "; ".join(_texts(pairs[-1])))
    document = {"schema": RELEASE_DIFF_SCHEMA, "pairs": pairs}
    schemas.validate("release-diff-pairs", document)
    tmp = folder / (RELEASE_DIFF_FILE + ".tmp")
    tmp.write_text(json.dumps(document, indent=1))
    tmp.replace(folder / RELEASE_DIFF_FILE)
    return pairs


def _texts(pair: dict[str, Any]) -> list[str]:
    return [c if isinstance(c, str) else str(c.get("summary")) for c in pair["changes"]]


def release_changes_of(out: Path) -> list[dict[str, Any]]:
    """The pairs ``run_release_diff`` wrote under ``out`` (none if it did not run there)."""
    from conformance.release.matrix_report import release_changes_in

    return release_changes_in(out)


def merge_into(out: Path, say: Callable[[str], None]) -> int:
    """Merge every cell under ``out`` into the four report files; the merge's exit code."""
    from conformance.release.matrix_report import (
        CellError,
        build_matrix_report,
        exit_code,
        load_cells,
        summary_text,
        write_matrix_report,
    )

    try:
        cells = load_cells([out / "cells"])
    except CellError as exc:
        print(f"omni-conformance: error: {exc}", file=sys.stderr)
        return 2
    report = build_matrix_report(cells, release_changes=release_changes_of(out))
    paths = write_matrix_report(report, out)
    say(summary_text(report))
    say("report: " + ", ".join(str(p) for p in paths.values()))
    return exit_code(report)
