"""Observation: normalised, comparable snapshots of one scheduler after each operation.

A snapshot is a nested ``dict`` whose leaves are plain values (ints, strings, tuples, lists). Its
dotted key paths are the *field paths* that comparisons, the differences registry
(``fields`` patterns) and failure reports use:

``requests.<id>.<field>``        status, num_computed_tokens, output_token_ids,
                                 num_output_placeholders, num_stale_output_tokens,
                                 drop_stale_output, num_in_flight_tokens, num_preemptions,
                                 stop_reason, block_ids (per KV group)
``queues.<name>``                running / waiting / kv_holding_waiting (order kept),
                                 deferred_waiting / finished_pending (sorted)
``block_pool.<field>``           num_free, free_order (eviction order), ref_counts (per block id),
                                 hashed_blocks ((block id, hash) pairs), num_cached_hashes
``sched_out.<field>``            scheduled_new / scheduled_cached (id order), resumed / preempted /
                                 finished (sorted), total_tokens, and per request
                                 ``num_scheduled_tokens.<id>``, ``num_computed_tokens.<id>``,
                                 ``num_output_tokens.<id>``, ``block_ids.<id>``
``outputs.<id>.<field>``         new_token_ids, finish_reason, stop_reason, prefill_stats,
                                 ``__type__`` (None for upstream's ``EngineCoreOutput``, else the
                                 subclass name) and any non-default trailing subclass field
                                 (``omni_chunk_refs``, ``omni_eof``); a second output for the same
                                 id in one step is ``outputs.<id>#2``
``audit.leaked_omni_ids``        ids the subject's own per-request structures hold although the
                                 scheduler no longer holds the request (C-04)

Normalisation: no timestamps or event lists are read; sets are sorted; live lists are copied the
moment they are read (``observe_schedule`` runs right after ``schedule()``, before anything can
mutate the request lists the output aliases). All vLLM internals are read via ``vllm_compat``.
"""

from __future__ import annotations

from typing import Any

from conformance import vllm_compat as vc


def observe_state(scheduler: Any, subject: Any) -> dict[str, Any]:
    requests: dict[str, Any] = {}
    block_ids = vc.block_ids_reader(scheduler)
    request_fields = vc.request_fields
    for rid, req in scheduler.requests.items():
        fields = request_fields(req)
        fields["block_ids"] = block_ids(rid)
        requests[rid] = fields
    pool = vc.block_pool(scheduler)
    refs, hashed = vc.block_table(pool)
    live = scheduler.requests
    leaked = sorted(i for i in subject.live_omni_ids(scheduler) if i not in live)
    return {
        "requests": requests,
        "queues": vc.scheduler_queues(scheduler),
        "block_pool": {
            "num_free": vc.num_free_blocks(pool),
            "free_order": vc.free_block_order(pool),
            "ref_counts": refs,
            "hashed_blocks": hashed,
            "num_cached_hashes": vc.num_cached_hashes(pool),
        },
        "audit": {"leaked_omni_ids": leaked},
    }


def observe_schedule(so: Any) -> dict[str, Any]:
    """The ``SchedulerOutput``, copied right after ``schedule()`` returned."""
    return vc.schedule_fields(so)


def observe_outputs(outputs: dict[int, Any] | None) -> dict[str, Any]:
    result: dict[str, Any] = {}
    if not outputs:
        return result
    # The type name depends on the output's class alone: looked up once per class per step.
    type_names: dict[type, str | None] = {}
    for client in sorted(outputs):
        for out in outputs[client].outputs:
            cls = type(out)
            if cls in type_names:
                type_name = type_names[cls]
            else:
                type_name = type_names[cls] = vc.output_type_name(out)
            entry = {
                "new_token_ids": tuple(out.new_token_ids),
                "finish_reason": vc.finish_reason_name(out.finish_reason),
                "stop_reason": out.stop_reason,
                "prefill_stats": vc.prefill_stats_fields(out.prefill_stats),
                "__type__": type_name,
            }
            extra = vc.output_extra_fields(out)
            if extra:
                entry.update(extra)
            key = out.request_id
            n = 2
            while key in result:
                key = f"{out.request_id}#{n}"
                n += 1
            result[key] = entry
    return result
