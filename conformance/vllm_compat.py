"""The one module that knows vLLM's internal layout (supported: vLLM 0.33.0).

Everything the harness reads from inside vLLM objects — block-pool internals, the KV-cache
coordinator's per-request block lists, request counters, queue iteration, output struct field
tables — goes through a function here, so supporting another vLLM version is a change to this
file alone. Nothing here mutates vLLM state, and nothing here performs a destructive read
(``make_stats``, ``take_events``, ``take_new_block_ids``, ``take_prefill_stats`` drain state; the
harness never calls them, so both sides see exactly the drains their own code performs).
"""

from __future__ import annotations

from typing import Any

SUPPORTED_VLLM = ("0.33.0",)


class EnvironmentProblem(RuntimeError):
    """The environment cannot run the harness (vLLM missing or an unsupported version)."""


def vllm_version() -> str:
    """The installed vLLM version, or ``EnvironmentProblem`` with a one-line reason."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("vllm")
        except PackageNotFoundError:
            raise EnvironmentProblem("vLLM is not installed: pip install 'vllm==0.33.0'") from None
    except ImportError as exc:  # pragma: no cover - importlib.metadata is stdlib
        raise EnvironmentProblem(f"cannot inspect installed packages: {exc}") from None


def check_vllm(allowed: tuple[str, ...] = SUPPORTED_VLLM) -> str:
    v = vllm_version()
    if v not in allowed:
        raise EnvironmentProblem(
            f"vLLM {v} is installed but this harness supports vLLM {', '.join(allowed)}"
        )
    return v


def environment_versions() -> dict[str, str]:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("vllm", "torch", "hypothesis"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "missing"
    return out


# ---- block pool -------------------------------------------------------------------------


def block_pool(scheduler: Any) -> Any:
    return scheduler.kv_cache_manager.block_pool


def free_block_order(pool: Any) -> list[int]:
    """Free-queue order (the next block to be reused or evicted comes first)."""
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def num_free_blocks(pool: Any) -> int:
    return int(pool.get_num_free_blocks())


def block_table(pool: Any) -> tuple[list[int], list[tuple[int, bytes]]]:
    """Ref counts of every block, and (block id, hash) of every block that holds a hash."""
    refs: list[int] = []
    hashed: list[tuple[int, bytes]] = []
    for b in pool.blocks:
        refs.append(b.ref_cnt)
        h = b._block_hash
        if h is not None:
            hashed.append((b.block_id, bytes(h)))
    return refs, hashed


def num_cached_hashes(pool: Any) -> int:
    return len(pool.cached_block_hash_to_block)


# ---- requests and queues ------------------------------------------------------------------


def request_block_ids(scheduler: Any, request_id: str) -> tuple[tuple[int, ...], ...]:
    """Block ids a request holds, per KV-cache group (the scheduler's view, without copying)."""
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    out = []
    for mgr in managers:
        blocks = mgr.req_to_blocks.get(request_id)
        out.append(tuple(b.block_id for b in blocks) if blocks else ())
    return tuple(out)


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


def scheduler_queues(scheduler: Any) -> dict[str, Any]:
    return {
        "running": [r.request_id for r in scheduler.running],
        "waiting": queue_ids(scheduler.waiting),
        "kv_holding_waiting": queue_ids(scheduler.kv_holding_waiting),
        "deferred_waiting": sorted(r.request_id for r in scheduler.deferred_waiting),
        "finished_pending": sorted(scheduler.finished_req_ids),
    }


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

_BASE_OUTPUT_FIELDS: frozenset[str] | None = None


def base_output_fields() -> frozenset[str]:
    global _BASE_OUTPUT_FIELDS
    if _BASE_OUTPUT_FIELDS is None:
        from vllm.v1.engine import EngineCoreOutput

        _BASE_OUTPUT_FIELDS = frozenset(EngineCoreOutput.__struct_fields__)
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
    from vllm.v1.engine import EngineCoreOutput

    cls = type(out)
    return None if cls is EngineCoreOutput else cls.__name__


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
