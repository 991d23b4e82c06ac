"""vLLM scheduler state the harness reads: block pool, KV coordinator, requests, queues, outputs.

Everything the harness reads from inside vLLM objects goes through a function here, so a
difference between vLLM releases is a change to this file alone, keyed by version through
``conformance._core.vllm_compat.versions.by_release``. Nothing here mutates vLLM state, and nothing
here performs a destructive read (``make_stats``, ``take_events``, ``take_new_block_ids``,
``take_prefill_stats`` drain state; the harness never calls them, so both sides see exactly the
drains their own code performs).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat
from operator import attrgetter
from typing import Any

from conformance._core.logprobs import output_logprobs, output_prompt_logprobs
from conformance._core.vllm_compat.aux_outputs import same_aux_outputs
from conformance._core.vllm_compat.encoder_cache import same_encoder_cache
from conformance._core.vllm_compat.pause import pause_state
from conformance._core.vllm_compat.sessions import session_fields, session_reader
from conformance._core.vllm_compat.stale_output import has_stale, stale_fields, stale_row
from conformance._core.vllm_compat.stats import request_events, spec_decode_metrics
from conformance._core.vllm_compat.structured import grammar_state
from conformance._core.vllm_compat.versions import ByRelease, Change

# ---- block pool -------------------------------------------------------------------------


# The harness reads every block and every request's blocks after every operation, on both sides,
# so these loops dominate its own cost. They are list comprehensions: on Python 3.11 an
# attribute load in one is specialised for slotted and plain instances, and ran about twice as
# fast as ``map`` over an ``attrgetter`` on 128 blocks (1.7 against 3.5 us).
_block_id = attrgetter("block_id")


def block_pool(scheduler: Any) -> Any:
    return scheduler.kv_cache_manager.block_pool


_FREE_QUEUE_CLASS: list[type] = []


def _is_vllm_free_queue(queue: Any) -> bool:
    """Whether ``queue`` is vLLM's own ``FreeKVCacheBlockQueue`` (not a subject's subclass), whose
    ``get_all_free_blocks`` walks ``next_free_block`` from the fake head to the fake tail."""
    if not _FREE_QUEUE_CLASS:
        from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

        _FREE_QUEUE_CLASS.append(FreeKVCacheBlockQueue)
    return type(queue) is _FREE_QUEUE_CLASS[0]


def free_block_order(pool: Any) -> list[int]:
    """Free-queue order (the next block to be reused or evicted comes first).

    For vLLM's own queue, the walk ``get_all_free_blocks`` makes, collecting ids as it goes: one
    loop instead of a walk and a second pass over the blocks (this ran after every operation)."""
    queue = pool.free_block_queue
    if not _is_vllm_free_queue(queue):
        return list(map(_block_id, queue.get_all_free_blocks()))
    block = queue.fake_free_list_head.next_free_block
    if block is None:
        raise RuntimeError("next_free_block of fake_free_list_head should always exist")
    order: list[int] = []
    while (after := block.next_free_block) is not None:
        order.append(block.block_id)
        block = after
    return order


def num_free_blocks(pool: Any) -> int:
    return int(pool.get_num_free_blocks())


def block_table(pool: Any) -> tuple[list[int], list[tuple[int, bytes]]]:
    """Ref counts of every block, and (block id, hash) of every block that holds a hash."""
    blocks = pool.blocks
    refs = [b.ref_cnt for b in blocks]
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


# The per-request state C-01 compares: snapshot field names, and (``_rows``) the attributes they
# are read from, in the same order; the release's stale-output fields (``stale_output``) stand
# between the two parts. ``same_scheduler_state`` compares the same attributes pair by pair;
# ``_check_request_pairs`` refuses to import if it misses one ``_rows`` reads.
REQUEST_FIELDS: tuple[str, ...] = (
    "status",
    "num_computed_tokens",
    "output_token_ids",
    "num_output_placeholders",
)
_AFTER_STALE: tuple[str, ...] = ("num_in_flight_tokens", "num_preemptions", "stop_reason")
_STATUS = REQUEST_FIELDS.index("status")
_OUTPUT_TOKENS = REQUEST_FIELDS.index("output_token_ids")


def request_field_names() -> tuple[str, ...]:
    """The snapshot's per-request field names on the installed release, in ``_rows`` order."""
    return (*REQUEST_FIELDS, *stale_fields(), *_AFTER_STALE)


def _rows(requests: Iterable[Any]) -> list[tuple[Any, ...]]:
    """``request_field_names()`` of each request as read: the status enum, the live
    output-token list."""
    stale = stale_row()
    return [
        (
            r.status,
            r.num_computed_tokens,
            r._output_token_ids,
            r.num_output_placeholders,
            *stale(r),
            r.num_in_flight_tokens,
            r.num_preemptions,
            r.stop_reason,
        )
        for r in requests
    ]


def request_fields(request: Any) -> dict[str, Any]:
    """The per-request state C-01 compares; lists are copied, so later mutation cannot leak in."""
    (row,) = _rows((request,))
    fields = dict(zip(request_field_names(), row, strict=True))
    fields["status"] = row[_STATUS].name
    fields["output_token_ids"] = tuple(row[_OUTPUT_TOKENS])
    structured = request.structured_output_request
    if structured is not None:  # present only for a structured request: others read as before
        fields["grammar"] = grammar_state(structured)
    session = session_fields(request)
    if session is not None:  # likewise only for a streaming input session
        fields["session"] = session
    return fields


def _grammar_of(request: Any) -> dict[str, Any] | None:
    structured = request.structured_output_request
    return None if structured is None else grammar_state(structured)


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


# The admission queues as recorded field paths (``stats.STATS_FIELDS`` has the others).
QUEUE_FIELDS: ByRelease[frozenset[str]] = ByRelease(
    "admission queue fields",
    frozenset(f"queues.{name}" for name, _ in ADMISSION_QUEUES.base),
    [
        Change(c.since, frozenset(f"queues.{name}" for name, _ in c.value), c.what)
        for c in ADMISSION_QUEUES.changes
    ],
)


def scheduler_queues(scheduler: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "running": queue_ids(scheduler.running),
        "waiting": queue_ids(scheduler.waiting),
    }
    for name, ordered in ADMISSION_QUEUES.value():
        ids = queue_ids(getattr(scheduler, name))
        out[name] = ids if ordered else sorted(ids)
    out["finished_pending"] = sorted(scheduler.finished_req_ids)
    paused = pause_state(scheduler)
    if paused is not None:  # only while paused: snapshots of runs that never pause unchanged
        out["paused"] = paused
    return out


# Every queue ``scheduler_queues`` reads but the finished set, (name, ordered?), for
# ``same_scheduler_state``: running and waiting, then the admission queues of the release.
_QUEUES: ByRelease[tuple[tuple[str, bool], ...]] = ByRelease(
    "queues compared",
    (("running", True), ("waiting", True), *ADMISSION_QUEUES.base),
    [
        Change(c.since, (("running", True), ("waiting", True), *c.value), c.what)
        for c in ADMISSION_QUEUES.changes
    ],
)


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


def pooled_output(out: Any) -> list[float] | None:
    """A pooling request's output (``pooling_output``) as values to 4 places, None without."""
    pooled = out.pooling_output
    if pooled is None:
        return None
    return [round(float(v), 4) for v in pooled.flatten().tolist()]


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


def output_trace_headers(out: Any) -> tuple[tuple[str, str], ...] | None:
    """The tracing context an output carries (``EngineCoreOutput.trace_headers``: upstream copies
    the request's onto each of its outputs), as sorted (name, value) pairs; None when unset."""
    headers = out.trace_headers
    return None if headers is None else tuple(sorted(headers.items()))


# ---- equality checks: both sides at once -------------------------------------------------
#
# Lock-step compares both sides after every operation, and nearly always they are equal. These
# checks read the state the snapshots above are built from, on both sides at once and in place
# (no copies of token lists, no per-request dicts, no sorting, no id lists of the whole pool):
# True only if the two snapshots would be equal, since every value they compare is equal only if
# its normalised form is (an enum member, a list, a set, a bytes-like hash). False proves nothing;
# the caller then builds and compares the snapshots. Reading both sides side by side cost about
# 30% less than reading each into a summary (lists of rows and ids) and comparing those.


def same_scheduler_state(a: Any, b: Any) -> bool:
    """Whether ``observe_state``'s requests, queues and block pool would be equal for schedulers
    ``a`` and ``b`` (the subject's own ``audit`` is not read here)."""
    held_a, held_b = a.requests, b.requests
    if held_a.keys() != held_b.keys():
        return False
    ids = list(held_a)
    in_order = list(held_b) == ids  # the usual case: both hold them in arrival order
    stale = stale_row()
    session = session_reader()
    # ``request_fields`` pair by pair, without building rows (``_check_request_pairs`` below
    # keeps the attributes read here those ``_rows`` reads). A status is compared by identity:
    # enum members are singletons, and ``RequestStatus`` is an ``IntEnum``, whose ``==`` would
    # call members of two enum classes equal by value alone.
    if [
        0
        for x, y in zip(
            held_a.values(),
            held_b.values() if in_order else map(held_b.__getitem__, ids),
            strict=True,
        )
        if x.status is not y.status
        or x.num_computed_tokens != y.num_computed_tokens
        or x._output_token_ids != y._output_token_ids
        or x.num_output_placeholders != y.num_output_placeholders
        or stale(x) != stale(y)
        or x.num_in_flight_tokens != y.num_in_flight_tokens
        or x.num_preemptions != y.num_preemptions
        or x.stop_reason != y.stop_reason
        or (
            (x.structured_output_request is not None or y.structured_output_request is not None)
            and _grammar_of(x) != _grammar_of(y)
        )
        or session(x) != session(y)
    ]:
        return False
    kv_a, kv_b = a.kv_cache_manager, b.kv_cache_manager
    groups_a = kv_a.coordinator.single_type_managers
    groups_b = kv_b.coordinator.single_type_managers
    if len(groups_a) != len(groups_b):
        return False
    for mgr_a, mgr_b in zip(groups_a, groups_b, strict=True):
        lists_a = list(map(mgr_a.req_to_blocks.get, ids, repeat(())))
        lists_b = list(map(mgr_b.req_to_blocks.get, ids, repeat(())))
        if list(map(len, lists_a)) != list(map(len, lists_b)):
            return False
        if [x.block_id for blocks in lists_a for x in blocks] != [
            x.block_id for blocks in lists_b for x in blocks
        ]:
            return False
    for name, ordered in _QUEUES.value():
        queue_a, queue_b = getattr(a, name), getattr(b, name)
        if len(queue_a) != len(queue_b):
            return False
        if not queue_a:  # the admission queues are empty nearly always
            continue
        ids_a, ids_b = queue_ids(queue_a), queue_ids(queue_b)
        if ids_a != ids_b and (ordered or sorted(ids_a) != sorted(ids_b)):
            return False
    if a.finished_req_ids != b.finished_req_ids:
        return False
    if pause_state(a) != pause_state(b):
        return False
    if not same_encoder_cache(a, b):
        return False
    return _same_pool(kv_a.block_pool, kv_b.block_pool)


def _attributes_read(function: Any) -> set[str]:
    """Names a function (with its comprehensions) loads: attributes among them."""
    names = set(function.__code__.co_names)
    for const in function.__code__.co_consts:
        if hasattr(const, "co_names"):
            names.update(const.co_names)
    return names


def _check_request_pairs() -> None:
    """A field added to ``_rows`` (the snapshot) but not to ``same_scheduler_state``'s pairwise
    check would let the check call two different snapshots equal: refuse to import instead."""
    missing = _attributes_read(_rows) - _attributes_read(same_scheduler_state)
    if missing:
        raise AssertionError(f"same_scheduler_state does not compare {sorted(missing)}")


_check_request_pairs()


def _same_pool(a: Any, b: Any) -> bool:
    if num_free_blocks(a) != num_free_blocks(b) or num_cached_hashes(a) != num_cached_hashes(b):
        return False
    blocks_a, blocks_b = a.blocks, b.blocks
    if len(blocks_a) != len(blocks_b):
        return False
    # Block by block: ref count, raw hash, and a hashed block's id (``hashed_blocks`` pairs
    # them). The lists are the same length, so equal ref counts by position are equal lists.
    if [
        0
        for x, y in zip(blocks_a, blocks_b, strict=True)
        if x.ref_cnt != y.ref_cnt
        or (h := x._block_hash) != y._block_hash
        or (h is not None and x.block_id != y.block_id)
    ]:
        return False
    queue_a, queue_b = a.free_block_queue, b.free_block_queue
    if not (_is_vllm_free_queue(queue_a) and _is_vllm_free_queue(queue_b)):
        return free_block_order(a) == free_block_order(b)
    # vLLM's two free queues walked side by side, as ``free_block_order`` walks one.
    x = queue_a.fake_free_list_head.next_free_block
    y = queue_b.fake_free_list_head.next_free_block
    while True:
        after_x, after_y = x.next_free_block, y.next_free_block
        if after_x is None or after_y is None:
            return after_x is after_y
        if x.block_id != y.block_id:
            return False
        x, y = after_x, after_y


# Output classes known to add no field to upstream's (``output_extra_fields`` is then empty).
_PLAIN_OUTPUT_CLASSES: set[type] = set()


def _outputs_in_order(outputs: dict[int, Any] | None) -> list[Any]:
    """One step's outputs in the snapshot's order (clients sorted)."""
    if not outputs:
        return []
    if len(outputs) == 1:
        (batch,) = outputs.values()
        return batch.outputs  # iterated only: no copy
    return [out for client in sorted(outputs) for out in outputs[client].outputs]


def _clients(outputs: dict[int, Any] | None) -> list[tuple[int, int]]:
    """(client, number of outputs) of each client with outputs, in the snapshot's order."""
    if not outputs:
        return []
    return [(c, n) for c in sorted(outputs) if (n := len(outputs[c].outputs))]


def same_outputs(a: dict[int, Any] | None, b: dict[int, Any] | None) -> bool:
    """Whether ``observe_outputs`` of the two sides' outputs would be equal."""
    if _clients(a) != _clients(b):  # the snapshot names each output's client
        return False
    outs_a, outs_b = _outputs_in_order(a), _outputs_in_order(b)
    if len(outs_a) != len(outs_b):
        return False
    # Finish reasons and prefill stats are compared in their snapshot forms, but only where one
    # is set (rarely: a request's first step, its last).
    if [
        0
        for x, y in zip(outs_a, outs_b, strict=True)
        if type(x) is not type(y)
        or x.request_id != y.request_id
        or x.new_token_ids != y.new_token_ids
        or x.stop_reason != y.stop_reason
        or x.trace_headers != y.trace_headers
        or (
            (x.finish_reason is not None or y.finish_reason is not None)
            and finish_reason_name(x.finish_reason) != finish_reason_name(y.finish_reason)
        )
        or (
            (x.prefill_stats is not None or y.prefill_stats is not None)
            and prefill_stats_fields(x.prefill_stats) != prefill_stats_fields(y.prefill_stats)
        )
        or ((x.events or y.events) and request_events(x) != request_events(y))
        or x.kv_transfer_params != y.kv_transfer_params
        or x.ec_transfer_params != y.ec_transfer_params
        or not same_aux_outputs(x, y)
        or (
            (x.new_logprobs is not None or y.new_logprobs is not None)
            and output_logprobs(x) != output_logprobs(y)
        )
        or (
            (x.new_prompt_logprobs_tensors is not None or y.new_prompt_logprobs_tensors is not None)
            and output_prompt_logprobs(x) != output_prompt_logprobs(y)
        )
        or (
            (x.pooling_output is not None or y.pooling_output is not None)
            and pooled_output(x) != pooled_output(y)
        )
        or spec_decode_metrics(x) != spec_decode_metrics(y)
    ]:
        return False
    classes: set[Any] = set(map(type, outs_a))
    if not classes <= _PLAIN_OUTPUT_CLASSES:
        base = len(base_output_fields())
        plain = {cls for cls in classes if len(cls.__struct_fields__) == base}
        _PLAIN_OUTPUT_CLASSES.update(plain)
        if plain != classes:
            return list(map(output_extra_fields, outs_a)) == list(map(output_extra_fields, outs_b))
    return True


def finished_sets(outputs: dict[int, Any] | None) -> dict[int, list[str]]:
    """Per client, the ids a step reports finished beside its outputs
    (``EngineCoreOutputs.finished_requests``, set by a data-parallel rank's scheduler)."""
    return {
        client: sorted(outs.finished_requests)
        for client, outs in sorted((outputs or {}).items())
        if outs.finished_requests is not None
    }


def output_facts(outputs: dict[int, Any] | None) -> list[tuple[Any, Any, Any]]:
    """(prefill stats, finish reason, stop reason), in snapshot form, of each output that has
    prefill stats or a finish reason."""
    return [
        (prefill_stats_fields(o.prefill_stats), finish_reason_name(o.finish_reason), o.stop_reason)
        for o in _outputs_in_order(outputs)
        if o.prefill_stats is not None or o.finish_reason is not None
    ]


def preemption_counts(scheduler: Any) -> tuple[list[str], list[int]]:
    """The ids of the requests held, and how often each was preempted."""
    held = scheduler.requests
    return list(held), [r.num_preemptions for r in held.values()]


def has_stale_tokens(scheduler: Any) -> bool:
    """Whether a request held has stale output tokens (async scheduling)."""
    return any(map(has_stale, scheduler.requests.values()))


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
