"""Mutants: subclasses of the omni schedulers, each broken in one planted way.

They are the positive controls of the conformance harness: ``tests/test_conformance_mutants.py``
shows that a lock-step run catches each one at the right step and field, and the CLI test shows
``omni-conformance check --subject tests.mutants.harness_mutants:<name>`` fails on one. Each mutant
is exposed as a subject (``MutantSubject``), a plain ``module:attr`` the CLI accepts.

* ``RequeueAtBack``       a preempted request goes to the back of the waiting queue (upstream:
                          front)  -> ``queues.waiting``
* ``ForwardFree``         a finished request's blocks are freed head-first (upstream: tail first,
                          so tails are evicted first)  -> ``block_pool.free_order``
* ``ShortPrefixHit``      a prefix-cache hit is one block shorter than it could be
                          -> ``requests.<id>.*`` on the step that schedules the request
* ``LeakyTransfer``       aborting a request keeps its transfer progress (omni state outlives the
                          request)  -> ``audit.leaked_omni_ids``
* ``ExtraOutput``         an ``EngineCoreOutput`` for requests that produced nothing this step
                          -> ``outputs.<id>`` (no registry entry names it)
* ``OmniFieldsEverywhere`` omni trailing fields on outputs of requests with no downstream:
                          OMNI-OUT-001 names the field but its condition does not hold
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

from omni_runtime.conformance_subject import OmniSubject
from omni_runtime.payload import OmniEngineCoreOutputs, omni_output_from
from omni_runtime.sched import OmniARAsyncScheduler, OmniARScheduler

# ---- planted faults, as mixins over the omni schedulers ---------------------------------------


class _RequeueAtBack:
    def _preempt_request(self, request: Any, timestamp: float, drop_stale_output: bool = False):
        super()._preempt_request(request, timestamp, drop_stale_output)  # type: ignore[misc]
        self.waiting.remove_requests([request])  # type: ignore[attr-defined]
        self.waiting.add_request(request)  # type: ignore[attr-defined]


class _ForwardFree:
    def _free_request_blocks(self, request: Any) -> None:
        manager = self.kv_cache_manager  # type: ignore[attr-defined]
        blocks = manager.pop_blocks_for_free(request)
        manager.block_pool.free_blocks(blocks)  # head first: the wrong eviction order


class _ShortPrefixHit:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        manager = self.kv_cache_manager  # type: ignore[attr-defined]
        original = manager.get_computed_blocks
        block_size = self.block_size  # type: ignore[attr-defined]

        def shorter(request: Any, max_cache_hit_length: int | None = None):
            blocks, hits, boundary = original(request, max_cache_hit_length)
            if hits >= block_size:
                blocks = KVCacheBlocks(tuple(list(g)[:-1] for g in blocks.blocks))
                hits -= block_size
            return blocks, hits, boundary

        manager.get_computed_blocks = shorter


class _LeakyTransfer:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        transfer = self.transfer  # type: ignore[attr-defined]
        if transfer is None:
            return
        original = transfer.on_terminated

        def keep_progress(request_id: str, state: Any, finish_reason: str, **kw: Any):
            saved = transfer.progress.get(request_id)
            chunk = original(request_id, state, finish_reason, **kw)
            if saved is not None:
                transfer.progress[request_id] = saved  # the planted leak
            return chunk

        transfer.on_terminated = keep_progress


class _ExtraOutput:
    def update_from_output(self, scheduler_output: Any, model_runner_output: Any):
        outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        seen = {o.request_id for eco in outputs.values() for o in eco.outputs}
        for rid in scheduler_output.num_scheduled_tokens:
            if rid not in seen and rid in self.requests:  # type: ignore[attr-defined]
                outputs.setdefault(0, EngineCoreOutputs()).outputs.append(
                    EngineCoreOutput(request_id=rid, new_token_ids=[])
                )
        return outputs


class _OmniFieldsEverywhere:
    def update_from_output(self, scheduler_output: Any, model_runner_output: Any):
        outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        rebuilt = {}
        for client, eco in outputs.items():
            fields = {name: getattr(eco, name) for name in eco.__struct_fields__}
            fields["outputs"] = [
                omni_output_from(o, [f"stage/{o.request_id}/0"], False) for o in eco.outputs
            ]
            rebuilt[client] = OmniEngineCoreOutputs(**fields)
        return rebuilt


def _pair(mixin: type, name: str) -> tuple[type, type]:
    sync = type(f"{name}Scheduler", (mixin, OmniARScheduler), {})
    async_ = type(f"{name}AsyncScheduler", (mixin, OmniARAsyncScheduler), {})
    return sync, async_


RequeueAtBack, RequeueAtBackAsync = _pair(_RequeueAtBack, "RequeueAtBack")
ForwardFree, ForwardFreeAsync = _pair(_ForwardFree, "ForwardFree")
ShortPrefixHit, ShortPrefixHitAsync = _pair(_ShortPrefixHit, "ShortPrefixHit")
LeakyTransfer, LeakyTransferAsync = _pair(_LeakyTransfer, "LeakyTransfer")
ExtraOutput, ExtraOutputAsync = _pair(_ExtraOutput, "ExtraOutput")
OmniFieldsEverywhere, OmniFieldsEverywhereAsync = _pair(
    _OmniFieldsEverywhere, "OmniFieldsEverywhere"
)


class MutantSubject(OmniSubject):
    """The omni subject with its schedulers swapped for a mutant pair."""

    def __init__(self, name: str, sync: type, async_: type) -> None:
        self.name = name
        self.sync_scheduler = sync
        self.async_scheduler = async_


requeue_at_back = MutantSubject("mutant-requeue-at-back", RequeueAtBack, RequeueAtBackAsync)
forward_free = MutantSubject("mutant-forward-free", ForwardFree, ForwardFreeAsync)
short_prefix_hit = MutantSubject("mutant-short-prefix-hit", ShortPrefixHit, ShortPrefixHitAsync)
leaky_transfer = MutantSubject("mutant-leaky-transfer", LeakyTransfer, LeakyTransferAsync)
extra_output = MutantSubject("mutant-extra-output", ExtraOutput, ExtraOutputAsync)
omni_fields_everywhere = MutantSubject(
    "mutant-omni-fields-everywhere", OmniFieldsEverywhere, OmniFieldsEverywhereAsync
)

ALL = {
    "requeue_at_back": requeue_at_back,
    "forward_free": forward_free,
    "short_prefix_hit": short_prefix_hit,
    "leaky_transfer": leaky_transfer,
    "extra_output": extra_output,
    "omni_fields_everywhere": omni_fields_everywhere,
}
