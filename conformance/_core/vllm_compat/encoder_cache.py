"""What the harness reads of vLLM's encoder cache (multimodal models), as plain values.

A scheduler of a multimodal model keeps the encoder outputs of the images its requests show in an
``EncoderCacheManager``: which identifiers are cached and which requests use each, the freeable
ones in eviction order (an entry no request uses stays cached until space is needed), and the free
and freeable slots. Each step's ``SchedulerOutput`` says which of a request's images the runner
must encode (``scheduled_encoder_inputs``) and which cached outputs to drop
(``free_encoder_mm_hashes``); for Model Runner V2 also which images the worker installs or drops
(``encoder_input_updates``, 0.33). The fields read here are the same in vLLM 0.26-0.33; a scheduler
without an encoder cache (a text model's: size 0) gives nothing, so snapshots of text runs are
unchanged. Requests vLLM 0.33 rejects for reusing an identifier with another size are held in
``encoder_cache_mismatch_reqs`` until their outputs say so (earlier releases: no such set).
"""

from __future__ import annotations

from typing import Any


def _manager(scheduler: Any) -> Any:
    mgr = scheduler.encoder_cache_manager
    return mgr if getattr(mgr, "cache_size", 0) else None


def encoder_cache_state(scheduler: Any) -> dict[str, Any] | None:
    """The encoder cache as the snapshot compares it (None: the scheduler has none)."""
    mgr = _manager(scheduler)
    if mgr is None:
        return None
    state: dict[str, Any] = {
        "cached": {h: sorted(users) for h, users in sorted(mgr.cached.items())},
        "freeable": list(mgr.freeable),
        "num_free_slots": mgr.num_free_slots,
        "num_freeable_slots": mgr.num_freeable_slots,
    }
    mismatched = getattr(scheduler, "encoder_cache_mismatch_reqs", None)
    if mismatched:
        state["mismatched_requests"] = sorted(mismatched)
    return state


def same_encoder_cache(a: Any, b: Any) -> bool:
    """Whether ``encoder_cache_state`` of schedulers ``a`` and ``b`` would be equal, read in
    place (the lock-step's fast path)."""
    ma, mb = _manager(a), _manager(b)
    if ma is None or mb is None:
        return ma is mb
    return (
        ma.num_free_slots == mb.num_free_slots
        and ma.num_freeable_slots == mb.num_freeable_slots
        and ma.cached == mb.cached
        and list(ma.freeable) == list(mb.freeable)
        and getattr(a, "encoder_cache_mismatch_reqs", None)
        == getattr(b, "encoder_cache_mismatch_reqs", None)
    )


def encoder_schedule_fields(so: Any) -> dict[str, Any]:
    """A step's encoder work as plain values; empty when there is none, so that snapshots of
    steps without images read as before."""
    fields: dict[str, Any] = {}
    scheduled = so.scheduled_encoder_inputs
    if scheduled:
        fields["scheduled_encoder_inputs"] = {r: list(ids) for r, ids in sorted(scheduled.items())}
    freed = so.free_encoder_mm_hashes
    if freed:
        fields["free_encoder_mm_hashes"] = list(freed)
    # For Model Runner V2 (0.33): per request, the images the worker installs ("install") or
    # drops (None) this step; only whether, not the data, which is the request's own.
    updates = getattr(so, "encoder_input_updates", None)
    if updates:
        fields["encoder_input_updates"] = {
            r: {str(i): None if d is None else "install" for i, d in sorted(u.items())}
            for r, u in sorted(updates.items())
        }
    # With iteration details logged (0.30+): the step's encoder inputs and their embeddings.
    stats = getattr(so, "scheduled_encoder_input_stats", None)
    if stats is not None:
        fields["scheduled_encoder_input_stats"] = [stats.num_inputs, stats.output_tokens]
    return fields
