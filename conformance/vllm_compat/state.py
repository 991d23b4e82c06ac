"""vLLM scheduler state the harness reads: block pool, KV coordinator, requests, queues, outputs.

Everything the harness reads from inside vLLM objects goes through a function here, so a
difference between vLLM releases is a change to this file alone, keyed by version through
``conformance.vllm_compat.versions.by_release``. Nothing here mutates vLLM state, and nothing
here performs a destructive read (``make_stats``, ``take_events``, ``take_new_block_ids``,
``take_prefill_stats`` drain state; the harness never calls them, so both sides see exactly the
drains their own code performs).
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

from conformance.vllm_compat.versions import ByRelease, Change

# ---- block pool -------------------------------------------------------------------------


# ``map`` over an attrgetter builds the id lists at C speed; the harness reads every block and
# every request's blocks after every operation, so these loops dominate its own cost.
_block_id = attrgetter("block_id")
_ref_cnt = attrgetter("ref_cnt")


def block_pool(scheduler: Any) -> Any:
    return scheduler.kv_cache_manager.block_pool


def free_block_order(pool: Any) -> list[int]:
    """Free-queue order (the next block to be reused or evicted comes first)."""
    return list(map(_block_id, pool.free_block_queue.get_all_free_blocks()))


def num_free_blocks(pool: Any) -> int:
    return int(pool.get_num_free_blocks())


def block_table(pool: Any) -> tuple[list[int], list[tuple[int, bytes]]]:
    """Ref counts of every block, and (block id, hash) of every block that holds a hash."""
    blocks = pool.blocks
    refs = list(map(_ref_cnt, blocks))
    hashed = [(b.block_id, bytes(h)) for b in blocks if (h := b._block_hash) is not None]
    return refs, hashed


def num_cached_hashes(pool: Any) -> int:
    return len(pool.cached_block_hash_to_block)


# ---- requests and queues ------------------------------------------------------------------


def request_block_ids(scheduler: Any, request_id: str) -> tuple[tuple[int, ...], ...]:
    """Block ids a request holds, per KV-cache group (the scheduler's view, without copying)."""
    return block_ids_reader(scheduler)(request_id)


def block_ids_reader(scheduler: Any) -> Any:
    """``request_block_ids`` for many requests of one scheduler: the KV groups are looked up once
    per snapshot instead of once per request."""
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    tables = [mgr.req_to_blocks for mgr in managers]
    if len(tables) == 1:
        (table,) = tables

        def one_group(request_id: str) -> tuple[tuple[int, ...], ...]:
            blocks = table.get(request_id)
            return (tuple(map(_block_id, blocks)) if blocks else (),)

        return one_group

    def per_group(request_id: str) -> tuple[tuple[int, ...], ...]:
        out = []
        for table in tables:
            blocks = table.get(request_id)
            out.append(tuple(map(_block_id, blocks)) if blocks else ())
        return tuple(out)

    return per_group


def request_fields(request: Any) -> dict[str, Any]:
    """The per-request state C-01 compares; lists are copied, so later mutation cannot leak in."""
    return {
        "status": request.status.name,
        "num_computed_tokens": request.num_computed_tokens,
        "output_token_ids": tuple(request._output_token_ids),
        "num_output_placeholders": request.num_output_placeholders,
        "num_stale_output_tokens": request.num_stale_output_tokens,
        "drop_stale_output": request.drop_stale_output,
        "num_in_flight_tokens": request.num_in_flight_tokens,
        "num_preemptions": request.num_preemptions,
        "stop_reason": request.stop_reason,
    }


def queue_ids(queue: Any) -> list[str]:
    return [r.request_id for r in queue]


# Admission queues besides ``waiting``: (name, ordered?). An ordered queue is compared in
# order; an unordered one is a marker set and compared sorted. Both sides of a comparison always
# run on the same release, so the field names never need to match across releases.
ADMISSION_QUEUES: ByRelease[tuple[tuple[str, bool], ...]] = ByRelease(
    "admission queues",
    (("skipped_waiting", True),),
    [
        Change(
            "0.31.0",
            (("kv_holding_waiting", True), ("deferred_waiting", False)),
            "skipped_waiting replaced by kv_holding_waiting (ordered) + deferred_waiting (a set)",
        )
    ],
)


def scheduler_queues(scheduler: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "running": [r.request_id for r in scheduler.running],
        "waiting": queue_ids(scheduler.waiting),
    }
    for name, ordered in ADMISSION_QUEUES.value():
        ids = queue_ids(getattr(scheduler, name))
        out[name] = ids if ordered else sorted(ids)
    out["finished_pending"] = sorted(scheduler.finished_req_ids)
    return out


def finished_unreported(scheduler: Any) -> set[str]:
    """Ids finished since the last ``schedule()``: the worker has not been told yet."""
    return set(scheduler.finished_req_ids)


def status_name(request: Any) -> str:
    return str(request.status.name)


def live_request_ids(scheduler: Any) -> list[str]:
    return list(scheduler.requests)


def is_finished(request: Any) -> bool:
    return bool(request.is_finished())


# ---- outputs ------------------------------------------------------------------------------


# Bound ``EngineCoreOutput`` -> upstream's class found on its MRO. Keyed by the bound class, so
# a subject that rebinds the name later still gets its MRO searched; the search itself ran once
# per output of every step.
_UPSTREAM_OUTPUT_CLASS: dict[Any, Any] = {}


def upstream_output_class() -> Any:
    """vLLM's own ``EngineCoreOutput``, even where a subject rebound the name to a subclass
    (vllm-omni does, in every loaded ``vllm`` module): the class of that name that
    ``vllm.v1.engine`` defines, found on the bound class's MRO."""
    from vllm.v1.engine import EngineCoreOutput

    found = _UPSTREAM_OUTPUT_CLASS.get(EngineCoreOutput)
    if found is not None:
        return found
    found = EngineCoreOutput
    for cls in EngineCoreOutput.__mro__:
        if cls.__module__ == "vllm.v1.engine" and cls.__name__ == "EngineCoreOutput":
            found = cls
            break
    _UPSTREAM_OUTPUT_CLASS[EngineCoreOutput] = found
    return found


_BASE_OUTPUT_FIELDS: frozenset[str] | None = None


def base_output_fields() -> frozenset[str]:
    global _BASE_OUTPUT_FIELDS
    if _BASE_OUTPUT_FIELDS is None:
        _BASE_OUTPUT_FIELDS = frozenset(upstream_output_class().__struct_fields__)
    return _BASE_OUTPUT_FIELDS


def output_extra_fields(out: Any) -> dict[str, Any]:
    """Trailing fields a subclass of ``EngineCoreOutput`` adds, only where they are not default.

    msgspec omits defaults on the wire too, so a default value is not an observable difference.
    """
    cls = type(out)
    fields = cls.__struct_fields__
    base = base_output_fields()
    if len(fields) == len(base):
        return {}
    defaults = cls.__struct_defaults__
    offset = len(fields) - len(defaults)
    extra: dict[str, Any] = {}
    for i, name in enumerate(fields):
        if name in base:
            continue
        value = getattr(out, name)
        j = i - offset
        if j >= 0 and value == defaults[j]:
            continue
        extra[name] = value
    return extra


def output_type_name(out: Any) -> str | None:
    """None for upstream's own ``EngineCoreOutput``; the subclass name otherwise."""
    cls = type(out)
    return None if cls is upstream_output_class() else cls.__name__


def prefill_stats_fields(stats: Any) -> dict[str, int] | None:
    if stats is None:
        return None
    return {
        "num_prompt_tokens": stats.num_prompt_tokens,
        "num_cached_tokens": stats.num_cached_tokens,
        "num_local_cached_tokens": stats.num_local_cached_tokens,
    }


def finish_reason_name(reason: Any) -> str | None:
    return None if reason is None else str(reason)


def none_hash() -> Any:
    """The seed every request's block-hash chain starts from (``kv_cache_utils.NONE_HASH``,
    set once per process by ``init_none_hash``)."""
    from vllm.v1.core import kv_cache_utils

    return kv_cache_utils.NONE_HASH


def set_none_hash(value: Any) -> None:
    """Adopt another process's ``NONE_HASH``, so both processes' block hashes are comparable
    (``hash_block_tokens`` reads the module global at every call)."""
    from vllm.v1.core import kv_cache_utils

    kv_cache_utils.NONE_HASH = value
