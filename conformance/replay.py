"""Failure traces: where they are written, and how a saved trace is re-run.

Every lock-step failure is shrunk (``lockstep.shrink``) and written as a trace (JSON) into the
failures folder — ``./conformance-failures/`` unless ``OMNI_CONFORMANCE_FAILURES`` or the
pytest option ``--conformance-failures`` says otherwise. The trace's ``meta`` records the subject
spec, the first difference and the test that found it, so ``omni-conformance replay TRACE.json``
needs nothing else to reproduce it and print the same first difference.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from conformance.compare import FieldDifference
from conformance.differences import Registry
from conformance.lockstep import Lockstep, run_trace, same_failure, shrink
from conformance.subjects import Subject, load_subject
from conformance.workload import Trace

DEFAULT_FAILURES_DIR = "conformance-failures"


def failures_dir(override: str | Path | None = None) -> Path:
    return Path(override or os.environ.get("OMNI_CONFORMANCE_FAILURES") or DEFAULT_FAILURES_DIR)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")[:120] or "failure"


def record_failure(
    session: Lockstep,
    *,
    subject_spec: str | None = None,
    name: str | None = None,
    folder: str | Path | None = None,
    do_shrink: bool = True,
    registry: Registry | None = None,
) -> tuple[Path, FieldDifference]:
    """Shrink the session's failing trace, save it, and return (path, first difference)."""
    assert session.failure is not None, "record_failure needs a failed session"
    trace = Trace(session.config, list(session.trace.ops), dict(session.trace.prefixes))
    failure = session.failure
    subject = session.subject
    if do_shrink:
        trace = shrink(trace, same_failure(subject, failure.path, registry=registry))
        rerun = run_trace(trace, subject, registry=registry)
        if rerun.failure is not None:
            failure = rerun.failure
    trace.meta = {
        "subject": subject_spec or subject.name,
        "test": name,
        "disabled_entries": sorted(registry.disabled) if registry is not None else [],
        "first_difference": failure.to_dict(),
    }
    path = failures_dir(folder) / f"{_slug(name or subject.name)}.json"
    trace.save(path)
    return path, failure


def replay(
    path: str | Path, subject: str | Subject | None = None
) -> tuple[FieldDifference | None, dict[str, Any]]:
    """Re-run a saved trace; returns (first difference or None, the trace's meta)."""
    trace = Trace.load(path)
    spec = subject if subject is not None else trace.meta.get("subject", "omni")
    subj = load_subject(spec)
    registry = Registry(subj.differences()).without(trace.meta.get("disabled_entries", ()))
    result = run_trace(trace, subj, registry=registry)
    return result.failure, trace.meta
