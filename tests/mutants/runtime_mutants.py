"""Runtime mutants: named, deliberately broken variants of ``omni_runtime`` (positive controls).

Every invariant in ``invariants/`` must kill at least one of these: a check
that no mutant can fail is a check that never fails. Each mutant is applied only inside the test
that uses it — a subclass (scheduler, runner, subject) or a ``unittest.mock.patch`` of one
attribute, undone on exit — never by a flag in the runtime. ``tests/test_mutant_selftest.py``
runs each mutant's property and asserts that it is caught, with a short counterexample.

A mutant names the clause it breaks and the property (``probe``) that must catch it; probes are
defined in the self-test. Mutants wrap the runtime's methods with ``*args, **kwargs`` where they
can, so signature changes in the runtime do not silently disarm them; one that can no longer
find what it patches raises ``MutantNotApplicable`` (the self-test reports it as a failure).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch


class MutantNotApplicable(RuntimeError):
    """The runtime no longer has what this mutant breaks: update the mutant."""


@dataclass(frozen=True)
class Mutant:
    name: str
    clause: str
    probe: str
    description: str
    apply: Callable[[], contextlib.AbstractContextManager[Any]]


def _require(obj: Any, name: str) -> None:
    if not hasattr(obj, name):
        raise MutantNotApplicable(f"{obj!r} has no attribute {name!r}")


# ---- subjects whose scheduler or runner is a broken subclass ------------------------------


def _subject_with(*, scheduler_mixin: type | None = None, runner_cls: type | None = None) -> Any:
    from omni_runtime.conformance_subject import OmniSubject
    from omni_runtime.sched import OmniARAsyncScheduler, OmniARScheduler

    attrs: dict[str, Any] = {}
    if scheduler_mixin is not None:
        name = scheduler_mixin.__name__
        attrs["sync_scheduler"] = type(f"{name}Sync", (scheduler_mixin, OmniARScheduler), {})
        attrs["async_scheduler"] = type(f"{name}Async", (scheduler_mixin, OmniARAsyncScheduler), {})
    if runner_cls is not None:
        attrs["runner_cls"] = runner_cls
    return type("MutantSubject", (OmniSubject,), attrs)()


@contextlib.contextmanager
def _subject(subject: Any) -> Iterator[Any]:
    yield subject


# Scheduler mixins ---------------------------------------------------------------------------


class RequeuePreemptedAtBack:
    """C-01/C-07: a preempted request goes to the back of the waiting queue, not the front."""

    def _preempt_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = super()._preempt_request(request, *args, **kwargs)  # type: ignore[misc]
        self.waiting.remove_request(request)  # type: ignore[attr-defined]
        self.waiting.add_request(request)  # type: ignore[attr-defined]
        return result


class StaleOutputDropped:
    """C-01: the output a preempted request had in flight is thrown away instead of delivered,
    as a runtime whose ``update_from_output`` drops every stale output does (vllm-omni's): the
    request loses that token and samples its position again after a full re-prefill."""

    def _preempt_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = super()._preempt_request(request, *args, **kwargs)  # type: ignore[misc]
        request.drop_stale_output = True  # upstream asks this only of resets and hand-offs
        return result


class EncoderInputsHeldToFinish:
    """C-01: the encoder outputs a request has consumed stay referenced until it finishes, as a
    runtime whose own ``update_from_output`` forgets upstream's step that frees them does: the
    entries cannot be evicted while the request decodes, so other requests' images wait."""

    def _free_encoder_inputs(self, request: Any) -> None:
        return None


class PauseAllKeepsRunning:
    """C-01: a scheduler paused for everything still runs its running requests, as a runtime
    with one "paused" flag that only holds back new requests does."""

    def set_pause_state(self, pause_state: Any) -> None:
        from vllm.v1.core.sched.interface import PauseState

        if pause_state == PauseState.PAUSED_ALL:
            pause_state = PauseState.PAUSED_NEW
        super().set_pause_state(pause_state)  # type: ignore[misc]


class ActiveSeqsFromSlots:
    """C-01: admission is capped at the runner's slots (``max_num_seqs``), not at
    ``max_num_active_seqs``, as a runtime that derives its limits from the slot count alone
    does (vLLM 0.31 split the two)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.max_num_active_reqs = self.max_num_running_reqs  # type: ignore[attr-defined]


class LoraLimitIgnored:
    """C-01: a step may serve more adapters than ``max_loras``, as a runtime whose scheduler is
    built without the engine's LoRA configuration does (the scheduler then enforces no cap)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.lora_config = None


class EncoderCacheConnectorUnused:
    """C-01: images an EC producer already stored are encoded again, as a runtime whose
    scheduler never asks its encoder-cache connector (``has_cache_item``) does."""

    def _try_schedule_encoder_inputs(self, *args: Any, **kwargs: Any) -> Any:
        connector, self.ec_connector = self.ec_connector, None  # type: ignore[has-type]
        try:
            return super()._try_schedule_encoder_inputs(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.ec_connector = connector


class EncoderCacheKeptOnReset:
    """C-01: ``reset_encoder_cache`` leaves cached encoder outputs in place, as a runtime that
    overrides it for its own caches and forgets upstream's: after a weight update, images are
    served from outputs of the old weights."""

    def reset_encoder_cache(self) -> None:
        return None


class PrefillCadenceIgnored:
    """C-01: new prefills start on every step despite ``prefill_schedule_interval``, as a
    runtime that builds its scheduler's limits from the older fields only does (0.33's local
    cadence)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.local_prefill_interval = 1


class RetentionIgnored:
    """C-01/C-06: sliding-window and Mamba checkpoints are cached at every block despite
    ``prefix_cache_retention_interval``, as a runtime that builds its KV-cache coordinator
    from an older configuration (no retention) does: blocks upstream leaves uncached are kept
    as prefix-cache entries, published and evicted in its place."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.kv_cache_manager.coordinator.retention_interval = None  # type: ignore[attr-defined]


class EagleHitBlockKept:
    """C-01/C-07: prefix-cache hits keep their last block under an EAGLE head whose drafter
    needs that block's hidden states recomputed, as a runtime that builds its KV-cache manager
    without the EAGLE flag does."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        coordinator = self.kv_cache_manager.coordinator  # type: ignore[attr-defined]
        coordinator.drop_eagle_group_ids = set()
        groups = getattr(coordinator, "attention_groups", None)
        if groups is not None:
            coordinator.attention_groups = [g._replace(use_eagle=False) for g in groups]
        for manager in coordinator.single_type_managers:
            manager.use_eagle = False


class MambaDraftSlotsMissing:
    """C-01/C-06: Mamba state gets no slot per draft token, as a runtime whose Mamba layers
    report their KV-cache spec without ``num_speculative_blocks`` does: the verified drafts'
    states then overwrite the running one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        for manager in self.kv_cache_manager.coordinator.single_type_managers:  # type: ignore[attr-defined]
            if hasattr(manager, "num_speculative_blocks"):
                manager.num_speculative_blocks = 0


class LookaheadSlotsIgnored:
    """C-01/C-06: no KV slots are reserved for an EAGLE drafter's lookahead, as a runtime whose
    scheduler sizes allocations from the drafts alone does: the drafter then writes past the
    request's blocks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.num_lookahead_tokens = 0


class EncoderUpdatesDropped:
    """C-01: the scheduler built for Model Runner V2 never tells the worker which images to
    install or drop (``encoder_input_updates``), as a runtime that overrides the step's output
    and leaves the field empty does: the worker encodes from stale or missing inputs."""

    def _get_encoder_input_updates(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {}


class RingAsFullAttention:
    """C-01/C-06: a compressor's ring-buffer group is managed as full attention, as a runtime
    whose KV-cache manager maps specs to managers by their attention base class does: the
    ring then takes a block per 16 tokens instead of one block for the request's life."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        coordinator = self.kv_cache_manager.coordinator  # type: ignore[attr-defined]
        for manager in coordinator.single_type_managers:
            if type(manager).__name__ == "CircularBufferManager":
                manager.__class__ = type(manager).__mro__[1]  # FullAttentionManager


class PromptLogprobsDropped:
    """C-01: prompt logprobs never reach the outputs, as a runtime that rebuilds its runner's
    output for its stage (tokens, sampled logprobs) and leaves ``prompt_logprobs_dict`` out."""

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        if getattr(model_runner_output, "prompt_logprobs_dict", None):
            model_runner_output = copy.copy(model_runner_output)
            model_runner_output.prompt_logprobs_dict = {}
        return super().update_from_output(  # type: ignore[misc]
            scheduler_output, model_runner_output
        )


class RepetitionStopIgnored:
    """C-01: a request asking for repetition detection runs on through its loop, as a runtime
    that rebuilds each request's sampling parameters from the fields it knows (length, stop
    ids, min_tokens) and so drops ``repetition_detection``."""

    def add_request(self, request: Any) -> Any:
        sp = request.sampling_params
        if sp is not None and getattr(sp, "repetition_detection", None) is not None:
            request.sampling_params = copy.copy(sp)
            request.sampling_params.repetition_detection = None
        return super().add_request(request)  # type: ignore[misc]


class ShutdownLeavesConnector:
    """C-01: the KV connector is never shut down, as a runtime whose scheduler overrides
    ``shutdown`` to stop its own stage threads and does not call vLLM's."""

    def shutdown(self) -> None:
        publisher = getattr(self, "kv_event_publisher", None)
        if publisher is not None:
            publisher.shutdown()


class FinishedSetsDropped:
    """C-01: a data-parallel rank's outputs lose the ids each step finished, as a runtime that
    rebuilds its stage's ``EngineCoreOutputs`` from the per-request outputs alone does; the
    group's coordinator then never sees a wave end."""

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = super().update_from_output(  # type: ignore[misc]
            scheduler_output, model_runner_output
        )
        for outs in outputs.values():
            outs.finished_requests = None
        return outputs


class DynamicDraftsIgnored:
    """C-01: every step asks for the full draft count whatever the batch, as a runtime that
    builds its stage's speculative configuration without the batch-size schedule does."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.dynamic_sd_lookup = None


class PooledOutputIgnored:
    """C-01/C-04: pooled outputs never reach the scheduler, as a runtime that rebuilds its
    runner's output from sampled tokens alone does: a pooling request is then never finished
    by its embedding and holds its blocks."""

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        if getattr(model_runner_output, "pooler_output", None):
            model_runner_output = copy.copy(model_runner_output)
            model_runner_output.pooler_output = []
        return super().update_from_output(  # type: ignore[misc]
            scheduler_output, model_runner_output
        )


class SessionEndsAtFirstTurn:
    """C-01/C-04: a streaming input session finishes when its first turn stops, as a runtime
    whose stop handling ignores ``Request.resumable`` does: its later input starts a new
    request instead of continuing the session."""

    def _handle_stopped_request(self, request: Any) -> bool:
        return True


class SessionImagesDropped:
    """C-01: a streaming session's later chunks lose their images, as a runtime whose session
    update appends the chunk's tokens but not its multimodal features does: the image's
    placeholder tokens are then computed with no encoder output."""

    def _update_request_as_session(self, session: Any, update: Any) -> Any:
        update.mm_features = []
        return super()._update_request_as_session(session, update)  # type: ignore[misc]


class EmbedsHashedAsTokens:
    """C-01/C-07: prompts sent as embeddings are hashed by their token ids alone, as a runtime
    whose block hasher leaves the rows out does: every embedded prompt of a length then has
    the same (all-zero) ids, and different embeddings hit each other's blocks."""

    def add_request(self, request: Any) -> Any:
        embeds = getattr(request, "prompt_embeds", None)
        if embeds is not None and request.block_hashes:
            request.prompt_embeds = None
            try:
                request.block_hashes.clear()
                request.update_block_hashes()
            finally:
                request.prompt_embeds = embeds
        return super().add_request(request)  # type: ignore[misc]


class ConnectorWorkerReportsDropped:
    """C-01/C-06: the worker's KV-connector report never reaches the scheduler, as a runtime
    that rebuilds its runner's output for its stage from the sampled tokens does: under
    HiSparse, page spills are then never acknowledged, so device pages stay pinned."""

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        if getattr(model_runner_output, "kv_connector_output", None) is not None:
            model_runner_output = copy.copy(model_runner_output)
            model_runner_output.kv_connector_output = None
        return super().update_from_output(  # type: ignore[misc]
            scheduler_output, model_runner_output
        )


class _SampledOrder:
    """A step's logprobs as a runtime that slices by the request's place among those that
    sampled would read them (``slice_request`` is all a scheduler calls)."""

    def __init__(self, lists: Any, order: dict[int, int]) -> None:
        self.lists, self.order = lists, order

    def __bool__(self) -> bool:
        return True

    def slice_request(self, req_idx: int, num_positions: int) -> Any:
        return self.lists.slice_request(self.order.get(req_idx, req_idx), num_positions)


class LogprobsBySampledOrder:
    """C-02: an output's logprobs are the rows at its place among the step's requests that
    sampled, not at its own index in the batch: a runtime that drops partial prefills before
    slicing hands a request its neighbour's rows."""

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        lists = model_runner_output.logprobs
        if lists is not None and lists.cu_num_generated_tokens is None:
            sampled = [i for i, ids in enumerate(model_runner_output.sampled_token_ids) if ids]
            order = {i: n for n, i in enumerate(sampled)}
            model_runner_output.logprobs = _SampledOrder(lists, order)
        return super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]


class FreeBlocksReversed:
    """C-05: a finished request's blocks return to the free queue head-first (eviction order)."""

    def _free_request_blocks(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        for mgr in self.kv_cache_manager.coordinator.single_type_managers:  # type: ignore[attr-defined]
            blocks = mgr.req_to_blocks.get(request.request_id)
            if blocks:
                blocks.reverse()
        return super()._free_request_blocks(request, *args, **kwargs)  # type: ignore[misc]


class FinalStageRequestSends:
    """C-42: a request whose final stage is this one still gets an EOF delivery on free."""

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        from omni_runtime.adapters import omni_state_of

        result = super()._free_request(request, *args, **kwargs)  # type: ignore[misc]
        state = omni_state_of(request)
        transfer = getattr(self, "transfer", None)
        if transfer is not None and state is not None and not state.has_downstream:
            # The decision reads metadata that claims a consumer the request does not have.
            forged = dataclasses.replace(state, downstream=("code2wav",))
            transfer.on_terminated(request.request_id, forged, str(request.get_finished_reason()))
        return result


class PlainRequestGetsSlot:
    """C-42: a request without an omni slot (a plain vLLM client's, which upstream serves as is)
    is given one at admission, with the stage's downstream, so its tokens stream to a consumer
    that never asked for them."""

    def add_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        from omni_runtime.adapters import OmniRequestState, omni_state_of

        stage = getattr(self, "omni_stage", None)
        if stage is not None and omni_state_of(request) is None:
            request.omni = OmniRequestState(stage.stage_id, stage.stages[-1], stage.downstream)
        return super().add_request(request, *args, **kwargs)  # type: ignore[misc]


class SendsStaleSteps:
    """C-45: the scheduler forgets which requests upstream put in drop mode (a prefix-cache reset
    of running requests, a resumable stop with steps in flight), so the chunk-transfer decision
    sends the payload of a step whose tokens upstream dropped as stale."""

    def _mark_dropping(self, request: Any) -> None:
        pass


class RepeatsFinishedOutput:
    """C-62: a finished request's output is emitted twice (two terminal outcomes)."""

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        outputs = super().update_from_output(*args, **kwargs)  # type: ignore[misc]
        for engine_outputs in outputs.values():
            finished = [o for o in engine_outputs.outputs if o.finish_reason is not None]
            engine_outputs.outputs.extend(copy.copy(o) for o in finished)
        return outputs


class OutputsUnderOneClient:
    """C-07: a step's outputs all come back in one client's container (a scheduler written for
    a single API server), so a second client's requests never get theirs."""

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        outputs = super().update_from_output(*args, **kwargs)  # type: ignore[misc]
        first, *rest = sorted(outputs) or [0]
        for client in rest:
            outputs[first].outputs.extend(outputs.pop(client).outputs)
        return outputs


_LAST_SCHEDULER: list[Any] = []


class PublishesTransfer:
    """Half of ``send_from_worker``: makes the scheduler's send path reachable from a runner."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _LAST_SCHEDULER[:] = [self]


# Runner subclasses ---------------------------------------------------------------------------


def _runner_base() -> type:
    from omni_runtime.worker import OmniARModelRunner

    return OmniARModelRunner


def _map_output(out: Any, fn: Callable[[Any], None]) -> Any:
    """Apply ``fn`` to the plain output, now (inline) or when it is collected (background)."""
    inner = getattr(out, "_output", None)
    if inner is None:
        fn(out)
        return out
    get = out.get_output

    def get_output() -> Any:
        result = get()
        fn(result)
        return result

    out.get_output = get_output
    return out


def _worker_extra_request() -> type:
    class WorkerExtraRequest(_runner_base()):  # type: ignore[misc]
        """C-20: results for a request that was not scheduled."""

        def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
            def add(o: Any) -> None:
                o.req_ids = [*o.req_ids, "ghost"]
                o.req_id_to_index = {rid: i for i, rid in enumerate(o.req_ids)}
                o.sampled_token_ids = [*o.sampled_token_ids, [3]]
                if getattr(o, "omni_payloads", None) is not None:
                    o.omni_payloads = [*o.omni_payloads, None]

            return _map_output(super().sample_tokens(*args, **kwargs), add)

    return WorkerExtraRequest


def _worker_missing_request() -> type:
    class WorkerMissingRequest(_runner_base()):  # type: ignore[misc]
        """C-20: the last scheduled request's result is missing."""

        def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
            def drop(o: Any) -> None:
                if len(o.req_ids) > 1:
                    o.req_ids = o.req_ids[:-1]
                    o.req_id_to_index = {rid: i for i, rid in enumerate(o.req_ids)}
                    o.sampled_token_ids = o.sampled_token_ids[:-1]
                    if getattr(o, "omni_payloads", None) is not None:
                        o.omni_payloads = o.omni_payloads[:-1]

            return _map_output(super().sample_tokens(*args, **kwargs), drop)

    return WorkerMissingRequest


def _send_from_worker() -> type:
    base = _runner_base()
    _require(base, "collect_connector_output")

    class SendFromWorker(base):  # type: ignore[misc,valid-type]
        """C-21: the runner pushes a chunk into the scheduler's sink while it samples."""

        def collect_connector_output(self, *args: Any, **kwargs: Any) -> Any:
            from omni_runtime.payload import StageChunk

            sched = _LAST_SCHEDULER[0] if _LAST_SCHEDULER else None
            transfer = getattr(sched, "transfer", None)
            if transfer is not None:
                for rid in list(self.requests)[:1]:
                    transfer.sink.send(StageChunk(rid, "thinker", 10_000, (), None, None, False))
            return super().collect_connector_output(*args, **kwargs)

    return SendFromWorker


def _token_only_builds_hidden() -> type:
    class TokenOnlyBuildsHidden(_runner_base()):  # type: ignore[misc]
        """C-30: the token-only switch is ignored: hidden rows are copied and delivered."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.payloads_enabled and not self.include_hidden:
                self.include_hidden = True
                self.builder.include_hidden = True

    return TokenOnlyBuildsHidden


def _conditioning_dropped_token_only() -> type:
    base = _runner_base()
    _require(base, "_finish_payloads")

    class ConditioningDroppedTokenOnly(base):  # type: ignore[misc,valid-type]
        """C-31: in token-only mode the prefill conditioning is not handed to the builder."""

        def _finish_payloads(self, output: Any, step: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.include_hidden:
                step.conditioning_rows = [-1] * len(step.conditioning_rows)
            return super()._finish_payloads(output, step, *args, **kwargs)

    return ConditioningDroppedTokenOnly


def _conditioning_resent_on_reprefill() -> type:
    base = _runner_base()
    _require(base, "_recheck_conditioning")

    class ConditioningResentOnReprefill(base):  # type: ignore[misc,valid-type]
        """C-31: the runner forgets that a request's conditioning crossed when vLLM preempts the
        request and it re-runs its prompt, so the conditioning crosses a second time."""

        @staticmethod
        def _recheck_conditioning(st: Any) -> None:
            base._recheck_conditioning(st)
            if st.num_computed_tokens == 0:
                st.conditioning_sent = False

    return ConditioningResentOnReprefill


def _conditioning_row_zero_falsy() -> type:
    base = _runner_base()
    _require(base, "_finish_payloads")

    class ConditioningRowZeroFalsy(base):  # type: ignore[misc,valid-type]
        """C-31: the runner tests a conditioning row for truth, so a request whose last prompt
        position is the step's first row (a one-token prompt first in its batch) loses its
        conditioning, in both payload modes alike."""

        def _finish_payloads(self, output: Any, step: Any, *args: Any, **kwargs: Any) -> Any:
            step.conditioning_rows = [r if r else -1 for r in step.conditioning_rows]
            return super()._finish_payloads(output, step, *args, **kwargs)

    return ConditioningRowZeroFalsy


def _payloads_on_empty_steps() -> type:
    class PayloadsOnEmptySteps(_runner_base()):  # type: ignore[misc]
        """C-50: a do-nothing postprocess makes every step build per-request payload objects."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.postprocess = _identity
            self.builder.postprocess = _identity

    return PayloadsOnEmptySteps


def _connector_collected_on_builder() -> type:
    class ConnectorCollectedOnBuilder(_runner_base()):  # type: ignore[misc]
        """C-54: connector output is (also) collected inside the payload build."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            build = self.builder.build

            def build_and_collect(plan: Any, inputs: Any) -> Any:
                self.collect_connector_output()
                return build(plan, inputs)

            self.builder.build = build_and_collect

    return ConnectorCollectedOnBuilder


def _identity(payload: Any) -> Any:
    return payload


def _runner_reads_stage_graph() -> type:
    class RunnerReadsStageGraph(_runner_base()):  # type: ignore[misc]
        """C-22: what the runner returns depends on which stages follow."""

        def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
            def shift(o: Any) -> None:
                if self.stage is not None and len(self.stage.stages) == 2:
                    o.sampled_token_ids = [[(t + 1) % 512 for t in s] for s in o.sampled_token_ids]

            return _map_output(super().sample_tokens(*args, **kwargs), shift)

    return RunnerReadsStageGraph


# ---- patches of one attribute -------------------------------------------------------------


def _patch(target: Any, name: str, make: Callable[[Any], Any]) -> contextlib.AbstractContextManager:
    _require(target, name)
    return mock.patch.object(target, name, make(getattr(target, name)))


def _truthy_token_updates():
    import omni_runtime.sched.transfer as transfer

    return _patch(
        transfer,
        "requires_token_updates",
        lambda _orig: lambda p: p is not None and bool(getattr(p, "requires_token_updates", False)),
    )


class _DropFinalNone:
    def __init__(self, real: Any) -> None:
        self.real = real

    def send(self, chunk: Any) -> None:
        if chunk.is_final and chunk.data is None:
            return
        self.real.send(chunk)


def _no_eof_when_processor_returns_none():
    from omni_runtime.sched.transfer import ChunkTransferAdapter

    def make(orig: Any) -> Any:
        def _deliver(self: Any, *args: Any, **kwargs: Any) -> Any:
            real = self.sink
            self.sink = _DropFinalNone(real)
            try:
                return orig(self, *args, **kwargs)
            finally:
                self.sink = real

        return _deliver

    return _patch(ChunkTransferAdapter, "_deliver", make)


def _token_update_data_dropped():
    """C-43: a non-final call on a step without a payload (a token update) has its return
    thrown away: the chunk is never sent, though the processor handed data over."""
    from omni_runtime.sched.transfer import ChunkTransferAdapter

    def make(orig: Any) -> Any:
        def _send(self: Any, request_id: str, prog: Any, ids: Any, payload: Any, *rest: Any):
            data, finish_reason = rest
            if finish_reason is None and payload is None and data is not None:
                return None
            return orig(self, request_id, prog, ids, payload, *rest)

        return _send

    return _patch(ChunkTransferAdapter, "_send", make)


def _token_update_call_skipped():
    """C-40: a processor that declares token updates but does not take ``new_token_ids`` is
    not called on a step that accepted ids and carried no payload: it never learns of it."""
    import omni_runtime.sched.transfer as transfer

    def make(orig: Any) -> Any:
        def _direct_call(processor: Any) -> Any:
            call = orig(processor)
            if call is None:
                return None

            def skipping(rid: str, payload: Any, is_final: Any, *args: Any, **kwargs: Any):
                if payload is None and is_final is False and not args and not kwargs:
                    return None
                return call(rid, payload, is_final, *args, **kwargs)

            return skipping

        return _direct_call

    return _patch(transfer, "_direct_call", make)


def _double_eof_on_abort():
    from omni_runtime.sched.transfer import ChunkTransferAdapter

    def make(orig: Any) -> Any:
        def on_terminated(self: Any, request_id: str, state: Any, reason: str, *a: Any, **kw: Any):
            out = orig(self, request_id, state, reason, *a, **kw)
            if "abort" in str(reason).lower():
                orig(self, request_id, state, reason, *a, **kw)
            return out

        return on_terminated

    return _patch(ChunkTransferAdapter, "on_terminated", make)


def _abort_keeps_omni_progress():
    from omni_runtime.sched.transfer import ChunkTransferAdapter, TransferProgress

    def make(orig: Any) -> Any:
        def on_terminated(self: Any, request_id: str, *a: Any, **kw: Any):
            out = orig(self, request_id, *a, **kw)
            self.progress.setdefault(request_id, TransferProgress())
            return out

        return on_terminated

    return _patch(ChunkTransferAdapter, "on_terminated", make)


def _redelivery_after_preemption():
    from omni_runtime.payload import StagePayload

    return _patch(StagePayload, "trimmed_before", lambda _orig: lambda self, position: self)


def _ids_not_copied():
    from omni_runtime.sched.transfer import ChunkTransferAdapter

    def make(orig: Any) -> Any:
        signature = inspect.signature(orig)

        def on_steps(self: Any, *a: Any, **kw: Any) -> Any:
            proc = self.processor
            if proc is not None and getattr(self, "_pass_ids", False):
                bound = signature.bind(self, *a, **kw)
                steps = bound.arguments["steps"] = list(bound.arguments["steps"])
                own = {rid: out.new_token_ids for rid, out in steps if out is not None}

                # The processor is handed upstream's own list instead of a copy.
                def aliasing(rid, payload, is_final, new_token_ids=None):
                    return proc(rid, payload, is_final, new_token_ids=own.get(rid, new_token_ids))

                self.processor = aliasing
                a, kw = bound.args[1:], bound.kwargs
            try:
                return orig(self, *a, **kw)
            finally:
                self.processor = proc

        return on_steps

    return _patch(ChunkTransferAdapter, "on_steps", make)


def _extra_request_attribute():
    from omni_runtime.adapters import InputAdapter

    def make(orig: Any) -> Any:
        def build(self: Any, *args: Any, **kwargs: Any) -> Any:
            request = orig(self, *args, **kwargs)
            request.omni_debug = {"built_by": "input adapter"}
            return request

        return build

    return _patch(InputAdapter, "build", make)


def _tensor_in_upstream_field():
    from omni_runtime.adapters import InputAdapter

    def make(orig: Any) -> Any:
        def build(self: Any, *args: Any, **kwargs: Any) -> Any:
            request = orig(self, *args, **kwargs)
            request.ec_transfer_params = {"conditioning": torch.zeros(4)}
            return request

        return build

    return _patch(InputAdapter, "build", make)


def _adapter_misnames_wrong_type():
    """C-13: a rejection of a value of the wrong type names the type of the rejection's own
    placeholder instead of the value's ("got NoneType" for a list)."""
    from omni_runtime.adapters import InputAdapter

    def make(orig: Any) -> Any:
        def _tensor(self: Any, rid: str, name: str, value: Any) -> Any:
            return orig(self, rid, name, value if isinstance(value, torch.Tensor) else None)

        return _tensor

    return _patch(InputAdapter, "_tensor", make)


def _adapter_takes_meta_tensor():
    """C-13/C-60: conditioning without data (a meta tensor) is taken as a zero vector instead of
    being rejected."""
    from omni_runtime.adapters import InputAdapter

    def make(orig: Any) -> Any:
        def _tensor(self: Any, rid: str, name: str, value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.is_meta:
                value = torch.zeros(value.shape, dtype=value.dtype)
            return orig(self, rid, name, value)

        return _tensor

    return _patch(InputAdapter, "_tensor", make)


def _adapter_drops_list_information():
    """C-13: the input adapter accepts a list in a request's additional information and keeps
    an empty tuple in its place: the stage's model never sees the caller's values."""
    from omni_runtime.adapters import InputAdapter

    def make(orig: Any) -> Any:
        def _additional(self: Any, rid: str, info: Any) -> Any:
            kept = dict(orig(self, rid, info))
            return {k: (() if isinstance(v, tuple) else v) for k, v in kept.items()}

        return _additional

    return _patch(InputAdapter, "_additional", make)


def _adapter_accepts_nan_embeds():
    from omni_runtime.adapters import InputAdapter

    def make(orig: Any) -> Any:
        def _prompt(self: Any, rid: str, item: Any) -> Any:
            embeds = item.prompt_embeds
            if isinstance(embeds, torch.Tensor) and embeds.is_floating_point():
                item = dataclasses.replace(item, prompt_embeds=torch.nan_to_num(embeds))
            return orig(self, rid, item)

        return _prompt

    return _patch(InputAdapter, "_prompt", make)


def _eof_reason_lost():
    """C-43: the transfer adapter's EOF chunk for an aborted request says the request stopped:
    downstream finishes a request its client gave up as if it had completed."""
    from omni_runtime.sched.transfer import ChunkTransferAdapter

    def make(orig: Any) -> Any:
        def _send(self: Any, rid: str, prog: Any, ids: Any, payload: Any, data: Any, reason: Any):
            return orig(
                self, rid, prog, ids, payload, data, "stop" if reason == "abort" else reason
            )

        return _send

    return _patch(ChunkTransferAdapter, "_send", make)


def _eof_reason_dropped():
    """C-43: the transfer adapter builds every chunk without its finish reason, the EOF too:
    downstream cannot tell a completed request from an aborted or failed one."""
    import omni_runtime.sched.transfer as transfer

    return _patch(
        transfer, "StageChunk", lambda orig: lambda **kw: orig(**{**kw, "finish_reason": None})
    )


def _leading_zero_ids_stripped():
    """C-13: the input adapter takes id 0 at the front of a prompt for padding and strips it:
    the request's prompt is shorter than the input's."""
    from omni_runtime.adapters import InputAdapter

    def make(orig: Any) -> Any:
        def _prompt(self: Any, rid: str, item: Any) -> Any:
            ids, embeds, n = orig(self, rid, item)
            if ids is not None:
                kept = list(ids)
                while len(kept) > 1 and kept[0] == 0:
                    kept.pop(0)
                return kept, embeds, len(kept)
            return ids, embeds, n

        return _prompt

    return _patch(InputAdapter, "_prompt", make)


def _tuple_loses_payload():
    """C-46: the stage process's wire encodes the items of a tuple in the processor's data
    without the chunk's payload at hand: a payload inside a tuple cannot cross, and the
    request's send path fails."""
    from omni_runtime.adapters import shm_wire

    def make(orig: Any) -> Any:
        def _encode(value: Any, payload: Any, tensors: list[Any]) -> Any:
            if isinstance(value, tuple):
                return {"u": [shm_wire._encode(v, None, tensors) for v in value]}
            return orig(value, payload, tensors)

        return _encode

    return _on_process_stage(_patch(shm_wire, "_encode", make))


def _rejection_says_nothing():
    """C-13: the input adapter's rejection names the request and the field, in its attributes
    and its message, but drops the description of what is wrong."""
    from omni_runtime.adapters.input import RequestRejected

    def make(orig: Any) -> Any:
        def __init__(self: Any, request_id: str, field_name: str, problem: str) -> None:
            orig(self, request_id, field_name, None)

        return __init__

    return _patch(RequestRejected, "__init__", make)


def _info_list_items_unchecked():
    """C-13: the input adapter checks each scalar of a request's additional information, but
    takes a list whole: an object, a NaN or an integer past 64 bits inside one goes through to
    the scheduler (and, for a stage in another process, into vLLM's request codec)."""
    from types import MappingProxyType

    from omni_runtime.adapters import InputAdapter

    def make(orig: Any) -> Any:
        def _additional(self: Any, rid: str, info: Any) -> Any:
            if not isinstance(info, dict):
                return orig(self, rid, info)
            lists = {k: tuple(v) for k, v in info.items() if isinstance(v, list | tuple)}
            rest = {k: v for k, v in info.items() if k not in lists}
            return MappingProxyType({**orig(self, rid, rest), **lists})

        return _additional

    return _patch(InputAdapter, "_additional", make)


def _rejection_message_blank():
    """C-13: the input adapter's rejection carries the request id and the field as attributes,
    but its message (what a client is shown) says only what was wrong."""
    from omni_runtime.adapters.input import RequestRejected

    def make(orig: Any) -> Any:
        def __init__(self: Any, request_id: str, field_name: str, problem: str) -> None:
            orig(self, request_id, field_name, problem)
            self.args = (problem,)

        return __init__

    return _patch(RequestRejected, "__init__", make)


def _payload_slot_shifted():
    from omni_runtime.adapters.output import PayloadBuilder

    def make(orig: Any) -> Any:
        def build(self: Any, plan: Any, inputs: Any) -> Any:
            out = orig(self, plan, inputs)
            kept = [p for p in out if p is not None]
            return kept + [None] * (len(out) - len(kept))

        return build

    return _patch(PayloadBuilder, "build", make)


def _token_only_drops_multimodal():
    """C-30: the token-only builder ignores the per-token multimodal outputs the runner computed
    for the batch (as if it read them only from hidden rows, which token-only mode has none
    of): a stage configured with multimodal outputs delivers them only in include-hidden mode."""
    from omni_runtime.adapters.output import PayloadBuilder

    def make(orig: Any) -> Any:
        def build(self: Any, plan: Any, inputs: Any) -> Any:
            return orig(self, plan, dataclasses.replace(inputs, multimodal_rows={}))

        return build

    return _patch(PayloadBuilder, "build", make)


def _prefix_merge_missing_rows():
    from omni_runtime.adapters.output import PayloadBuilder

    def make(orig: Any) -> Any:
        def build(self: Any, plan: Any, inputs: Any) -> Any:
            return orig(self, plan, dataclasses.replace(inputs, prefix_rows={}))

        return build

    return _patch(PayloadBuilder, "build", make)


def _snapshot_drops_multimodal():
    """C-52: the background snapshot copies hidden, conditioning and prefix rows but forgets
    the per-token multimodal outputs a token-only runner hands over, so background payloads
    lack them."""
    from omni_runtime.adapters.output import PayloadInputs

    def make(orig: Any) -> Any:
        def snapshot(self: Any) -> Any:
            return dataclasses.replace(orig(self), multimodal_rows={})

        return snapshot

    return _patch(PayloadInputs, "snapshot", make)


@contextlib.contextmanager
def _background_no_snapshot() -> Iterator[None]:
    from omni_runtime.adapters.output import PayloadInputs, PayloadPlan

    with (
        _patch(PayloadPlan, "snapshot", lambda _o: lambda self: self),
        _patch(PayloadInputs, "snapshot", lambda _o: lambda self: self),
    ):
        yield


def _builder_error_swallowed():
    """The collection step's recovery from a builder error drops the step's payloads and
    reports nobody failed: the error vanishes."""
    import omni_runtime.worker.materialize as materialize

    def make(orig: Any) -> Any:
        def recover_build(builder: Any, plan: Any, inputs: Any, retries: int) -> Any:
            return [None] * len(plan.req_ids), {}

        return recover_build

    return _patch(materialize, "recover_build", make)


def _background_build_never_runs():
    """C-54: the builder thread's build always fails (a broken submit), so every step's payloads
    are rebuilt by recovery on the calling thread; every payload still arrives."""
    import omni_runtime.worker.materialize as materialize

    def make(orig: Any) -> Any:
        def _build(self: Any, plan: Any, inputs: Any, *args: Any) -> Any:
            raise RuntimeError("builder path broken")

        return _build

    return _patch(materialize.BackgroundMaterializer, "_build", make)


def _background_one_build_slot():
    """C-51/C-52: the background materializer keeps one build slot: an output still waiting to
    be collected reads whatever build was submitted last. Invisible while every step is
    collected before the next is executed; under async scheduling vLLM collects step N only
    after step N+1 has been sampled, and step N then carries step N+1's payloads."""
    import omni_runtime.worker.materialize as materialize

    def make(orig: Any) -> Any:
        def finish(self: Any, output: Any, plan: Any, inputs: Any) -> Any:
            out = orig(self, output, plan, inputs)
            for pending in self._recent:
                if not pending.collected:
                    pending._future = out._future
            return out

        return finish

    return _patch(materialize.BackgroundMaterializer, "finish", make)


def _builder_threads_unrecorded():
    """C-54: the background materializer no longer records the threads its builds run on, so
    the gate's check that no build ran on the caller reads an empty record."""
    import omni_runtime.worker.materialize as materialize

    def make(orig: Any) -> Any:
        def _build(self: Any, *args: Any) -> Any:
            try:
                return orig(self, *args)
            finally:
                self.builder_thread_ids.clear()

        return _build

    return _patch(materialize.BackgroundMaterializer, "_build", make)


def _batch_counts_dropped():
    """C-40: the transfer adapter's batch call leaves out how many ids each request accepted, as
    if every step accepted one: under speculative decoding a step accepts several tokens of a
    request, and a batching processor then streams only some of them, to the wrong requests."""
    from omni_runtime.sched.transfer import ChunkTransferAdapter

    def make(orig: Any) -> Any:
        def _run_batch(self: Any, batch: Any, *args: Any) -> Any:
            def one_each(request_ids: Any, token_ids: Any, counts: Any = None) -> Any:
                return batch(request_ids, token_ids, None)

            return orig(self, one_each, *args)

        return _run_batch

    return _patch(ChunkTransferAdapter, "_run_batch", make)


def _trim_loses_kept_rows():
    """C-45: trimming rows already delivered also drops the rows it should keep (the payload
    keeps its positions, not its hidden rows)."""
    import dataclasses as dc

    from omni_runtime.payload import StagePayload

    def make(orig: Any) -> Any:
        def trimmed_before(self: Any, position: int) -> Any:
            kept = orig(self, position)
            if kept is None or kept is self or kept.hidden is None:
                return kept
            return dc.replace(kept, hidden=kept.hidden[:0])

        return trimmed_before

    return _patch(StagePayload, "trimmed_before", make)


def _error_cause_dropped():
    """C-61: a request failed outside upstream's pass gets its terminal error output without the
    cause (``omni_error``): the client learns that it failed, not why."""
    from omni_runtime.sched.scheduler import OmniARScheduler

    def make(orig: Any) -> Any:
        def _report_errors(outputs: Any, errored: Any) -> Any:
            return orig(outputs, [(request, None) for request, _ in errored])

        return staticmethod(_report_errors)

    return _patch(OmniARScheduler, "_report_errors", make)


def _send_fault_fails_neighbours():
    """C-61: a chunk processor that raises for one request fails every request with an output
    in that step, not only the one it raised for."""
    from omni_runtime.sched.scheduler import OmniARScheduler

    def make(orig: Any) -> Any:
        def _fail_requests_of(self: Any, failures: Any, outputs: Any = None) -> Any:
            if failures and outputs:
                cause = next(iter(failures.values()))
                for eco in outputs.values():
                    for out in eco.outputs:
                        failures.setdefault(out.request_id, cause)
            return orig(self, failures, outputs)

        return _fail_requests_of

    return _patch(OmniARScheduler, "_fail_requests_of", make)


def _fault_restarts_chunk_numbering():
    """C-43: a request whose chunk processor raised loses its delivery progress, so the EOF its
    failure leads to is numbered from 0 again (a second chunk 0 downstream)."""
    from omni_runtime.sched.transfer import ChunkTransferAdapter

    def make(orig: Any) -> Any:
        def take_failures(self: Any) -> Any:
            failures = orig(self)
            for rid in failures:
                self.progress.pop(rid, None)
            return failures

        return take_failures

    return _patch(ChunkTransferAdapter, "take_failures", make)


def _shipped_processor_raises_at_eof():
    """C-61: the shipped thinker processor raises on every final call, so every request that
    reaches its end is failed as though a fault had been planted, and the registry's send-path
    entry (OMNI-ERR-001) tolerates every difference that makes."""
    from omni_runtime.sched.processors import HiddenRowsForwarder

    def make(orig: Any) -> Any:
        def __call__(self: Any, request_id: str, payload: Any, is_final: bool) -> Any:
            if is_final:
                raise RuntimeError(f"{request_id}: the forwarder cannot finish")
            return orig(self, request_id, payload, is_final)

        return __call__

    return _patch(HiddenRowsForwarder, "__call__", make)


def _ended_request_missed_in_second_container():
    """C-61/C-07: a request whose terminal delivery failed is looked for only in the step's
    containers up to the first one that does not hold it, so when it came from a second engine
    client, behind a container of the first, its output keeps its finish reason instead of
    becoming an error."""
    from omni_runtime.sched.scheduler import OmniARScheduler

    def make(orig: Any) -> Any:
        def _fail_requests_of(self: Any, failures: Any, outputs: Any = None) -> Any:
            if not failures or not outputs:
                return orig(self, failures, outputs)
            ended = set(failures) - set(self.requests)
            clients = list(outputs)
            cut = next(
                (
                    i
                    for i, c in enumerate(clients)
                    if ended.isdisjoint(o.request_id for o in outputs[c].outputs)
                ),
                len(clients),
            )
            # What the containers past the cut held for ended requests: left as they were.
            missed = {
                c: {o.request_id: o for o in outputs[c].outputs if o.request_id in ended}
                for c in clients[cut:]
            }
            result = orig(self, failures, outputs)
            for c, kept in missed.items():
                eco = result.get(c) if result else None
                if eco is not None and kept:
                    eco.outputs[:] = [kept.get(o.request_id, o) for o in eco.outputs]
            return result

        return _fail_requests_of

    return _patch(OmniARScheduler, "_fail_requests_of", make)


def _final_fault_not_released():
    """C-61: a processor whose final call for a request raised is never asked to release that
    request, so whatever it buffered for it stays."""
    from omni_runtime.sched.transfer import ChunkTransferAdapter

    def make(orig: Any) -> Any:
        def _release(self: Any, request_id: str) -> None:
            return None

        return _release

    return _patch(ChunkTransferAdapter, "_release", make)


def _background_ignores_step_retries():
    """C-54: the background materializer is built without the stage's ``step_retries`` and
    recovers a failed build with its own default budget, whatever the stage configured."""
    import omni_runtime.worker.runner as runner  # the name the runner builds it through

    def make(orig: Any) -> Any:
        def make_materializer(mode: str, builder: Any, *, retries: int = 2, stage: str = "?"):
            return orig(mode, builder, stage=stage)

        return make_materializer

    return _patch(runner, "make_materializer", make)


def _abort_fault_left_pending():
    """C-04/C-61: the failure of an abort's terminal delivery (its processor's final call raised,
    or the connector refused its EOF) is not taken by the abort that caused it: the scheduler
    only takes send-path failures inside a step, so the failed request's record outlives its
    abort until some later step comes, if one ever does."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from omni_runtime.sched.scheduler import OmniARScheduler

    def make(orig: Any) -> Any:
        def finish_requests(self: Any, request_ids: Any, finished_status: Any) -> Any:
            return Scheduler.finish_requests(self, request_ids, finished_status)

        return finish_requests

    return _patch(OmniARScheduler, "finish_requests", make)


def _error_output_replaces_step_outputs():
    """C-61/C-62: the error output of a request failed outside upstream's pass goes into a new,
    empty container, replacing the outputs the other requests emitted in that step (when no
    chunk had made it an omni container already)."""
    from omni_runtime.payload import OmniEngineCoreOutputs
    from omni_runtime.sched.scheduler import OmniARScheduler

    def make(orig: Any) -> Any:
        def _report_errors(outputs: Any, errored: Any) -> Any:
            for request, _ in errored:
                eco = outputs.get(request.client_index)
                if eco is not None and not isinstance(eco, OmniEngineCoreOutputs):
                    outputs[request.client_index] = OmniEngineCoreOutputs()
            return orig(outputs, errored)

        return staticmethod(_report_errors)

    return _patch(OmniARScheduler, "_report_errors", make)


def _error_output_drops_trace_headers():
    """C-61: the error output of a request failed outside upstream's pass goes out without the
    request's trace headers (upstream puts them on every output of the request), so the
    client's trace of a failed request never sees its end."""
    from omni_runtime.sched.scheduler import OmniARScheduler

    def make(orig: Any) -> Any:
        def _report_errors(outputs: Any, errored: Any) -> Any:
            outputs = orig(outputs, errored)
            failed = {request.request_id for request, _ in errored}
            for eco in outputs.values():
                for out in eco.outputs:
                    if out.request_id in failed and out.finish_reason is not None:
                        out.trace_headers = None
            return outputs

        return staticmethod(_report_errors)

    return _patch(OmniARScheduler, "_report_errors", make)


def _codec_chunk_held_a_step():
    """C-40: the codec streamer's batched path sends a full chunk one step late: a request whose
    buffer holds exactly a chunk's worth waits for one more id (the ids still all arrive)."""
    from omni_runtime.sched.processors import CodecTokenStreamer

    def make(_orig: Any) -> Any:
        def on_token_batch(self: Any, request_ids: Any, token_ids: Any, counts: Any) -> Any:
            self._steps.append((request_ids, token_ids, counts))
            self._spread()
            out = {}
            for rid in request_ids:
                buf = self._buffers[rid]
                if len(buf) > self.chunk_size:
                    n = len(buf) - len(buf) % self.chunk_size
                    out[rid] = torch.tensor(buf[:n], dtype=torch.long)
                    self._buffers[rid] = buf[n:]
            self._fill = max(map(len, self._buffers.values()), default=0)
            return out

        return on_token_batch

    return _patch(CodecTokenStreamer, "on_token_batch", make)


def _batched_chunks_unnamed():
    """C-43: chunks a batching processor returned are sent, but the step's outputs do not name
    them (the batch path forgets to report what it sent), so the next stage cannot find them
    through the outputs."""
    from omni_runtime.sched.transfer import ChunkTransferAdapter

    def make(orig: Any) -> Any:
        def _run_batch(self: Any, batch: Any, request_ids: Any, new_ids: Any, sent: Any) -> None:
            orig(self, batch, request_ids, new_ids, {})

        return _run_batch

    return _patch(ChunkTransferAdapter, "_run_batch", make)


def _unknown_output_ignored():
    """C-30: the runner skips the per-token outputs its model does not provide instead of
    refusing the stage: payloads go downstream without an output the stage asked for."""
    from omni_runtime.worker.runner import OmniARModelRunner

    def make(orig: Any) -> Any:
        def _producers(self: Any, names: tuple[str, ...]) -> Any:
            known = [
                n
                for n in names
                if n == "logits" or n in getattr(self.model, "omni_output_producers", {})
            ]
            return orig(self, tuple(known))

        return _producers

    return _patch(OmniARModelRunner, "_producers", make)


def _last_stage_builds_payloads():
    """C-50: the runner builds payloads for every omni step, also at a stage with nobody
    downstream (nothing to deliver)."""
    from omni_runtime.worker.runner import OmniARModelRunner

    def make(_orig: Any) -> Any:
        def _finish(self: Any, output: Any, step: Any, *, inline: bool = False) -> Any:
            return self._finish_payloads(output, step, inline=inline)

        return _finish

    return _patch(OmniARModelRunner, "_finish", make)


def _connector_fault_swallowed():
    """C-61: a chunk the connector refuses is dropped silently: the request goes on as though it
    had been delivered, and downstream misses it."""
    from omni_runtime.sched.transfer import ChunkTransferAdapter

    def make(orig: Any) -> Any:
        def _send(self: Any, *args: Any) -> Any:
            real = self.sink

            class Quiet:
                def send(self, chunk: Any) -> None:
                    try:
                        real.send(chunk)
                    except Exception:  # noqa: BLE001 - the mutation: the fault is lost
                        return None

            self.sink = Quiet()
            try:
                return orig(self, *args)
            finally:
                self.sink = real

        return _send

    return _patch(ChunkTransferAdapter, "_send", make)


def _released_request_kept():
    """C-04: the codec streamer's ``release`` keeps the request's buffer: a request whose send
    path failed stays held by the processor after it was let go."""
    from omni_runtime.sched.processors import CodecTokenStreamer

    def make(orig: Any) -> Any:
        def release(self: Any, request_id: str) -> None:
            held = self._buffers.get(request_id)
            orig(self, request_id)
            if held is not None:
                self._buffers[request_id] = held

        return release

    return _patch(CodecTokenStreamer, "release", make)


def _batch_through_any_attribute():
    """C-40: the send path batches any processor on which an ``on_token_batch`` attribute is
    found, also a subclass that redefined ``__call__`` and a wrapper that forwards attribute
    reads: their own per-request call is passed by."""
    import omni_runtime.sched.transfer as transfer

    def make(_orig: Any) -> Any:
        def _batch_method(processor: Any) -> Any:
            method = getattr(processor, "on_token_batch", None)
            return method if callable(method) else None

        return _batch_method

    return _patch(transfer, "_batch_method", make)


def _batch_reads_one_id_each():
    """C-40: the codec streamer's batch call ignores ``counts`` and reads one id per request, so
    on a step that accepted several ids for a request (speculative decoding) the batch keeps
    other ids than that request's per-request call would."""
    from omni_runtime.sched.processors import CodecTokenStreamer

    def make(orig: Any) -> Any:
        def on_token_batch(self: Any, request_ids: Any, token_ids: Any, counts: Any) -> Any:
            return orig(self, request_ids, token_ids, None)

        return on_token_batch

    return _patch(CodecTokenStreamer, "on_token_batch", make)


def _eof_not_flagged_on_output():
    """C-43: the step that delivers a request's EOF names the chunk on its output but leaves
    ``omni_eof`` unset, so a reader of the outputs never learns the request's stream ended."""
    import omni_runtime.sched.scheduler as scheduler

    def make(orig: Any) -> Any:
        def omni_output_from(base: Any, refs: Any, eof: bool) -> Any:
            return orig(base, refs, False)

        return omni_output_from

    return _patch(scheduler, "omni_output_from", make)


def _codec_eof_not_ids():
    """C-40: the codec streamer's EOF with nothing left buffered carries an empty float tensor,
    which downstream cannot read as codec ids (``torch.tensor([])`` without a dtype)."""
    from omni_runtime.sched.processors import CodecTokenStreamer

    def make(orig: Any) -> Any:
        def call(self: Any, request_id: str, payload: Any, is_final: bool, **kw: Any) -> Any:
            data = orig(self, request_id, payload, is_final, **kw)
            if is_final and data.numel() == 0:
                return torch.tensor([])
            return data

        return call

    return _patch(CodecTokenStreamer, "__call__", make)


@contextlib.contextmanager
def _codec_drops_id_zero() -> Iterator[None]:
    """C-40: the codec streamer takes codec id 0 for a control id and drops it (an off-by-one
    at the low end of its audio range), so that id never reaches the decoder."""
    from omni_runtime.sched.processors import CodecTokenStreamer

    def as_control(self: Any, ids: Any) -> Any:
        return None if ids is None else [self.codec_vocab if t == 0 else t for t in ids]

    def make_call(orig: Any) -> Any:
        def call(self: Any, request_id: str, payload: Any, is_final: bool, **kw: Any) -> Any:
            if "new_token_ids" in kw:
                kw["new_token_ids"] = as_control(self, kw["new_token_ids"])
            return orig(self, request_id, payload, is_final, **kw)

        return call

    def make_batch(orig: Any) -> Any:
        def on_token_batch(self: Any, request_ids: Any, token_ids: Any, counts: Any) -> Any:
            return orig(self, request_ids, as_control(self, token_ids), counts)

        return on_token_batch

    with (
        _patch(CodecTokenStreamer, "__call__", make_call),
        _patch(CodecTokenStreamer, "on_token_batch", make_batch),
    ):
        yield


def _forwarder_renames_hidden():
    """C-51: the thinker's ``HiddenRowsForwarder`` returns its rows under another key, so the
    talker, which reads ``data["hidden"]``, gets none (the payload beside it still has them)."""
    from omni_runtime.sched.processors import HiddenRowsForwarder

    def make(orig: Any) -> Any:
        def call(self: Any, request_id: str, payload: Any, is_final: bool) -> Any:
            data = orig(self, request_id, payload, is_final)
            if isinstance(data, dict):
                data = {("rows" if k == "hidden" else k): v for k, v in data.items()}
            return data

        return call

    return _patch(HiddenRowsForwarder, "__call__", make)


def _trace_headers_dropped():
    """C-07: the input adapter accepts a request's trace headers and leaves them out of the
    vLLM request it builds, so the request's outputs carry none (upstream's carry the
    client's)."""
    from omni_runtime.adapters import InputAdapter

    return _patch(InputAdapter, "_trace_headers", lambda _orig: lambda self, rid, headers: None)


def _recovery_fails_whole_step():
    """C-54: when a background build keeps failing, recovery fails every request of the step
    instead of pinning the fault on the request whose build raises."""
    import omni_runtime.worker.materialize as materialize

    def make(orig: Any) -> Any:
        def recover_build(builder: Any, plan: Any, inputs: Any, retries: int) -> Any:
            payloads, failed = orig(builder, plan, inputs, retries)
            if not failed:
                return payloads, failed
            cause = next(iter(failed.values()))
            return [None] * len(plan.req_ids), {rid: cause for rid in plan.req_ids}

        return recover_build

    return _patch(materialize, "recover_build", make)


def _rebuilt_request_stays_failed():
    """C-54: recovery's per-request pass keeps a request's error from a failed lone build after
    a later build of it succeeded: the request is failed although its payload was rebuilt."""
    import omni_runtime.worker.materialize as materialize

    def make(_orig: Any) -> Any:
        def recover_build(builder: Any, plan: Any, inputs: Any, retries: int) -> Any:
            for _ in range(retries):
                try:
                    return builder.build(plan, inputs), {}
                except Exception:  # noqa: BLE001 - as the runtime's
                    continue
            payloads: list[Any] = []
            failed: dict[str, BaseException] = {}
            for i, rid in enumerate(plan.req_ids):
                payload = None
                for _ in range(1 + retries):
                    try:
                        [payload] = builder.build(plan.only(i), inputs.only(i))
                        break  # the mutation: the earlier error stays in ``failed``
                    except Exception as exc:  # noqa: BLE001 - as the runtime's
                        failed[rid] = exc
                payloads.append(payload)
            return payloads, failed

        return recover_build

    return _patch(materialize, "recover_build", make)


def _abandoned_build_error_swallowed():
    """C-54: the error of a background build whose output nobody collected is dropped when the
    output is joined as abandoned, instead of being raised from the later step."""
    import omni_runtime.worker.materialize as materialize

    def make(orig: Any) -> Any:
        def raise_abandoned(self: Any, keep: int) -> None:
            try:
                orig(self, keep)
            except Exception:  # noqa: BLE001 - the mutation: the abandoned error is lost
                return None

        return raise_abandoned

    return _patch(materialize.BackgroundMaterializer, "raise_abandoned", make)


class _BrokenBuilder:
    def build(self, plan: Any, inputs: Any) -> Any:
        raise RuntimeError("inline build path broken")


def _inline_builder_broken():
    """C-50/C-54: an inline stage's own materializer builds with a builder that always raises,
    and the runner's step recovery rebuilds every step on its isolation path (which has the
    real builder): the payloads are right, the build path is not, and every step runs again."""
    import omni_runtime.worker.runner as runner_module

    def make(orig: Any) -> Any:
        def make_materializer(mode: str, builder: Any, **kw: Any) -> Any:
            return orig(mode, _BrokenBuilder() if mode == "inline" else builder, **kw)

        return make_materializer

    return _patch(runner_module, "make_materializer", make)


def _pinned_fault_fails_whole_step():
    """C-61: when a step fault persists, every request of the step is failed, not just the one
    the batch split pins it on (the isolation's result is thrown away)."""
    import omni_runtime.worker.runner as runner

    def make(orig: Any) -> Any:
        def whole_step(req_ids: Any, run: Any, retries: int) -> Any:
            failed = orig(req_ids, run, retries)
            if not failed:
                return failed
            cause = next(iter(failed.values()))
            return {rid: failed.get(rid, cause) for rid in req_ids}

        return whole_step

    return _patch(runner, "bisect", make)


def _stale_registry_subject() -> Any:
    """C-03: the registry keeps an entry (with its witness) for a difference the runtime no
    longer makes: preempted requests with a downstream consumer once resumed at the back of the
    waiting queue; the scheduler now requeues them as upstream does, so the entry hides nothing."""
    from conformance._core.capabilities import DifferenceWitness, Feature
    from conformance._core.differences import Difference
    from conformance._core.workload import AddRequest, Step
    from omni_runtime.conformance_subject import TOKEN_UPDATES, OmniSubject

    stale = Difference(
        id="OMNI-PRE-001",
        fields=("queues.waiting",),
        condition="a preempted request with a downstream consumer is waiting",
        applies=lambda ctx: ctx.get("upstream") is not None,
        rationale="an earlier transfer design requeued such requests at the back",
        tests=("tests/test_omni_scheduler.py::test_preempted_with_downstream_requeued_last",),
        clauses=("C-01",),
    )
    # Enough prompt under the tight budget that requests are preempted and resumed.
    ops = tuple(
        AddRequest(f"p{i}", tuple(range(100 + i, 150 + i)), max_tokens=12) for i in range(4)
    )
    witness = DifferenceWitness(
        "OMNI-PRE-001", Feature.from_config(*TOKEN_UPDATES), (*ops, *(Step() for _ in range(20)))
    )

    class StaleRegistrySubject(OmniSubject):
        def differences(self) -> Any:
            return (*super().differences(), stale)

        def difference_witnesses(self) -> Any:
            return (*super().difference_witnesses(), witness)

    return StaleRegistrySubject()


@contextlib.contextmanager
def _send_from_worker_subject() -> Iterator[Any]:
    yield _subject_with(scheduler_mixin=PublishesTransfer, runner_cls=_send_from_worker())


# ---- the process boundary (C-46): mutants of the stage-process wire ------------------------


@contextlib.contextmanager
def _on_process_stage(*patches: contextlib.AbstractContextManager[Any]) -> Iterator[Any]:
    """The ``omni-process-stage`` subject with ``patches`` applied; segments a mutant leaks are
    swept afterwards, so /dev/shm keeps nothing of the run."""
    import os

    from omni_runtime.adapters.shm_wire import sweep_segments
    from omni_runtime.conformance_subject import ProcessStageSubject

    try:
        with contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            yield ProcessStageSubject()
    finally:
        sweep_segments(f"omni-gate-{os.getpid()}-")


def _wire_drops_last_byte():
    """C-46: the writer copies every tensor of a step into the segment but the last one's final
    byte (an off-by-one in the copy): the parent reads that byte as zero."""
    from multiprocessing import resource_tracker
    from multiprocessing.shared_memory import SharedMemory

    from omni_runtime.adapters.shm_wire import ShmChunkWriter

    def make(orig: Any) -> Any:
        def flush(self: Any) -> Any:
            descriptors = orig(self)
            last = next((d for d in reversed(descriptors) if d.segment and d.tensors), None)
            ref = (
                None
                if last is None
                else next((r for r in reversed(last.tensors) if r.nbytes), None)
            )
            if last is not None and ref is not None:
                shm = SharedMemory(name=last.segment, create=False)
                # Attaching registered it with the tracker; the parent owns it (as the writer's).
                resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
                try:
                    shm.buf[ref.offset + ref.nbytes - 1] = 0
                finally:
                    shm.close()
            return descriptors

        return flush

    return _on_process_stage(_patch(ShmChunkWriter, "flush", make))


def _reader_keeps_segments():
    """C-46: the parent copies the tensors out but never unlinks the step's segment: every
    segment outlives the message that named it."""
    from multiprocessing import resource_tracker

    import omni_runtime.adapters.shm_wire as shm_wire

    def make(orig: Any) -> Any:
        def release_segments(names: Any, *, opened: Any = None) -> None:
            for shm in (opened or {}).values():
                shm.close()
                # Unlinking would also have taken it off the tracker that attaching told.
                resource_tracker.unregister(shm._name, "shared_memory")

        return release_segments

    return _on_process_stage(_patch(shm_wire, "release_segments", make))


def _codec_buffer_outlives_request():
    """C-46/C-04: the codec streamer sends a request's EOF and keeps an (empty) buffer for it:
    a stage process holds one entry per request it ever served, which its ``"audit"`` answer
    (the parent's leak check) reports."""
    from omni_runtime.sched.processors import CodecTokenStreamer

    def make(orig: Any) -> Any:
        def call(self: Any, request_id: str, payload: Any, is_final: bool, **kw: Any) -> Any:
            data = orig(self, request_id, payload, is_final, **kw)
            if is_final:
                self._buffers[request_id] = []
            return data

        return call

    return _on_process_stage(_patch(CodecTokenStreamer, "__call__", make))


def _audit_hides_codec_buffers():
    """C-46: the stage's ``"audit"`` answer reports no processor buffers (as if it looked the
    streamer's ``pending_request_ids`` up under another name): the parent's leak check is then
    blind to everything a codec streamer holds."""
    from omni_runtime.sched.process_stage import ProcessStageScheduler

    def make(orig: Any) -> Any:
        def call(self: Any, query: str) -> Any:
            answer = orig(self, query)
            if query == "audit":
                answer = {**answer, "processor_buffers": []}
            return answer

        return call

    return _on_process_stage(_patch(ProcessStageScheduler, "__call__", make))


def _chunks_to_a_client_nobody_is():
    """C-46: a step with chunks but no request output (a prefill chunk's rows) puts its chunk
    descriptors on a message for client 1; a stage process has one client, index 0, so vLLM's
    engine process never delivers it."""
    import omni_runtime.sched.process_stage as process_stage

    def make(orig: Any) -> Any:
        def _with_chunks(outputs: Any, descriptors: Any) -> Any:
            # An empty step's message is built on a placeholder for client 1.
            return orig(outputs or {1: None}, descriptors)

        return _with_chunks

    return _on_process_stage(_patch(process_stage, "_with_chunks", make))


def _segments_outside_the_prefix():
    """C-46: the stage's chunk writer names its segments after the stage id instead of the
    prefix its configuration gives (the parent's), so a parent sweeping a dead stage's segments
    by that prefix would leave them all behind."""
    from omni_runtime.adapters.shm_wire import ShmChunkWriter

    def make(orig: Any) -> Any:
        def __init__(self: Any, prefix: str, *args: Any, **kwargs: Any) -> None:
            orig(self, "omni-talker", *args, **kwargs)

        return __init__

    return _on_process_stage(_patch(ShmChunkWriter, "__init__", make))


def _abort_keeps_unsent_chunks():
    """C-46/C-43: an abort between steps does not drop the EOF chunk the transfer adapter wrote
    for the aborted request: it waits in the writer and crosses with the next step's message,
    an EOF the parent, which ended the request itself, never asked for."""
    from omni_runtime.adapters.shm_wire import ShmChunkWriter

    return _on_process_stage(_patch(ShmChunkWriter, "discard", lambda _orig: lambda self: None))


def _failed_request_eof_discarded():
    """C-61/C-43: the stage process drops its writer's unsent chunks on every finish, also the
    one inside a step where a request the worker pinned a fault on is failed: the error EOF the
    transfer adapter just wrote for it never crosses, and downstream waits for that request
    forever."""
    from omni_runtime.sched.process_stage import ProcessStageScheduler

    def make(orig: Any) -> Any:
        def finish_requests(self: Any, request_ids: Any, finished_status: Any) -> Any:
            finished = orig(self, request_ids, finished_status)
            if self.writer is not None:
                self.writer.discard()
            return finished

        return finish_requests

    return _on_process_stage(_patch(ProcessStageScheduler, "finish_requests", make))


def _staged_request_survives_abort():
    """C-04: the stage process forwards an abort to upstream's scheduler only, and forgets the
    requests it holds staged (admitted by the parent, not yet released into the queue): an
    aborted request enters the queue at the next release and runs, for a client that gave it
    up."""
    from omni_runtime.sched.process_stage import ProcessStageScheduler

    def make(orig: Any) -> Any:
        def finish_requests(self: Any, request_ids: Any, finished_status: Any) -> Any:
            staged = dict(self._staged)
            finished = orig(self, request_ids, finished_status)
            self._staged = staged
            return finished

        return finish_requests

    return _on_process_stage(_patch(ProcessStageScheduler, "finish_requests", make))


def _slot_bool_tensor_as_bytes():
    """C-46: the stage process rebuilds a boolean tensor of a request's slot as uint8 (its wire
    bytes are the same, its dtype is not)."""
    import omni_runtime.adapters.input as adapter

    def make(orig: Any) -> Any:
        def _tensor_from_wire(wire: Any) -> Any:
            if str(wire["dtype"]) == "bool":
                wire = {**wire, "dtype": "uint8"}
            return orig(wire)

        return _tensor_from_wire

    return _on_process_stage(_patch(adapter, "_tensor_from_wire", make))


# Scheduler-axis mixins (``conformance._core.axes``): bugs on paths plain decoding never takes.


class StatsCountedBeforePreemption:
    """C-09: the running count in the step's ``SchedulerStats`` is taken when ``schedule()``
    starts, before it preempts and admits (a runtime that counts where it starts its work)."""

    # Kept beside the scheduler, not on it: an undeclared attribute would be caught first (C-12).
    _at_start: dict[int, int] = {}

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._at_start[id(self)] = len(self.running)  # type: ignore[attr-defined]
        return super().schedule(*args, **kwargs)  # type: ignore[misc]

    def make_stats(self, *args: Any, **kwargs: Any) -> Any:
        stats = super().make_stats(*args, **kwargs)  # type: ignore[misc]
        if stats is not None and id(self) in self._at_start:
            stats.num_running_reqs = self._at_start[id(self)]
        return stats


class StatisticsThrottled:
    """C-09: ``make_stats`` returns statistics at most every third update and ``None`` between,
    as a runtime that throttles its reports does (vllm-omni's scheduler keeps a wall-clock
    interval; a count keeps the mutant deterministic). The statistics passed in for a withheld
    update are lost."""

    # Kept beside the scheduler (an undeclared attribute is C-12), weakly: keyed by id() a new
    # scheduler could inherit a collected one's count, and a replay would not match its run.
    _calls: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()

    def make_stats(self, *args: Any, **kwargs: Any) -> Any:
        stats = super().make_stats(*args, **kwargs)  # type: ignore[misc]
        calls = self._calls[self] = self._calls.get(self, 0) + 1
        return stats if calls % 3 == 1 else None


class WindowBlocksKept:
    """C-01/C-06: blocks that fell out of a sliding window are never given back: a runtime
    whose KV-cache manager skips the window eviction (``remove_skipped_blocks``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        coordinator = self.kv_cache_manager.coordinator  # type: ignore[attr-defined]
        coordinator.remove_skipped_blocks = lambda *a, **k: None


class MambaSplitSkipped:
    """C-01/C-07: prefill chunks of a Mamba model in "align" cache mode are not cut at Mamba
    block boundaries, so a chunk ends where no state can be cached."""

    def _mamba_block_aligned_split(self, request: Any, num_new_tokens: int, *args: Any) -> int:
        return num_new_tokens


class HandoffKeepsWindowBlocks:
    """C-01/C-06: a finished request is handed to its KV connector with the blocks that fell
    out of the sliding window since its last step: a delayed free then holds them too."""

    def _connector_finished(self, request: Any) -> Any:
        manager = self.kv_cache_manager  # type: ignore[attr-defined]
        manager.remove_skipped_blocks = lambda *a, **k: None
        try:
            return super()._connector_finished(request)  # type: ignore[misc]
        finally:
            del manager.remove_skipped_blocks


class DivergentHitNotReconciled:
    """C-01: a hybrid local hit whose full-attention part ran deeper than its Mamba part is
    kept although the connector loads nothing to restore the state (never reconciled to the
    boundary every group agrees on)."""

    def _get_local_prefix_cache_hit(self, *args: Any, **kwargs: Any) -> Any:
        blocks, num_local, boundary, _ = super()._get_local_prefix_cache_hit(  # type: ignore[misc]
            *args, **kwargs
        )
        return blocks, num_local, boundary, False


class KvEventsDroppedOnReset:
    """C-09: ``reset_prefix_cache`` drains the KV-cache manager's events after the reset, so the
    "all blocks cleared" event the reset queued is never published."""

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> Any:
        result = super().reset_prefix_cache(*args, **kwargs)  # type: ignore[misc]
        self.kv_cache_manager.take_events()  # type: ignore[attr-defined]
        return result


class SkipReadingPrefixCacheIgnored:
    """C-01/C-07: a request that asked to skip reading the prefix cache (as a prompt-logprobs
    request does) gets a local hit anyway: the runtime's lookup ignores the request's flag, so
    it computes fewer prompt tokens than upstream."""

    def _get_local_prefix_cache_hit(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        skip = request.skip_reading_prefix_cache
        request.skip_reading_prefix_cache = False
        try:
            return super()._get_local_prefix_cache_hit(  # type: ignore[misc]
                request, *args, **kwargs
            )
        finally:
            request.skip_reading_prefix_cache = skip


class FullReportEventsDropped:
    """C-09: a request whose client asked for the "full" KV-cache report mode gets the
    incremental one: the runtime's lookup ignores the mode, so the blocks its hit reuses are
    never re-published as stored."""

    def _get_local_prefix_cache_hit(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        mode = request.kv_cache_report_mode
        request.kv_cache_report_mode = "incremental"
        try:
            return super()._get_local_prefix_cache_hit(  # type: ignore[misc]
                request, *args, **kwargs
            )
        finally:
            request.kv_cache_report_mode = mode


class BonusCountedAccepted:
    """C-09: the spec-decoding statistics count the bonus token as an accepted draft (an
    off-by-one where accepted = sampled, not sampled - 1)."""

    def make_spec_decoding_stats(
        self, stats: Any, num_draft_tokens: int, num_accepted_tokens: int, *args: Any, **kwargs: Any
    ) -> Any:
        accepted = min(num_draft_tokens, num_accepted_tokens + 1)
        return super().make_spec_decoding_stats(  # type: ignore[misc]
            stats, num_draft_tokens, accepted, *args, **kwargs
        )


class RejectedDraftsKept:
    """C-01/C-07: rejected drafts are not rolled back: a request keeps counting the positions
    of drafts its step rejected as computed (an update that forgot the rollback)."""

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        requests = self.requests  # type: ignore[attr-defined]
        before = {
            rid: requests[rid].num_computed_tokens
            for rid in scheduler_output.scheduled_spec_decode_tokens
            if rid in requests
        }
        outputs = super().update_from_output(  # type: ignore[misc]
            scheduler_output, model_runner_output
        )
        for rid, computed in before.items():
            request = requests.get(rid)
            if request is not None and 0 < request.num_computed_tokens < computed:
                request.num_computed_tokens = computed
        return outputs


class PriorityIgnoredByWaitingQueue:
    """C-01/C-09: the runtime rebuilds the waiting queue first-come-first-served whatever the
    policy, so priorities no longer order admission."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue

        self.waiting = create_request_queue(SchedulingPolicy.FCFS)


class PipelineTokensNotSent:
    """C-07/C-09: with pipeline parallelism the scheduler must send each running request's new
    tokens back to the first stage's worker; the runtime's cached-request data leaves them out."""

    def _make_cached_request_data(self, *args: Any, **kwargs: Any) -> Any:
        data = super()._make_cached_request_data(*args, **kwargs)  # type: ignore[misc]
        data.new_token_ids = [[] for _ in data.new_token_ids]
        return data


# Structured-outputs mixins (``conformance._core.grammars``): the grammar paths of the scheduler.


class GrammarRejectionIgnored:
    """C-07/C-09: a sampled token the grammar rejects is kept: the runtime advances the grammar
    but ignores its verdict, so the request runs on instead of ending with an error."""

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        manager = self.structured_output_manager  # type: ignore[attr-defined]
        accept = manager.accept_tokens
        manager.accept_tokens = lambda request, ids: accept(request, ids) or True
        try:
            return super().update_from_output(  # type: ignore[misc]
                scheduler_output, model_runner_output
            )
        finally:
            del manager.accept_tokens


class GrammarNotAwaited:
    """C-01/C-09: a structured request is admitted while its grammar still compiles (the runtime
    checks that compilation started, not that it finished)."""

    def _handle_blocked_waiting_request(self, request: Any) -> Any:
        from vllm.v1.request import RequestStatus

        structured = request.structured_output_request
        if (
            request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
            and structured is not None
            and not structured.is_grammar_ready
        ):
            request.status = RequestStatus.WAITING
            return True
        return super()._handle_blocked_waiting_request(request)  # type: ignore[misc]


class AbortWhileCompilingLeaks:
    """C-01/C-06: an abort of a request whose grammar still compiles is dropped (the runtime
    counts such a request as not admitted yet): it stays in the scheduler for good."""

    def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
        from vllm.v1.request import RequestStatus

        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if finished_status == RequestStatus.FINISHED_ABORTED:
            waiting = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
            held = self.requests  # type: ignore[attr-defined]
            ids = [rid for rid in ids if rid not in held or held[rid].status != waiting]
        return super().finish_requests(ids, finished_status)  # type: ignore[misc]


class DraftsNotValidated:
    """C-01/C-07: the drafter's proposals are scheduled without checking them against the
    request's grammar (sync scheduling validates them when it takes them)."""

    def update_draft_token_ids(self, draft_token_ids: Any) -> Any:
        manager = self.structured_output_manager  # type: ignore[attr-defined]
        manager.validate_tokens = lambda request, tokens: tokens
        try:
            return super().update_draft_token_ids(draft_token_ids)  # type: ignore[misc]
        finally:
            del manager.validate_tokens


class InvalidDraftsUncounted:
    """C-09: under async scheduling the drafts a grammar invalidates become placeholders but are
    not recorded (``num_invalid_spec_tokens``), so the statistics count them as proposed."""

    def update_draft_token_ids_in_output(self, draft_token_ids: Any, scheduler_output: Any) -> Any:
        result = super().update_draft_token_ids_in_output(  # type: ignore[misc]
            draft_token_ids, scheduler_output
        )
        scheduler_output.num_invalid_spec_tokens = {}
        return result


# KV-connector mixins (``conformance._core.kv_connectors``): the connector paths of the scheduler.


class ConnectorDelayedFreeSkipped:
    """C-01/C-06: a finished request's blocks are freed at once even when its KV connector keeps
    them for a pending send (``request_finished`` returned True): the connector's later
    ``finished_sending`` then names a request the scheduler no longer holds."""

    def _free_request(self, request: Any, delay_free_blocks: bool = False) -> Any:
        result = super()._free_request(request, delay_free_blocks)  # type: ignore[misc]
        if not delay_free_blocks and request.request_id in self.requests:  # type: ignore[attr-defined]
            self._free_blocks(request)  # type: ignore[attr-defined]
        return result


class RemoteKvAdmittedEarly:
    """C-01: a request waiting for remote KV is admitted before the worker reported its load
    finished (a runtime that takes the allocation for the load)."""

    def _handle_blocked_waiting_request(self, request: Any) -> Any:
        from vllm.v1.request import RequestStatus

        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            self.finished_recving_kv_req_ids.add(request.request_id)  # type: ignore[attr-defined]
        return super()._handle_blocked_waiting_request(request)  # type: ignore[misc]


class LoadFailureRecomputedUnderFail:
    """C-01/C-09: a failed KV load is recomputed although the policy is "fail" (the runtime
    reads the policy's default instead of the configuration)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.recompute_kv_load_failures = True


class InvalidBlocksIgnored:
    """C-01: blocks the worker reports it failed to load are ignored: the requests keep their
    computed tokens and are never recomputed from the first bad block."""

    def _handle_invalid_blocks(self, *args: Any, **kwargs: Any) -> Any:
        return set()


class DeferredBlockFreeDropped:
    """C-01/C-06: with a consumer connector and steps in flight (async scheduling), freed blocks
    go back to the pool at once instead of after the steps that may still write them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.defer_block_free = False


class ConnectorOutputNotForwarded:
    """C-09: the worker's connector report is acted on by the scheduler but never handed to
    the scheduler-side connector (``update_connector_output``): the offloading connector never
    learns a store finished, so nothing it offloaded is ever hit."""

    def _update_from_kv_xfer_finished(self, kv_connector_output: Any) -> Any:
        connector, self.connector = self.connector, None  # type: ignore[attr-defined]
        try:
            return super()._update_from_kv_xfer_finished(kv_connector_output)  # type: ignore[misc]
        finally:
            self.connector = connector


class KvTransferParamsDropped:
    """C-07: the KV transfer parameters the connector returns for a finished request never
    reach its output (the runtime rebuilds the output without them)."""

    def _free_request(self, request: Any, delay_free_blocks: bool = False) -> Any:
        result = super()._free_request(request, delay_free_blocks)  # type: ignore[misc]
        return None, result[1]


class EncoderInstanceNeverStops:
    """C-01/C-06: the step's update has no encoder-only stop (vllm-omni 0.28's own loop): on an
    encoder-only instance (vLLM 0.28's EC producer) a request whose prompt is consumed samples
    nothing and so never finishes; it stays running, holding its blocks."""

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        from conformance._core import vllm_compat as vc

        flag = vc.encoder_only_flag()
        _require(self, flag)
        kept = getattr(self, flag)
        setattr(self, flag, False)
        try:
            return super().update_from_output(*args, **kwargs)  # type: ignore[misc]
        finally:
            setattr(self, flag, kept)


class EcMetadataWithKvOnly:
    """C-09: connector metadata is attached only when a KV connector is configured, so an
    instance with an EC connector alone sends its workers no EC metadata (the worker-side EC
    connector has nothing to bind: a multimodal runner's ``assert`` fails there)."""

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        if self.connector is None:  # type: ignore[attr-defined]
            out.ec_connector_metadata = None
        return out


class SamplingMasksNotRouted:
    """C-09: the step's update never reads the runner's sampling masks (vllm-omni 0.30's own
    update loop): the outputs of a configuration that asks for masks carry no
    ``new_sampling_mask``."""

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        _require(self, "return_sampling_mask")
        kept = self.return_sampling_mask  # type: ignore[has-type]
        self.return_sampling_mask = False
        try:
            return super().update_from_output(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.return_sampling_mask = kept


class RoutedExpertsPromptDropped:
    """C-09: the block ids snapshotted at schedule time are gone when the update reads a
    finished prefill's routing (a runtime's own schedule bookkeeping that rebuilds the
    snapshot): a request's first output carries an empty prompt routing (vLLM 0.28-0.30)."""

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        _require(self, "_re_block_ids")
        self._re_block_ids.clear()  # type: ignore[attr-defined]
        return super().update_from_output(*args, **kwargs)  # type: ignore[misc]


class AuxOutputNotTaken:
    """C-09: the update never takes the aux-output connector's share of the runner output (a
    runtime's own update loop that predates the connector): no output carries routed experts
    (vLLM 0.31+, where routed experts come through the connector)."""

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        _require(self, "aux_output_connector")
        connector = self.aux_output_connector  # type: ignore[attr-defined]
        if connector is None:
            return super().update_from_output(*args, **kwargs)  # type: ignore[misc]
        connector.take_output = lambda request, output: None
        try:
            return super().update_from_output(*args, **kwargs)  # type: ignore[misc]
        finally:
            del connector.take_output


class ExternalHitNotCapped:
    """C-09: admission keeps the KV connector's whole external hit although the aux-output
    connector holds no routing for it (a runtime whose own admission skips the cap): the
    request loads and skips tokens whose routed experts nobody can emit (vLLM 0.31+)."""

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        _require(self, "aux_output_connector")
        connector = self.aux_output_connector  # type: ignore[attr-defined]
        if connector is None:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        connector.cap_external_hit = lambda request, local, external: external
        try:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        finally:
            del connector.cap_external_hit


class PartialTailNotOffloaded:
    """C-09: a producer's finish hook drops the partial Mamba tail the KV-cache manager hands it
    (a runtime whose own finish path skips ``finalize_partial_tail_offloads``): the connector
    never offers the state, so a later request cannot hit that prefix."""

    def _connector_finished(self, request: Any) -> Any:
        manager = self.kv_cache_manager  # type: ignore[attr-defined]
        manager.finalize_partial_tail_offloads = lambda request: []
        try:
            return super()._connector_finished(request)  # type: ignore[misc]
        finally:
            del manager.finalize_partial_tail_offloads


# ---- the catalogue ------------------------------------------------------------------------


def _sub(**kw: Any) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    return lambda: _subject(
        _subject_with(**{k: (v() if k == "runner_cls" else v) for k, v in kw.items()})
    )


def _on_routed_path(
    path: str, apply: Callable[[], contextlib.AbstractContextManager[Any]]
) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """``apply`` where the installed vLLM routes experts by ``path`` ("slots" or "connector",
    ``vllm_compat.aux_outputs.ROUTED_EXPERTS_PATH``); elsewhere the mutant's code is absent
    and its self-test is skipped as not applicable."""

    def gated() -> contextlib.AbstractContextManager[Any]:
        from conformance._core.vllm_compat.aux_outputs import ROUTED_EXPERTS_PATH

        if ROUTED_EXPERTS_PATH.value() != path:
            import pytest

            why = f"this release routes experts by {ROUTED_EXPERTS_PATH.value()}, not {path}"
            pytest.skip(f"not applicable: {why}")
        return apply()

    return gated


def _delivers_stale_output(
    apply: Callable[[], contextlib.AbstractContextManager[Any]],
) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """Gate for a mutant that drops stale output: from vLLM 0.28, where a preemption's stale
    output is delivered unless ``drop_stale_output`` is set; 0.26 has no such field."""

    def gated() -> contextlib.AbstractContextManager[Any]:
        from conformance._core.vllm_compat.stale_output import stale_fields

        if "drop_stale_output" not in stale_fields():
            import pytest

            pytest.skip(f"not applicable: this release's stale output is {stale_fields()}")
        return apply()

    return gated


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "requeue_preempted_at_back",
        "C-01/C-07",
        "lockstep-off",
        "preempted requests re-queued at the back of the waiting queue",
        _sub(scheduler_mixin=RequeuePreemptedAtBack),
    ),
    Mutant(
        "stale_registry_entry",
        "C-03",
        "registry",
        "the registry keeps an entry for a difference the runtime no longer makes",
        lambda: _subject(_stale_registry_subject()),
    ),
    Mutant(
        "finished_output_twice",
        "C-62",
        "lockstep-off",
        "a finished request's output is emitted twice: two terminal outcomes",
        _sub(scheduler_mixin=RepeatsFinishedOutput),
    ),
    Mutant(
        "free_blocks_reversed",
        "C-05",
        "lockstep-off",
        "a finished request's blocks freed in reverse (eviction) order",
        _sub(scheduler_mixin=FreeBlocksReversed),
    ),
    Mutant(
        "abort_keeps_omni_progress",
        "C-04",
        "lockstep-token-updates",
        "transfer progress of a terminated request is not dropped",
        _abort_keeps_omni_progress,
    ),
    Mutant(
        "extra_request_attribute",
        "C-12",
        "lockstep-token-updates",
        "the input adapter sets an undeclared attribute on Request",
        _extra_request_attribute,
    ),
    Mutant(
        "tensor_in_upstream_field",
        "C-11",
        "lockstep-token-updates",
        "a tensor stashed in an upstream Request field (ec_transfer_params)",
        _tensor_in_upstream_field,
    ),
    Mutant(
        "adapter_misnames_wrong_type",
        "C-13",
        "malformed-inputs",
        "a rejection of a value of the wrong type names another type",
        _adapter_misnames_wrong_type,
    ),
    Mutant(
        "adapter_drops_list_information",
        "C-13",
        "malformed-inputs",
        "a list in a request's additional information is kept as an empty tuple",
        _adapter_drops_list_information,
    ),
    Mutant(
        "adapter_takes_meta_tensor",
        "C-13",
        "malformed-inputs",
        "conditioning without data (a meta tensor) is taken as zeros",
        _adapter_takes_meta_tensor,
    ),
    Mutant(
        "adapter_accepts_nan_embeds",
        "C-13",
        "malformed-inputs",
        "NaN/inf prompt embeds are silently cleaned instead of rejected",
        _adapter_accepts_nan_embeds,
    ),
    Mutant(
        "eof_reason_lost",
        "C-43",
        "chunk-contracts",
        "an aborted request's EOF chunk says the request stopped",
        _eof_reason_lost,
    ),
    Mutant(
        "eof_reason_dropped",
        "C-43",
        "chunk-contracts",
        "every chunk, the EOF too, is built without its finish reason",
        _eof_reason_dropped,
    ),
    Mutant(
        "leading_zero_ids_stripped",
        "C-13",
        "malformed-inputs",
        "id 0 at the front of a prompt is taken for padding and stripped",
        _leading_zero_ids_stripped,
    ),
    Mutant(
        "tuple_loses_payload",
        "C-46",
        "chunk-contracts",
        "the stage process's wire loses the payload inside a tuple of processor data",
        _tuple_loses_payload,
    ),
    Mutant(
        "rejection_says_nothing",
        "C-13",
        "malformed-inputs",
        "a rejected input's message names the request and the field but not what is wrong",
        _rejection_says_nothing,
    ),
    Mutant(
        "info_list_items_unchecked",
        "C-13",
        "malformed-inputs",
        "a list in a request's additional information is accepted without checking its items",
        _info_list_items_unchecked,
    ),
    Mutant(
        "rejection_message_blank",
        "C-13",
        "malformed-inputs",
        "a rejected input's message names neither the request nor the field",
        _rejection_message_blank,
    ),
    Mutant(
        "payload_built_in_scheduler",
        "C-10/C-11",
        "static-payload-builders",
        "a StagePayload constructed in omni_runtime/sched (planted source)",
        lambda: contextlib.nullcontext(),
    ),
    Mutant(
        "worker_extra_request",
        "C-20",
        "graph-independence",
        "the runner returns a result for a request it was not given",
        _sub(runner_cls=_worker_extra_request),
    ),
    Mutant(
        "worker_missing_request",
        "C-20",
        "graph-independence",
        "the runner drops the last scheduled request's result",
        _sub(runner_cls=_worker_missing_request),
    ),
    Mutant(
        "send_from_worker",
        "C-21",
        "lockstep-hidden-inline",
        "the runner sends a chunk into the scheduler's sink",
        _send_from_worker_subject,
    ),
    Mutant(
        "runner_reads_stage_graph",
        "C-22",
        "graph-independence",
        "sampled tokens depend on the stages that follow",
        _sub(runner_cls=_runner_reads_stage_graph),
    ),
    Mutant(
        "token_only_drops_multimodal",
        "C-30",
        "token-only-multimodal",
        "token-only mode builds payloads without the per-token multimodal outputs",
        _token_only_drops_multimodal,
    ),
    Mutant(
        "token_only_builds_hidden",
        "C-30",
        "token-only",
        "token-only mode still copies and delivers hidden rows",
        _sub(runner_cls=_token_only_builds_hidden),
    ),
    Mutant(
        "conditioning_row_zero_falsy",
        "C-31",
        "token-only",
        "a prefill conditioning on the step's first row is taken for none, in both payload modes",
        _sub(runner_cls=_conditioning_row_zero_falsy),
    ),
    Mutant(
        "conditioning_resent_on_reprefill",
        "C-31",
        "token-only-reprefill",
        "a request preempted after its conditioning crossed sends it again when it re-runs its "
        "prompt",
        _sub(runner_cls=_conditioning_resent_on_reprefill),
    ),
    Mutant(
        "conditioning_dropped_token_only",
        "C-31",
        "token-only",
        "token-only mode drops the prefill conditioning",
        _sub(runner_cls=_conditioning_dropped_token_only),
    ),
    Mutant(
        "truthy_token_updates",
        "C-40/C-41",
        "chunk-contracts",
        "transfer fires on a truthy (not True) requires_token_updates",
        _truthy_token_updates,
    ),
    Mutant(
        "final_stage_request_sends",
        "C-42",
        "chunk-contracts",
        "a request final at this stage gets an EOF delivery on free",
        _sub(scheduler_mixin=FinalStageRequestSends),
    ),
    Mutant(
        "plain_request_gets_slot",
        "C-42",
        "chunk-contracts",
        "a plain vLLM client's request (no omni slot) is given the stage's downstream",
        _sub(scheduler_mixin=PlainRequestGetsSlot),
    ),
    Mutant(
        "no_eof_when_processor_returns_none",
        "C-43",
        "chunk-contracts",
        "no EOF chunk when the processor returns None at EOF",
        _no_eof_when_processor_returns_none,
    ),
    Mutant(
        "token_update_data_dropped",
        "C-43",
        "chunk-contracts",
        "a token update's returned data is not sent downstream",
        _token_update_data_dropped,
    ),
    Mutant(
        "token_update_call_skipped",
        "C-40",
        "chunk-contracts",
        "a declared processor without new_token_ids is not called on ids-only steps",
        _token_update_call_skipped,
    ),
    Mutant(
        "double_eof_on_abort",
        "C-43",
        "chunk-contracts",
        "an aborted request gets two EOF deliveries",
        _double_eof_on_abort,
    ),
    Mutant(
        "ids_not_copied",
        "C-44",
        "chunk-contracts",
        "the processor is handed upstream's own id list, not a copy",
        _ids_not_copied,
    ),
    Mutant(
        "stale_step_chunk_sent",
        "C-45",
        "chunk-reset-in-flight",
        "the payload of a step upstream dropped as stale is still sent downstream",
        _sub(scheduler_mixin=SendsStaleSteps),
    ),
    Mutant(
        "redelivery_after_preemption",
        "C-45",
        "chunk-contracts",
        "payload rows already delivered are not trimmed after preemption/recompute",
        _redelivery_after_preemption,
    ),
    Mutant(
        "payloads_on_empty_steps",
        "C-50",
        "token-only",
        "payload objects built on steps with nothing to deliver",
        _sub(runner_cls=_payloads_on_empty_steps),
    ),
    Mutant(
        "payload_slot_shifted",
        "C-51",
        "token-only",
        "empty payload slots are compacted, shifting later payloads",
        _payload_slot_shifted,
    ),
    Mutant(
        "snapshot_drops_multimodal",
        "C-52",
        "inline-vs-background-token-only",
        "the background snapshot forgets the token-only runner's per-token multimodal outputs",
        _snapshot_drops_multimodal,
    ),
    Mutant(
        "background_no_snapshot",
        "C-52/C-53",
        "inline-vs-background",
        "the background builder reads live runner buffers without a snapshot",
        _background_no_snapshot,
    ),
    Mutant(
        "connector_collected_on_builder",
        "C-54",
        "builder-errors",
        "connector output collected on the background builder thread",
        _sub(runner_cls=_connector_collected_on_builder),
    ),
    Mutant(
        "builder_error_swallowed",
        "C-54",
        "builder-errors",
        "a background builder exception is swallowed",
        _builder_error_swallowed,
    ),
    Mutant(
        "background_build_never_runs",
        "C-54",
        "builder-errors",
        "background builds always fail and recovery silently rebuilds them on the caller",
        _background_build_never_runs,
    ),
    Mutant(
        "last_stage_builds_payloads",
        "C-50",
        "last-stage",
        "a stage with nobody downstream builds payload objects",
        _last_stage_builds_payloads,
    ),
    Mutant(
        "unknown_output_ignored",
        "C-30",
        "unknown-output",
        "a per-token output the model does not provide is skipped, not refused",
        _unknown_output_ignored,
    ),
    Mutant(
        "connector_fault_swallowed",
        "C-61",
        "connector-faults",
        "a chunk the connector refuses is dropped and its request goes on",
        _connector_fault_swallowed,
    ),
    Mutant(
        "released_request_kept",
        "C-04",
        "processor-batching",
        "the codec streamer still holds a request after it was released",
        _released_request_kept,
    ),
    Mutant(
        "batch_through_any_attribute",
        "C-40",
        "chunk-contracts",
        "a processor whose own __call__ its batch method does not stand for is batched anyway",
        _batch_through_any_attribute,
    ),
    Mutant(
        "batch_counts_dropped",
        "C-40",
        "lockstep-speculative",
        "the batch call to a processor says nothing of steps that accepted several ids",
        _batch_counts_dropped,
    ),
    Mutant(
        "background_one_build_slot",
        "C-51",
        "lockstep-hidden-background-async",
        "an uncollected background output reads the last build submitted, not its own step's",
        _background_one_build_slot,
    ),
    Mutant(
        "builder_threads_unrecorded",
        "C-54",
        "builder-errors",
        "the materializer's record of its builder threads stays empty",
        _builder_threads_unrecorded,
    ),
    Mutant(
        "recovery_fails_whole_step",
        "C-54",
        "builder-recovery",
        "a background build that keeps failing for one request fails every request of its step",
        _recovery_fails_whole_step,
    ),
    Mutant(
        "rebuilt_request_stays_failed",
        "C-54",
        "builder-cleared",
        "a request whose lone rebuild succeeded after a failure is still reported failed",
        _rebuilt_request_stays_failed,
    ),
    Mutant(
        "inline_builder_broken",
        "C-50",
        "inline-vs-background",
        "an inline stage's builds always fail and step recovery rebuilds them unseen",
        _inline_builder_broken,
    ),
    Mutant(
        "abandoned_build_error_swallowed",
        "C-54",
        "builder-abandoned",
        "the build error of an output nobody collected is dropped, not raised from a later step",
        _abandoned_build_error_swallowed,
    ),
    Mutant(
        "trim_loses_kept_rows",
        "C-45",
        "chunk-contracts",
        "trimming already-delivered rows also drops the rows after them",
        _trim_loses_kept_rows,
    ),
    Mutant(
        "error_cause_dropped",
        "C-61",
        "fault-containment",
        "a request the worker failed gets its error output without the cause",
        _error_cause_dropped,
    ),
    Mutant(
        "send_fault_fails_neighbours",
        "C-61",
        "send-path-faults",
        "a chunk processor raising for one request fails every request of that step",
        _send_fault_fails_neighbours,
    ),
    Mutant(
        "fault_restarts_chunk_numbering",
        "C-43",
        "send-path-faults",
        "after a send-path fault the request's EOF is numbered from 0 again",
        _fault_restarts_chunk_numbering,
    ),
    Mutant(
        "shipped_processor_raises_at_eof",
        "C-61",
        "lockstep-hidden-inline",
        "the shipped thinker processor raises on every EOF call, hidden by the send-path entry",
        _shipped_processor_raises_at_eof,
    ),
    Mutant(
        "ended_request_missed_in_second_container",
        "C-61",
        "send-path-faults",
        "a request failed on its terminal delivery is missed behind another client's container",
        _ended_request_missed_in_second_container,
    ),
    Mutant(
        "final_fault_not_released",
        "C-61",
        "send-path-faults",
        "a processor whose final call raised is never asked to release the request",
        _final_fault_not_released,
    ),
    Mutant(
        "background_ignores_step_retries",
        "C-54",
        "recovery-builds",
        "the background materializer recovers with its default retry budget, not the stage's",
        _background_ignores_step_retries,
    ),
    Mutant(
        "abort_fault_left_pending",
        "C-04",
        "abort-faults",
        "a send-path failure on an abort's EOF is left for a later step to take",
        _abort_fault_left_pending,
    ),
    Mutant(
        "error_output_replaces_step_outputs",
        "C-61/C-62",
        "fault-containment",
        "a request's error output replaces the step's other outputs instead of joining them",
        _error_output_replaces_step_outputs,
    ),
    Mutant(
        "error_output_drops_trace_headers",
        "C-61",
        "fault-containment",
        "a request's error output leaves out the trace headers the request was sent with",
        _error_output_drops_trace_headers,
    ),
    Mutant(
        "outputs_under_one_client",
        "C-07",
        "lockstep-off",
        "a step's outputs all come back in one client's container",
        _sub(scheduler_mixin=OutputsUnderOneClient),
    ),
    Mutant(
        "trace_headers_dropped",
        "C-07",
        "lockstep-token-updates",
        "the input adapter leaves a request's trace headers out of the request it builds",
        _trace_headers_dropped,
    ),
    Mutant(
        "codec_chunk_held_a_step",
        "C-40",
        "lockstep-token-updates",
        "the codec streamer sends a full chunk one step after it filled",
        _codec_chunk_held_a_step,
    ),
    Mutant(
        "codec_drops_id_zero",
        "C-40",
        "lockstep-token-updates",
        "the codec streamer drops codec id 0 as if it were a control id",
        _codec_drops_id_zero,
    ),
    Mutant(
        "batched_chunks_unnamed",
        "C-43",
        "lockstep-token-updates",
        "chunks from a processor's batch call are sent but no output names them",
        _batched_chunks_unnamed,
    ),
    Mutant(
        "batch_reads_one_id_each",
        "C-40",
        "processor-batching",
        "the codec streamer's batch call reads one id per request whatever counts says",
        _batch_reads_one_id_each,
    ),
    Mutant(
        "eof_not_flagged_on_output",
        "C-43",
        "lockstep-token-updates",
        "the output of the step that delivered a request's EOF does not say so (omni_eof)",
        _eof_not_flagged_on_output,
    ),
    Mutant(
        "codec_eof_not_ids",
        "C-40",
        "lockstep-token-updates",
        "the codec streamer's empty EOF carries a float tensor, not codec ids",
        _codec_eof_not_ids,
    ),
    Mutant(
        "forwarder_renames_hidden",
        "C-51",
        "lockstep-hidden-inline",
        "the thinker's forwarder hands its hidden rows downstream under another key",
        _forwarder_renames_hidden,
    ),
    Mutant(
        "pinned_fault_fails_whole_step",
        "C-61",
        "fault-containment",
        "a persistent step fault fails every request of the step, not only the one it is on",
        _pinned_fault_fails_whole_step,
    ),
    Mutant(
        "prefix_merge_missing_rows",
        "C-55",
        "lockstep-hidden-inline",
        "a prefix-cache hit delivers no rows for its cached prompt positions",
        _prefix_merge_missing_rows,
    ),
    Mutant(
        "wire_drops_last_byte",
        "C-46",
        "chunk-contracts",
        "the stage's chunk writer leaves the last tensor's final byte of a step unwritten",
        _wire_drops_last_byte,
    ),
    Mutant(
        "reader_keeps_segments",
        "C-46",
        "chunk-contracts",
        "the parent reads a step's chunks but never unlinks their shared-memory segment",
        _reader_keeps_segments,
    ),
    Mutant(
        "codec_buffer_outlives_request",
        "C-46",
        "lockstep-token-updates",
        "the codec streamer keeps a buffer for every request it ended, in a stage process",
        _codec_buffer_outlives_request,
    ),
    Mutant(
        "audit_hides_codec_buffers",
        "C-46",
        "lockstep-token-updates",
        "a stage process's audit answer reports no codec buffers, whatever the streamer holds",
        _audit_hides_codec_buffers,
    ),
    Mutant(
        "chunks_to_a_client_nobody_is",
        "C-46",
        "chunk-contracts",
        "a step's chunks without outputs go on a message for a client the stage does not have",
        _chunks_to_a_client_nobody_is,
    ),
    Mutant(
        "failed_request_eof_discarded",
        "C-61",
        "fault-containment",
        "a stage process drops the error EOF of a request failed inside a step",
        _failed_request_eof_discarded,
    ),
    Mutant(
        "segments_outside_the_prefix",
        "C-46",
        "chunk-contracts",
        "a stage's chunk segments are named outside the prefix its parent sweeps by",
        _segments_outside_the_prefix,
    ),
    Mutant(
        "abort_keeps_unsent_chunks",
        "C-46",
        "lockstep-token-updates",
        "an abort between steps leaves its EOF chunk in the writer; it crosses with the next step",
        _abort_keeps_unsent_chunks,
    ),
    Mutant(
        "staged_request_survives_abort",
        "C-04",
        "staged-aborts",
        "an abort that meets a request still staged in the stage process leaves it staged",
        _staged_request_survives_abort,
    ),
    Mutant(
        "slot_bool_tensor_as_bytes",
        "C-46",
        "stage-inputs-cross",
        "the stage process rebuilds a boolean slot tensor as uint8",
        _slot_bool_tensor_as_bytes,
    ),
    Mutant(
        "stats_counted_before_preemption",
        "C-09",
        "axis-stats-events-async",
        "the step's running count is taken before schedule() preempts and admits",
        _sub(scheduler_mixin=StatsCountedBeforePreemption),
    ),
    Mutant(
        "logprobs_by_sampled_order",
        "C-02",
        "axis-logprobs-sync",
        "an output's logprobs are sliced at its place among the requests that sampled",
        _sub(scheduler_mixin=LogprobsBySampledOrder),
    ),
    Mutant(
        "encoder_inputs_held_to_finish",
        "C-01",
        "axis-multimodal-sync",
        "consumed encoder outputs stay referenced until their request finishes",
        _sub(scheduler_mixin=EncoderInputsHeldToFinish),
    ),
    Mutant(
        "pause_all_keeps_running",
        "C-01",
        "axis-pause-sync",
        "a scheduler paused for everything still runs its running requests",
        _sub(scheduler_mixin=PauseAllKeepsRunning),
    ),
    Mutant(
        "active_seqs_from_slots",
        "C-01",
        "axis-limits-active-seqs-sync",
        "admission is capped at max_num_seqs, not max_num_active_seqs",
        _sub(scheduler_mixin=ActiveSeqsFromSlots),
    ),
    Mutant(
        "lora_limit_ignored",
        "C-01",
        "axis-lora-sync",
        "a step serves more LoRA adapters than max_loras",
        _sub(scheduler_mixin=LoraLimitIgnored),
    ),
    Mutant(
        "encoder_cache_connector_unused",
        "C-01",
        "axis-ec-consumer-multimodal-sync",
        "images an EC producer stored are encoded again instead of loaded",
        _sub(scheduler_mixin=EncoderCacheConnectorUnused),
    ),
    Mutant(
        "encoder_cache_kept_on_reset",
        "C-01",
        "axis-pause-multimodal-sync",
        "reset_encoder_cache leaves cached encoder outputs in place",
        _sub(scheduler_mixin=EncoderCacheKeptOnReset),
    ),
    Mutant(
        "prefill_cadence_ignored",
        "C-01",
        "axis-prefill-cadence-sync",
        "new prefills start every step despite prefill_schedule_interval",
        _sub(scheduler_mixin=PrefillCadenceIgnored),
    ),
    Mutant(
        "retention_ignored",
        "C-01/C-06",
        "axis-hybrid-swa-retention-sync",
        "sliding-window checkpoints cached at every block despite the retention interval",
        _sub(scheduler_mixin=RetentionIgnored),
    ),
    Mutant(
        "mamba_states_kept_densely",
        "C-01/C-06",
        "axis-hybrid-mamba-retention-sync",
        "Mamba states cached at every block despite the retention interval (the same ignored "
        "interval as retention_ignored, met by the Mamba manager)",
        _sub(scheduler_mixin=RetentionIgnored),
    ),
    Mutant(
        "eagle_hit_block_kept",
        "C-01/C-07",
        "axis-hybrid-swa-eagle-sync",
        "prefix-cache hits keep the last block an EAGLE drafter needs recomputed",
        _sub(scheduler_mixin=EagleHitBlockKept),
    ),
    Mutant(
        "eagle_mamba_hit_block_kept",
        "C-01/C-07",
        "axis-hybrid-mamba-eagle-sync",
        "the Mamba layout's hits keep the block an EAGLE drafter needs recomputed (the same "
        "lost flag as eagle_hit_block_kept, met by the Mamba manager)",
        _sub(scheduler_mixin=EagleHitBlockKept),
    ),
    Mutant(
        "lookahead_slots_ignored",
        "C-01/C-06",
        "axis-spec-decode-eagle-sync",
        "no KV slots reserved for an EAGLE drafter's lookahead",
        _sub(scheduler_mixin=LookaheadSlotsIgnored),
    ),
    Mutant(
        "encoder_updates_dropped",
        "C-01",
        "axis-multimodal-v2-sync",
        "the V2-runner output never names the images a worker installs or drops",
        _sub(scheduler_mixin=EncoderUpdatesDropped),
    ),
    Mutant(
        "ring_as_full_attention",
        "C-01/C-06",
        "axis-hybrid-ring-sync",
        "a compressor's ring buffer managed as full attention: a block per 16 tokens, not one",
        _sub(scheduler_mixin=RingAsFullAttention),
    ),
    Mutant(
        "prompt_logprobs_dropped",
        "C-01",
        "axis-logprobs-sync",
        "prompt logprobs the runner returned never reach the request's output",
        _sub(scheduler_mixin=PromptLogprobsDropped),
    ),
    Mutant(
        "repetition_stop_ignored",
        "C-01",
        "axis-limits-sync",
        "a request asking for repetition detection is not stopped when its output loops",
        _sub(scheduler_mixin=RepetitionStopIgnored),
    ),
    Mutant(
        "shutdown_leaves_connector",
        "C-01",
        "axis-kv-harness-recompute-sync",
        "the scheduler's shutdown does not shut its KV connector down",
        _sub(scheduler_mixin=ShutdownLeavesConnector),
    ),
    Mutant(
        "finished_sets_dropped",
        "C-01",
        "axis-data-parallel-rank-sync",
        "a data-parallel rank's outputs do not say which requests each step finished",
        _sub(scheduler_mixin=FinishedSetsDropped),
    ),
    Mutant(
        "dynamic_drafts_ignored",
        "C-01",
        "axis-spec-decode-dynamic-sync",
        "the draft count ignores dynamic speculative decoding's batch-size schedule",
        _sub(scheduler_mixin=DynamicDraftsIgnored),
    ),
    Mutant(
        "mamba_draft_slots_missing",
        "C-01/C-06",
        "axis-hybrid-mamba-spec-decode-sync",
        "Mamba state gets no slot per draft token under speculative decoding",
        _sub(scheduler_mixin=MambaDraftSlotsMissing),
    ),
    Mutant(
        "session_images_dropped",
        "C-01",
        "axis-streaming-sessions-multimodal-sync",
        "images in a streaming session's later chunks are never encoded",
        _sub(scheduler_mixin=SessionImagesDropped),
    ),
    Mutant(
        "embeds_hashed_as_tokens",
        "C-01/C-07",
        "axis-prompt-embeds-sync",
        "prompts sent as embeddings are hashed by their (placeholder) token ids alone",
        _sub(scheduler_mixin=EmbedsHashedAsTokens),
    ),
    Mutant(
        "connector_worker_reports_dropped",
        "C-01/C-06",
        "axis-hisparse-sync",
        "the worker's KV-connector reports are dropped: HiSparse's page spills never complete",
        _sub(scheduler_mixin=ConnectorWorkerReportsDropped),
    ),
    Mutant(
        "pooled_output_ignored",
        "C-01/C-04",
        "axis-pooling-sync",
        "pooled outputs never reach the scheduler: pooling requests are not finished by them",
        _sub(scheduler_mixin=PooledOutputIgnored),
    ),
    Mutant(
        "session_ends_at_first_turn",
        "C-01",
        "axis-streaming-sessions-sync",
        "a streaming input session finishes when its first turn stops",
        _sub(scheduler_mixin=SessionEndsAtFirstTurn),
    ),
    Mutant(
        "stale_output_dropped",
        "C-01",
        "axis-pipeline-2-sync",
        "a preempted request's in-flight output is dropped, not delivered (the batch queue "
        "of pipeline parallelism keeps a step in flight)",
        _delivers_stale_output(_sub(scheduler_mixin=StaleOutputDropped)),
    ),
    Mutant(
        "statistics_throttled",
        "C-09",
        "axis-stats-events-sync",
        "statistics are returned at most every third update, None between",
        _sub(scheduler_mixin=StatisticsThrottled),
    ),
    Mutant(
        "kv_events_dropped_on_reset",
        "C-09",
        "axis-stats-events-sync",
        "reset_prefix_cache drains the event it queued: no 'all blocks cleared' is published",
        _sub(scheduler_mixin=KvEventsDroppedOnReset),
    ),
    Mutant(
        "skip_reading_prefix_cache_ignored",
        "C-01/C-07",
        "axis-stats-events-sync",
        "a request that skips reading the prefix cache gets a local hit anyway",
        _sub(scheduler_mixin=SkipReadingPrefixCacheIgnored),
    ),
    Mutant(
        "full_report_events_dropped",
        "C-09",
        "axis-stats-events-sync",
        "a request's 'full' KV-cache report mode is ignored: reused blocks are not re-published",
        _sub(scheduler_mixin=FullReportEventsDropped),
    ),
    Mutant(
        "bonus_counted_accepted",
        "C-09",
        "axis-spec-decode-async",
        "spec-decoding statistics count the bonus token as an accepted draft",
        _sub(scheduler_mixin=BonusCountedAccepted),
    ),
    Mutant(
        "rejected_drafts_kept",
        "C-01/C-07",
        "axis-spec-decode-sync",
        "rejected drafts are not rolled back: their positions stay counted as computed",
        _sub(scheduler_mixin=RejectedDraftsKept),
    ),
    Mutant(
        "priority_ignored_by_waiting_queue",
        "C-01/C-09",
        "axis-priority-sync",
        "the waiting queue is rebuilt first-come-first-served whatever the policy",
        _sub(scheduler_mixin=PriorityIgnoredByWaitingQueue),
    ),
    Mutant(
        "pipeline_tokens_not_sent",
        "C-07/C-09",
        "axis-pipeline-2-sync",
        "under pipeline parallelism the cached-request data carries no new token ids",
        _sub(scheduler_mixin=PipelineTokensNotSent),
    ),
    Mutant(
        "grammar_rejected_token_kept",
        "C-07/C-09",
        "axis-structured-outputs-sync",
        "a sampled token the grammar rejects is kept: the request is not ended with an error",
        _sub(scheduler_mixin=GrammarRejectionIgnored),
    ),
    Mutant(
        "grammar_not_awaited",
        "C-01/C-09",
        "axis-structured-outputs-async",
        "a structured request is admitted while its grammar still compiles",
        _sub(scheduler_mixin=GrammarNotAwaited),
    ),
    Mutant(
        "abort_while_compiling_leaks",
        "C-01/C-06",
        "axis-structured-outputs-sync",
        "an abort of a request whose grammar still compiles is dropped: the request stays",
        _sub(scheduler_mixin=AbortWhileCompilingLeaks),
    ),
    Mutant(
        "drafts_not_validated",
        "C-01/C-07",
        "axis-structured-spec-decode-sync",
        "drafts are scheduled without checking them against the request's grammar",
        _sub(scheduler_mixin=DraftsNotValidated),
    ),
    Mutant(
        "invalid_drafts_uncounted",
        "C-09",
        "axis-structured-spec-decode-async",
        "drafts the grammar invalidates (async) are not recorded as invalid",
        _sub(scheduler_mixin=InvalidDraftsUncounted),
    ),
    Mutant(
        "connector_delayed_free_skipped",
        "C-01/C-06",
        "axis-kv-harness-recompute-sync",
        "a finished request's blocks are freed although its KV connector delays the free",
        _sub(scheduler_mixin=ConnectorDelayedFreeSkipped),
    ),
    Mutant(
        "remote_kv_admitted_early",
        "C-01",
        "axis-kv-harness-fail-async",
        "a request waiting for remote KV is admitted before its load is reported finished",
        _sub(scheduler_mixin=RemoteKvAdmittedEarly),
    ),
    Mutant(
        "load_failure_recomputed_under_fail",
        "C-01/C-09",
        "axis-kv-harness-fail-sync",
        "a failed KV load is recomputed under kv_load_failure_policy 'fail'",
        _sub(scheduler_mixin=LoadFailureRecomputedUnderFail),
    ),
    Mutant(
        "invalid_blocks_ignored",
        "C-01",
        "axis-kv-harness-recompute-async",
        "blocks reported invalid are ignored: no recompute from the first bad block",
        _sub(scheduler_mixin=InvalidBlocksIgnored),
    ),
    Mutant(
        "deferred_block_free_dropped",
        "C-01/C-06",
        "axis-kv-example-consumer-async",
        "a consumer connector's blocks are freed while steps that may write them are in flight",
        _sub(scheduler_mixin=DeferredBlockFreeDropped),
    ),
    Mutant(
        "connector_output_not_forwarded",
        "C-09",
        "axis-kv-offload-sync",
        "the worker's connector report never reaches the scheduler-side connector",
        _sub(scheduler_mixin=ConnectorOutputNotForwarded),
    ),
    Mutant(
        "kv_transfer_params_dropped",
        "C-07",
        "axis-kv-harness-fail-sync",
        "a finished request's kv_transfer_params are dropped from its output",
        _sub(scheduler_mixin=KvTransferParamsDropped),
    ),
    Mutant(
        "window_blocks_kept",
        "C-01/C-06",
        "axis-hybrid-swa-sync",
        "blocks that fell out of the sliding window are never freed",
        _sub(scheduler_mixin=WindowBlocksKept),
    ),
    Mutant(
        "local_chunk_blocks_kept",
        "C-01/C-06",
        "axis-hybrid-local-sync",
        "blocks of a request's earlier local-attention chunks are never freed (the same skipped "
        "eviction as window_blocks_kept, met by the chunked-local manager)",
        _sub(scheduler_mixin=WindowBlocksKept),
    ),
    Mutant(
        "mamba_split_skipped",
        "C-01/C-07",
        "axis-hybrid-mamba-sync",
        "Mamba align mode: prefill chunks are not cut at Mamba block boundaries",
        _sub(scheduler_mixin=MambaSplitSkipped),
    ),
    Mutant(
        "divergent_hit_not_reconciled",
        "C-01",
        "axis-hybrid-mamba-connector-sync",
        "a hybrid hit deeper in full attention than in Mamba is kept with nothing loaded",
        _sub(scheduler_mixin=DivergentHitNotReconciled),
    ),
    Mutant(
        "handoff_keeps_window_blocks",
        "C-01/C-06",
        "axis-hybrid-swa-connector-sync",
        "a finished request reaches its connector still holding out-of-window blocks",
        _sub(scheduler_mixin=HandoffKeepsWindowBlocks),
    ),
    Mutant(
        "encoder_instance_never_stops",
        "C-01/C-06",
        "axis-ec-producer-sync",
        "an encoder-only instance's request never stops once its prompt is consumed (0.28)",
        _sub(scheduler_mixin=EncoderInstanceNeverStops),
    ),
    Mutant(
        "ec_metadata_not_built",
        "C-09",
        "axis-ec-consumer-sync",
        "an instance with only an EC connector gets no EC metadata on its steps",
        _sub(scheduler_mixin=EcMetadataWithKvOnly),
    ),
    Mutant(
        "sampling_masks_not_routed",
        "C-09",
        "axis-sampling-masks-sync",
        "the update never reads the runner's sampling masks: no output carries its mask",
        _sub(scheduler_mixin=SamplingMasksNotRouted),
    ),
    Mutant(
        "routed_experts_prompt_dropped",
        "C-09",
        "axis-routed-experts-sync",
        "a request's first output carries no routing for its prompt (block-id snapshot lost)",
        _on_routed_path("slots", _sub(scheduler_mixin=RoutedExpertsPromptDropped)),
    ),
    Mutant(
        "aux_output_not_taken",
        "C-09",
        "axis-routed-experts-sync",
        "the update never takes the aux-output connector's output: no routed experts (0.31+)",
        _on_routed_path("connector", _sub(scheduler_mixin=AuxOutputNotTaken)),
    ),
    Mutant(
        "external_hit_not_capped",
        "C-09",
        "axis-routed-experts-hybrid-connector-sync",
        "admission keeps an external hit the aux-output connector has no routing for (0.31+)",
        _sub(scheduler_mixin=ExternalHitNotCapped),
    ),
    Mutant(
        "partial_tail_not_offloaded",
        "C-09",
        "axis-hybrid-mamba-connector-chunked-sync",
        "a producer's finish hook drops the partial Mamba tail it is handed",
        _sub(scheduler_mixin=PartialTailNotOffloaded),
    ),
)


def by_name(name: str) -> Mutant:
    for m in MUTANTS:
        if m.name == name:
            return m
    raise KeyError(name)
