"""Recordings of upstream vLLM's own schedulers on a fixed corpus (``omni-conformance record``).

A recording is what one release's ``Scheduler`` (sync) and ``AsyncScheduler`` (async) do on a
corpus of workloads, observation by observation, so that a recording made on another release can
be compared with it (``conformance.release.release_diff``). This module owns the corpus (drawn
from a string seed, so it depends neither on ``PYTHONHASHSEED`` nor on the release; the invariant
suite's operation mix on its tight configuration or a variant, plus saved traces), running each
workload in both modes and draining it, and the writer and reader. The format is JSON lines, a
header then one line per workload, each line described by
``conformance/schemas/recording.schema.json`` and checked against it on reading. A field the
release lacks is a missing key named in the header's ``absent_fields``; block hashes become
first-seen labels and memory addresses ``0x?``, so recording one corpus twice on one release gives
byte-identical workload lines. docs/compat-matrix.md ("Upstream changes between releases") has
the details.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance._core import hash_seed as hashing
from conformance._core.config import HarnessConfig
from conformance._core.workload import (
    PAUSE_STATES,
    Abort,
    AddRequest,
    Op,
    Pause,
    ResetEncoderCache,
    ResetPrefixCache,
    Step,
    StreamInput,
    Trace,
)

SCHEMA = "omni-conformance-recording/1"
MODES = ("sync", "async")
# Drain bound: a workload whose scheduler still has work after this many extra steps is cut
# there (in both recordings alike, since the bound is part of the header that must match).
MAX_DRAIN = 300
DEFAULT_SEED = 0
DEFAULT_SIZE = 60

_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


class RecordingError(ValueError):
    """A recording (or a trace folder) that cannot be used; the message is one line naming the
    file and the field."""


# ---- the corpus ---------------------------------------------------------------------------


def corpus_config() -> HarnessConfig:
    """The base configuration of generated workloads: the suite's tight budget, sync mode."""
    from conformance._core.machine import TIGHT

    return TIGHT


# Variants of the base configuration a generated workload runs with (each workload draws one):
# scheduler paths the base alone never takes (no prefix cache, whole-prompt prefill, a cap on
# long prefills, few sequences, a roomy cache where batches grow instead of preempting).
VARIANTS: dict[str, dict[str, Any]] = {
    "tight": {},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "no-chunked-prefill": {"enable_chunked_prefill": False, "max_num_batched_tokens": 128},
    "long-prefill-cap": {"long_prefill_token_threshold": 8},
    "two-seqs": {"max_num_seqs": 2},
    "roomy": {"num_blocks": 64, "max_num_batched_tokens": 256},
}


def axis_variants() -> dict[str, dict[str, Any]]:
    """The scheduler axes as corpus variants: ``axis-<name>`` -> the configuration it makes."""
    from conformance._core.axes import AXES

    return {f"axis-{a.name}": dict(a.changes) for a in AXES}


def all_variants() -> dict[str, dict[str, Any]]:
    return {**VARIANTS, **axis_variants()}


def generate_workload(seed: int, index: int) -> Trace:
    """Workload ``index`` of the corpus of ``seed``: a pure function of the two numbers (and of
    the catalogue of scheduler axes, which is part of the code)."""
    from conformance._core.axes import axis
    from conformance._core.machine import PREFIXES, random_request, session_chunk

    rng = random.Random(f"omni-conformance-corpus:{seed}:{index}")
    variants = all_variants()
    variant = rng.choice(sorted(variants))
    chosen = axis(variant.removeprefix("axis-")) if variant.startswith("axis-") else None
    values = chosen.request_values if chosen is not None else None
    pauses = chosen is not None and chosen.pauses
    multimodal = corpus_config().with_(**variants[variant]).multimodal
    ops: list[Op] = []
    count = 0
    sessions: list[str] = []
    for _ in range(rng.randint(4, 22)):
        roll = rng.random()
        if sessions and roll < 0.2:
            # The streaming-sessions axis: more input for a session, or the end of its stream
            # (a roll of its own, so the other variants draw exactly as before).
            rid = rng.choice(sessions)
            if rng.random() < 0.15:
                ops.append(StreamInput(rid, end=True))
                sessions.remove(rid)
            else:
                chunk = session_chunk(rng.randint(1, 3), rng.randint(1, 16))
                ops.append(StreamInput(rid, chunk, rng.randint(1, 6)))
        elif roll < 0.36 or count == 0:
            request = random_request(rng, f"r{count}", values)
            ops.append(request)
            if request.resumable:
                sessions.append(request.request_id)
            count += 1
        elif roll < 0.76:
            ops.extend(Step() for _ in range(rng.randint(1, 4)))
        elif roll < 0.92:
            known = [f"r{i}" for i in range(count)]
            ops.append(Abort(tuple(rng.sample(known, rng.randint(1, min(3, len(known)))))))
        elif pauses and rng.random() < 0.75:
            # The pause axis: the engine pauses or resumes its scheduler (a roll of its own, so
            # the other variants draw exactly as before).
            state = rng.choice([*PAUSE_STATES, "reset-encoder"] if multimodal else PAUSE_STATES)
            ops.append(ResetEncoderCache() if state == "reset-encoder" else Pause(state))
        else:
            form = rng.choice(["plain", "running", "connector"])
            ops.append(
                ResetPrefixCache(
                    reset_running_requests=form == "running", reset_connector=form == "connector"
                )
            )
    config = corpus_config().with_(**variants[variant])
    meta = {"variant": variant} if chosen is None else {"variant": variant, "axis": chosen.name}
    return Trace(config=config, ops=ops, prefixes=dict(PREFIXES), meta=meta)


@dataclass
class Workload:
    name: str
    source: str  # "generated" or "trace:<file name>"
    trace: Trace


def load_trace_folder(folder: str | Path) -> list[Workload]:
    """Every saved trace (``*.json``) in ``folder``, sorted by file name."""
    from conformance._core.replay import TraceError, load_trace

    path = Path(folder)
    if not path.is_dir():
        raise RecordingError(f"--traces {folder}: not a folder")
    out = []
    for file in sorted(path.glob("*.json")):
        try:
            trace = load_trace(file)
        except TraceError as exc:
            raise RecordingError(str(exc)) from None
        out.append(Workload(f"trace:{file.stem}", f"trace:{file.name}", trace))
    return out


def build_corpus(seed: int, size: int, traces: str | Path | None = None) -> list[Workload]:
    corpus = [
        Workload(f"gen-{i:04d}", "generated", generate_workload(seed, i)) for i in range(size)
    ]
    if traces is not None:
        corpus += load_trace_folder(traces)
    return corpus


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def corpus_identity(seed: int, size: int, corpus: Sequence[Workload]) -> dict[str, Any]:
    """What two recordings must share to be compared: seed, size, saved traces, and a digest of
    every workload's operations."""
    digest = hashlib.sha256()
    traces = []
    for w in corpus:
        text = _canonical({"name": w.name, "trace": _trace_identity(w.trace)})
        digest.update(text.encode())
        if w.source != "generated":
            traces.append({"name": w.name, "sha256": hashlib.sha256(text.encode()).hexdigest()})
    return {"seed": seed, "size": size, "traces": traces, "digest": digest.hexdigest()}


def _trace_identity(trace: Trace) -> dict[str, Any]:
    d = trace.to_dict()
    d.pop("meta", None)  # provenance (versions, times) of a saved trace is not its workload
    return d


# ---- running one workload -----------------------------------------------------------------


def absent_fields() -> list[str]:
    """Field paths some supported release records that this one lacks (``*``: any key or list
    position): every table of ``vllm_compat.RECORDED_FIELDS``, keyed by release there."""
    from conformance._core import vllm_compat as vc

    return sorted(set().union(*(vc.absent_paths(t) for t in vc.RECORDED_FIELDS)))


class _Hashes:
    """Block hashes as labels numbered in order of first appearance within one run."""

    def __init__(self) -> None:
        self.labels: dict[Any, str] = {}

    def label(self, value: Any) -> str:
        key = bytes(value) if isinstance(value, bytes | bytearray | memoryview) else value
        got = self.labels.get(key)
        if got is None:
            got = self.labels[key] = f"#{len(self.labels)}"
        return got


def _plain(value: Any) -> Any:
    """A snapshot value as plain JSON (tuples as lists, keys as strings)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, set | frozenset):
        return [_plain(v) for v in sorted(value, key=repr)]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, bytes):
        return value.hex()
    return _ADDRESS.sub("0x?", repr(value))


def normalise(snapshot: dict[str, Any], hashes: _Hashes) -> dict[str, Any]:
    """A snapshot with what varies between runs replaced (see the module docstring)."""
    snap = dict(snapshot)
    pool = snap.get("block_pool")
    if isinstance(pool, dict) and "hashed_blocks" in pool:
        pool = dict(pool)
        pool["hashed_blocks"] = [[bid, hashes.label(h)] for bid, h in pool["hashed_blocks"]]
        snap["block_pool"] = pool
    if isinstance(snap.get("exception"), str):
        snap["exception"] = _ADDRESS.sub("0x?", snap["exception"])
    plain = _plain(snap)
    assert isinstance(plain, dict)
    return plain


def not_applicable(trace: Trace, mode: str) -> str | None:
    """Why the installed release cannot run ``trace``'s scheduler axis in ``mode``, or None."""
    from conformance._core.axes import axis

    if "axis" not in trace.meta:
        return None
    chosen = axis(trace.meta["axis"])
    why = chosen.unavailable(mode)
    if why is None and mode not in chosen.modes:
        why = f"the axis runs in {', '.join(chosen.modes)} only"
    return why


def workload_steps(
    trace: Trace, mode: str, max_drain: int = MAX_DRAIN
) -> str | Iterator[tuple[str, dict[str, Any], bool]]:
    """Run ``trace`` on the installed vLLM's own scheduler in ``mode`` an operation at a time:
    (operation described, normalised observation, whether it was a drain step) as the iterator
    is advanced, so that a caller comparing two releases can stop at their first difference
    (``conformance.release.release_shrink``). A string instead says why the release cannot run
    it (the axis, or vLLM's config validation refuses the combination in this mode)."""
    from conformance._core.sides import make_side
    from conformance._core.subjects import UpstreamSubject

    why = not_applicable(trace, mode)
    if why is not None:
        return why
    cfg = trace.config.with_(async_scheduling=mode == "async")
    try:
        side = make_side(UpstreamSubject(), cfg, None)
    except ValueError as exc:  # vLLM's config validation refuses the combination in this mode
        first = str(exc).strip().splitlines()
        reason = next(
            (ln.strip() for ln in first if "Value error" in ln), first[0] if first else ""
        )
        return f"vLLM refuses it: {reason}"
    return _steps(trace, side, cfg, max_drain)


def _steps(
    trace: Trace, side: Any, cfg: HarnessConfig, max_drain: int
) -> Iterator[tuple[str, dict[str, Any], bool]]:
    hashes = _Hashes()
    arrivals = 0

    def apply(op: Op, index: int | None = None) -> dict[str, Any]:
        nonlocal arrivals
        prompt = None
        arrival = float(arrivals)
        # A session's input is the request its client sends (``Trace.session_input``).
        sent = trace.session_input(op, index) if isinstance(op, StreamInput) else op
        if isinstance(sent, AddRequest):
            prompt = trace.prompt_of(sent)
            arrivals += 1
            if sent.arrival is not None:
                arrival = sent.arrival
        return normalise(side.apply(sent, prompt, cfg, arrival), hashes)

    paused = False
    for index, op in enumerate(trace.ops):
        paused = op.state != "off" if isinstance(op, Pause) else paused
        yield op.describe(), apply(op, index), False
    if paused:  # the engine resumes a paused scheduler before it drains (``Lockstep.drain``)
        yield Pause("off").describe(), apply(Pause("off")), True
    drain = 0
    while drain < max_drain and side.busy():
        yield Step().describe(), apply(Step()), True
        drain += 1


def run_workload(trace: Trace, mode: str, max_drain: int = MAX_DRAIN) -> dict[str, Any]:
    """Run ``trace`` on the installed vLLM's own scheduler in ``mode``; the recorded run (no
    operation, and why, when the release cannot run the trace's scheduler axis in ``mode``)."""
    steps = workload_steps(trace, mode, max_drain)
    if isinstance(steps, str):
        return {"ops": [], "drain": 0, "steps": [], "not_applicable": steps}
    ops: list[str] = []
    observed: list[dict[str, Any]] = []
    drain = 0
    for described, snap, drained in steps:
        ops.append(described)
        observed.append(snap)
        drain += drained
    return {"ops": ops, "drain": drain, "steps": observed}


# ---- writing and reading ------------------------------------------------------------------


def _versions() -> dict[str, str]:
    from conformance._core.vllm_compat import environment_versions

    v = environment_versions()
    return {k: v.get(k, "missing") for k in ("vllm", "torch", "python")}


def hash_seed() -> str:
    return os.environ.get("PYTHONHASHSEED", "random")


def record(
    out: str | Path,
    *,
    seed: int = DEFAULT_SEED,
    size: int = DEFAULT_SIZE,
    traces: str | Path | None = None,
    modes: Sequence[str] = MODES,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Record the corpus on the installed vLLM into ``out``; returns the header."""
    if not hashing.chosen():
        # vLLM frees a multi-id abort's blocks in set order: unpinned, two runs differ.
        raise RecordingError("recording needs a fixed PYTHONHASHSEED (run with PYTHONHASHSEED=0)")
    corpus = build_corpus(seed, size, traces)
    started = time.monotonic()
    mode_seconds = dict.fromkeys(modes, 0.0)
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile("w+", dir=out_path.parent) as body:
        for n, w in enumerate(corpus, 1):
            runs = {}
            for mode in modes:
                t0 = time.monotonic()
                runs[mode] = run_workload(w.trace, mode)
                mode_seconds[mode] += time.monotonic() - t0
            line = {"workload": w.name, "source": w.source, "trace": _trace_identity(w.trace)}
            if "variant" in w.trace.meta and w.source == "generated":
                line["variant"] = w.trace.meta["variant"]
                if "axis" in w.trace.meta:
                    line["axis"] = w.trace.meta["axis"]
            line["modes"] = runs
            body.write(_canonical(line) + "\n")
            if progress is not None and (n % 20 == 0 or n == len(corpus)):
                progress(
                    f"record: {n}/{len(corpus)} workloads ({time.monotonic() - started:.0f} s)"
                )
        header = {
            "schema": SCHEMA,
            **_versions(),
            "pythonhashseed": hash_seed(),
            "corpus": corpus_identity(seed, size, corpus),
            "config": corpus_config().to_dict(),
            "variants": all_variants(),
            "modes": list(modes),
            "max_drain": MAX_DRAIN,
            "absent_fields": absent_fields(),
            "seconds": round(time.monotonic() - started, 1),
            "mode_seconds": {m: round(s, 1) for m, s in mode_seconds.items()},
            "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        body.seek(0)
        tmp = out_path.with_name(out_path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write(_canonical(header) + "\n")
            for chunk in iter(lambda: body.read(1 << 20), ""):
                f.write(chunk)
        tmp.replace(out_path)  # a reader never sees half a recording
    return header


@dataclass
class Recording:
    path: Path
    header: dict[str, Any]
    workloads: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def vllm(self) -> str:
        return str(self.header["vllm"])


def check_record(record: Any, where: str, path: Path | str) -> None:
    """``RecordingError`` naming the file, the line and the field when ``record`` (a header or a
    workload line) does not match ``conformance/schemas/recording.schema.json``."""
    from conformance._core import schemas

    if not isinstance(record, dict):
        raise RecordingError(f"{path}: {where}: should be an object, got {type(record).__name__}")
    found = schemas.problem("recording", record)
    if found is not None:
        name = record.get("workload")
        named = f" (workload {name})" if isinstance(name, str) and "schema" not in record else ""
        raise RecordingError(f"{path}: {where}{named}: {found}")


def _lines(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        f = open(path)
    except OSError as exc:
        raise RecordingError(f"cannot read recording {path}: {exc.strerror or exc}") from None
    with f:
        for n, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                yield n, json.loads(text)
            except json.JSONDecodeError as exc:
                raise RecordingError(
                    f"{path}: line {n} is not JSON ({exc.msg}; truncated file?)"
                ) from None
            except UnicodeDecodeError:
                raise RecordingError(f"{path}: line {n} is not text") from None


def open_recording(path: str | Path) -> tuple[Recording, Iterator[dict[str, Any]]]:
    """A recording's checked header (``workloads`` left empty) and its workload lines, read
    and checked one at a time as they are iterated (a recording of a large corpus is never
    held whole). ``RecordingError`` names the file and the field."""
    p = Path(path)
    lines = _lines(p)
    try:
        _, header = next(lines)
    except StopIteration:
        raise RecordingError(f"{p}: empty file, not a recording") from None
    if isinstance(header, dict) and "schema" not in header:
        raise RecordingError(f"{p}: header (line 1): field 'schema' is missing: not a recording")
    check_record(header, "header (line 1)", p)
    return Recording(p, header), _checked_lines(p, header["modes"], lines)


def _checked_lines(
    p: Path, modes: list[str], lines: Iterator[tuple[int, Any]]
) -> Iterator[dict[str, Any]]:
    seen: set[str] = set()
    for n, line in lines:
        if isinstance(line, dict) and "schema" in line:
            raise RecordingError(f"{p}: line {n}: a second header (two recordings joined?)")
        check_record(line, f"line {n}", p)
        name = line["workload"]
        where = f"line {n} (workload {name})"
        for mode in modes:
            if mode not in line["modes"]:
                raise RecordingError(f"{p}: {where}: field 'modes.{mode}' is missing")
            run = line["modes"][mode]
            if len(run["ops"]) != len(run["steps"]):
                raise RecordingError(
                    f"{p}: {where}: modes.{mode}: {len(run['ops'])} ops but "
                    f"{len(run['steps'])} steps"
                )
        if name in seen:
            raise RecordingError(f"{p}: {where}: workload {name!r} appears twice")
        seen.add(name)
        yield line


def load_recording(path: str | Path) -> Recording:
    """A whole recording, every line checked against its schema (``open_recording`` reads it
    lazily)."""
    rec, lines = open_recording(path)
    for line in lines:
        rec.workloads[line["workload"]] = line
    return rec


# ---- the command --------------------------------------------------------------------------


def cmd_record(args: Any) -> int:
    import sys

    from conformance._core.preflight import check_environment, fail_environment, folder_problem

    problem = check_environment(None)
    if problem:
        return fail_environment(problem)
    if args.size < 0:
        return fail_environment(f"--size {args.size}: must be 0 or more")
    if args.size == 0 and args.traces is None:
        return fail_environment("--size 0 without --traces: the corpus would be empty")
    out = Path(args.out)
    if out.is_dir():
        return fail_environment(f"--out {out}: is a folder; give the recording's file name")
    problem = folder_problem(out.parent)
    if problem:
        return fail_environment(f"--out {out}: {problem}")
    modes = tuple(args.modes)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    import logging

    # vLLM warns each time a reset of the prefix cache is refused while blocks are held; in a
    # recording that is an outcome it records (the reset's result), and the warnings would bury
    # the progress lines. Errors still show.
    logging.getLogger("vllm").setLevel(logging.ERROR)

    try:
        header = record(
            out, seed=args.seed, size=args.size, traces=args.traces, modes=modes, progress=say
        )
    except RecordingError as exc:
        return fail_environment(str(exc))
    corpus = header["corpus"]
    print(
        f"record: vLLM {header['vllm']}: {corpus['size']} generated workloads"
        + (f" + {len(corpus['traces'])} saved traces" if corpus["traces"] else "")
        + f" x {', '.join(modes)} in {header['seconds']} s -> {out}"
    )
    return 0


def add_parser(sub: Any) -> None:
    r = sub.add_parser(
        "record",
        help="record the installed vLLM's own schedulers on a corpus (for release-diff)",
    )
    r.add_argument("--out", required=True, help="recording file to write (JSON lines)")
    r.add_argument("--seed", type=int, default=DEFAULT_SEED, help="corpus seed")
    r.add_argument("--size", type=int, default=DEFAULT_SIZE, help="number of generated workloads")
    r.add_argument(
        "--traces", default=None, help="folder of saved traces (*.json) added to the corpus"
    )
    r.add_argument(
        "--modes", nargs="+", choices=MODES, default=list(MODES), help="scheduling modes"
    )
    r.set_defaults(func=cmd_record)
