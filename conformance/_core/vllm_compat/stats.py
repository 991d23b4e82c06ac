"""What the harness reads of vLLM's statistics and events, as plain comparable values.

With ``HarnessConfig.log_stats`` the scheduler attaches a ``SchedulerStats`` to a step's
outputs, events (queued, scheduled, preempted) and per-request spec-decode metrics to each
request's output; with ``HarnessConfig.kv_events`` it publishes KV-cache events after each update.
Wall-clock values (timestamps, iteration timings, perf and CUDA-graph stats) are dropped: they
differ between two runs of one scheduler. Everything else is kept, field by field, so a release
that adds a field is compared on it without a change here.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from conformance._core.vllm_compat.versions import ByRelease, Change

# Field paths of a recorded observation (``*``: any key or list position) that exist from a
# release on: attributes of vLLM's statistics, event and output classes, which every object of
# the class has or lacks alike. A recording names those its release lacks in ``absent_fields``
# (``record.absent_fields``); ``release-diff`` compares them only where both releases have them
# and reports each once as a field one release lacks. Keys of free-form dictionaries
# (``kv_transfer_params``, ``ec_transfer_params``, connector metrics) are values the scheduler
# or connector chose per request, so they are not here: a new key there is a behaviour change.
_FROM_0_29 = frozenset({"outputs.*.spec_decode_metrics"})
_FROM_0_30 = _FROM_0_29 | {
    "kv_events.*.events.*.ownership",
    "kv_events.*.events.*.session_id",
}
_FROM_0_32 = _FROM_0_30 | {
    "stats.num_kv_fetch_reqs_by_stage",
    "stats.prefix_cache_stats.hits_by_source",
    "stats.connector_prefix_cache_stats.hits_by_source",
}
STATS_FIELDS: ByRelease[frozenset[str]] = ByRelease(
    "statistics, event and output fields",
    frozenset(),
    [
        Change(
            "0.29.0",
            _FROM_0_29,
            "EngineCoreOutput gains spec_decode_metrics (per-request speculative-decoding metrics)",
        ),
        Change(
            "0.30.0",
            _FROM_0_30,
            "KV events: BlockStored gains ownership, session_id; BlockRemoved ownership (by 0.30)",
        ),
        Change(
            "0.32.0",
            _FROM_0_32,
            "SchedulerStats gains num_kv_fetch_reqs_by_stage; PrefixCacheStats hits_by_source",
        ),
        Change(
            "0.33.0",
            _FROM_0_32 | {"stats.ec_connector_stats", "kv_events.*.events.*.lookahead_token_ids"},
            "SchedulerStats gains ec_connector_stats; BlockStored gains lookahead_token_ids",
        ),
    ],
)

# Fields that hold wall-clock measurements, not scheduler decisions.
_CLOCK_FIELDS = frozenset({"iteration_details", "perf_stats", "cudagraph_stats", "ts", "timestamp"})
# Connector statistics are named metrics; those that measure time (the offloading connector's
# ``vllm:kv_offload_lookup_sync_delay_seconds``) differ between two runs of one scheduler.
_CLOCK_METRIC = re.compile(r"(_seconds|_time)$")


def plain(value: Any) -> Any:
    """``value`` (dataclasses, msgspec structs, enums, containers) as plain comparable values,
    without wall-clock fields."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted(plain(v) for v in value)
    name = getattr(value, "name", None)
    if isinstance(name, str) and hasattr(type(value), "__members__"):  # an enum member
        return name
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    elif hasattr(type(value), "__struct_fields__"):
        fields = {n: getattr(value, n) for n in type(value).__struct_fields__}
        fields["__kind__"] = type(value).__name__  # tagged unions (KV events) differ by class
    elif hasattr(value, "tolist"):  # a tensor or an array
        return value.tolist()
    else:
        return repr(value)
    return {k: plain(v) for k, v in fields.items() if k not in _CLOCK_FIELDS}


def scheduler_stats(outputs: dict[int, Any] | None) -> dict[str, Any] | None:
    """The step's ``SchedulerStats`` (on the first client's outputs), or None when it has none;
    connector metrics that measure wall-clock time are dropped with the rest."""
    for client in sorted(outputs or {}):
        stats = getattr(outputs[client], "scheduler_stats", None)  # type: ignore[index]
        if stats is not None:
            found = {"client": client, **plain(stats)}
            if found.get("kv_connector_stats") is not None:
                found["kv_connector_stats"] = _without_clock(found["kv_connector_stats"])
            return found
    return None


def _without_clock(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_clock(v) for k, v in value.items() if not _CLOCK_METRIC.search(k)}
    return value


def request_events(out: Any) -> list[str] | None:
    """The types of the events on one request's output, in order (None: no events field set)."""
    events = getattr(out, "events", None)
    if not events:
        return None
    return [plain(e.type) for e in events]


def spec_decode_metrics(out: Any) -> Any:
    """A request's spec-decode metrics on its output (the field is new in 0.33; None before)."""
    metrics = getattr(out, "spec_decode_metrics", None)
    return None if metrics is None else plain(metrics)


class _Recorder:
    """Stands in for the scheduler's event publisher: keeps what it is given until taken."""

    def __init__(self) -> None:
        self.batches: list[Any] = []
        self.closed = False

    def publish(self, batch: Any) -> None:
        self.batches.append(plain(batch))

    def shutdown(self) -> None:
        self.closed = True

    def get_publisher_config(self) -> Any:
        return None


def capture_kv_events(scheduler: Any) -> None:
    """Keep what ``scheduler`` publishes (``take_kv_events``) instead of dropping it: the
    configuration names the null publisher, which the scheduler built in ``__init__``."""
    scheduler.kv_event_publisher = _Recorder()


def take_kv_events(scheduler: Any) -> list[Any] | None:
    """The event batches ``scheduler`` published since the last call (None when it captures
    none)."""
    recorder = getattr(scheduler, "kv_event_publisher", None)
    if not isinstance(recorder, _Recorder):
        return None
    taken, recorder.batches = recorder.batches, []
    return taken


def shut_down_parts(scheduler: Any) -> dict[str, bool]:
    """Which of the parts ``Scheduler.shutdown`` must close were closed: the KV event publisher
    (when the harness captures it) and the KV connector (when it is the harness's own, which
    records its ``shutdown``). Parts the harness cannot see are left out."""
    parts: dict[str, bool] = {}
    recorder = getattr(scheduler, "kv_event_publisher", None)
    if isinstance(recorder, _Recorder):
        parts["kv_event_publisher"] = recorder.closed
    connector = getattr(scheduler, "connector", None)
    if connector is not None and hasattr(connector, "shut_down"):
        parts["kv_connector"] = bool(connector.shut_down)
    return parts
