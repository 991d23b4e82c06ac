"""Failure traces: where they are written, what they record, and how a saved trace is re-run.

Every lock-step failure is written as a shrunk trace (JSON, ``conformance._core.lockstep.Shrinker``)
into the failures folder (``./conformance-failures/`` unless ``--conformance-failures-dir``,
``check --failures-dir`` or ``OMNI_CONFORMANCE_FAILURES`` says otherwise). Its ``meta`` records
where it came from (subject, test, profile, mode, versions, the first difference, the unshrunk
find, the shrink) so a replay can tell whether it still means what it meant.

``replay_trace`` re-runs a loaded trace and returns a ``ReplayOutcome``: reproduced or not, the
same first difference or another, and whether vLLM or the subject differ from the record.

The fields of ``meta``: docs/design.md, "Inside the gate"; ``omni-conformance replay`` and its
exit codes: docs/adopting-the-gate.md, section 7.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance._core.compare import FieldDifference
from conformance._core.differences import Registry
from conformance._core.driver import WorkerExecutor
from conformance._core.lockstep import SET_ASIDE, Lockstep, Shrinker, run_trace, same_failure
from conformance._core.pristine import oracle_placement
from conformance._core.subjects import Subject, load_subject
from conformance._core.workload import Trace

DEFAULT_FAILURES_DIR = "conformance-failures"
# The fields of a first difference that must match for a replay to count as the same failure.
IDENTITY_FIELDS = ("step", "op", "path", "upstream", "subject")


class TraceError(ValueError):
    """A trace file that cannot be read (truncated, not JSON, not a trace); one-line message."""


def failures_dir(override: str | Path | None = None) -> Path:
    return Path(override or os.environ.get("OMNI_CONFORMANCE_FAILURES") or DEFAULT_FAILURES_DIR)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")[:120] or "failure"


def _uses_worker(session: Lockstep) -> bool:
    executor = session.sub.executor
    return isinstance(getattr(executor, "inner", executor), WorkerExecutor)


@functools.cache
def _versions() -> dict[str, str]:
    from conformance._core.vllm_compat import environment_versions

    versions = environment_versions()
    return {k: versions.get(k, "missing") for k in ("vllm", "torch", "python")}


def record_failure(
    session: Lockstep,
    *,
    subject_spec: str | None = None,
    name: str | None = None,
    folder: str | Path | None = None,
    do_shrink: bool = True,
    registry: Registry | None = None,
    profile: str | None = None,
    test: str | None = None,
    time_budget: float | None = None,
) -> tuple[Path, FieldDifference]:
    """Save the session's failing trace (shrunk unless ``do_shrink=False``) with its provenance.

    ``name`` names the file (and the test when ``test``, e.g. a pytest node id, is not given).
    Returns (path, the saved trace's first difference). Shrinking is bounded by ``time_budget``
    seconds (default ``conformance._core.lockstep.shrink_seconds()``); the best trace found by then is
    saved. A shrunk trace that does not fail the same way when re-run is discarded and the trace
    as found is saved instead (and ``meta.shrink.discarded`` says so).
    """
    assert session.failure is not None, "record_failure needs a failed session"
    # A failure found with sections set aside replays (and shrinks) with them set aside.
    set_aside = {SET_ASIDE: sorted(session.set_aside)} if session.set_aside else {}
    found = Trace(
        session.config, list(session.trace.ops), dict(session.trace.prefixes), dict(set_aside)
    )
    found_failure = session.failure
    subject = session.subject
    use_worker = _uses_worker(session)
    trace, failure = found, found_failure
    shrink_info: dict[str, Any] | None = None
    if do_shrink:
        try:
            trace, failure, shrink_info = _shrunk(
                found, found_failure, subject, registry, use_worker, time_budget
            )
        except Exception as exc:  # the failure as found is still worth saving
            shrink_info = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    trace.meta = {
        "subject": subject_spec or subject.name,
        "test": test or name,
        "profile": profile,
        "mode": session.mode,
        "use_worker": use_worker,
        **_versions(),
        "oracle": oracle_placement().report_value(),
        "disabled_entries": sorted(registry.disabled) if registry is not None else [],
        "first_difference": failure.to_dict(),
        "found": {"ops": len(found.ops), "first_difference": found_failure.to_dict()},
        "shrink": shrink_info,
        **set_aside,
    }
    path = failures_dir(folder) / f"{_slug(name or subject.name)}.json"
    trace.save(path)
    return path, failure


def _shrunk(
    found: Trace,
    failure: FieldDifference,
    subject: Subject,
    registry: Registry | None,
    use_worker: bool,
    time_budget: float | None,
) -> tuple[Trace, FieldDifference, dict[str, Any]]:
    check = same_failure(subject, failure.path, registry=registry, use_worker=use_worker)
    result = Shrinker(found, check, time_budget=time_budget).run()
    info = result.to_dict()
    rerun = run_trace(result.trace, subject, registry=registry, use_worker=use_worker)
    if rerun.failure is not None and rerun.failure.field == failure.field:
        return result.trace, rerun.failure, info
    info["discarded"] = "the shrunk trace did not fail the same way when re-run"
    return found, failure, info


def load_trace(path: str | Path) -> Trace:
    """``Trace.load`` with every way a file can be broken turned into one ``TraceError`` line."""
    try:
        trace = Trace.load(path)
        recorded = trace.meta.get("first_difference")
        if recorded is not None:
            FieldDifference.from_dict(recorded)
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise TraceError(
            f"{path} is not a valid trace (truncated or not JSON: {exc.msg} at line {exc.lineno})"
        ) from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise TraceError(f"{path} is not a valid trace ({type(exc).__name__}: {detail})") from None
    return trace


def _identity(diff: dict[str, Any] | None) -> dict[str, Any] | None:
    if diff is None:
        return None
    normal = json.loads(json.dumps(diff, default=str))
    return {k: normal.get(k) for k in IDENTITY_FIELDS}


@dataclass
class ReplayOutcome:
    """A replay compared with its record (see the module docstring)."""

    trace: Trace
    subject: str  # the spec replayed on
    vllm: str  # the vLLM version replayed on
    difference: FieldDifference | None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def recorded_subject(self) -> str | None:
        value = self.meta.get("subject")
        return None if value is None else str(value)

    @property
    def recorded_vllm(self) -> str | None:
        value = self.meta.get("vllm")
        return None if value is None else str(value)

    @property
    def recorded_difference(self) -> FieldDifference | None:
        recorded = self.meta.get("first_difference")
        return None if recorded is None else FieldDifference.from_dict(recorded)

    @property
    def reproduced(self) -> bool:
        return self.difference is not None

    @property
    def same_as_recorded(self) -> bool:
        """Reproduced with the recorded first difference (step, op, field and both values)."""
        if self.difference is None:
            return False
        recorded = _identity(self.meta.get("first_difference"))
        return recorded is None or recorded == _identity(self.difference.to_dict())

    def context_note(self) -> str | None:
        """One line when the replay runs on another subject or vLLM than the trace recorded."""
        other_subject = self.recorded_subject not in (None, self.subject)
        other_vllm = self.recorded_vllm not in (None, self.vllm)
        if not (other_subject or other_vllm):
            return None
        recorded = f"subject {self.recorded_subject!r}, vLLM {self.recorded_vllm or 'unknown'}"
        now = f"subject {self.subject!r}, vLLM {self.vllm}"
        return f"note: trace recorded on {recorded}; replaying on {now}"


def replay_trace(trace: Trace, subject: Subject, spec: str) -> ReplayOutcome:
    """Re-run ``trace`` on ``subject`` (loaded from ``spec``) with the recorded registry."""
    registry = Registry(subject.differences()).without(trace.meta.get("disabled_entries", ()))
    use_worker = bool(trace.meta.get("use_worker", False))
    result = run_trace(trace, subject, registry=registry, use_worker=use_worker)
    return ReplayOutcome(trace, spec, _versions()["vllm"], result.failure, dict(trace.meta))


def replay(
    path: str | Path, subject: str | Subject | None = None
) -> tuple[FieldDifference | None, dict[str, Any]]:
    """Re-run a saved trace; returns (first difference or None, the trace's meta)."""
    trace = load_trace(path)
    spec = subject if subject is not None else trace.meta.get("subject", "omni")
    subj = load_subject(spec)
    label = spec if isinstance(spec, str) else subj.name
    outcome = replay_trace(trace, subj, label)
    return outcome.difference, outcome.meta
