"""``OmniARModelRunner``: executes vLLM ``SchedulerOutput``s on CPU over a paged KV cache.

The runner owns the worker-side request states (token ids, block tables, sampling state), the
paged KV cache, input preparation, the forward, sampling, and handing each step's tensors to the
output adapter's ``PayloadBuilder`` through a materializer. It reads only the ``SchedulerOutput``
it is given, never chooses a destination or sends, and returns results for exactly the scheduled
requests in order (AR-INV-003, C-20, C-21).

``execute_model`` runs the forward; ``sample_tokens`` samples, collects connector output on the
calling thread once (C-54) and finishes payloads inline or in the background (C-50..C-53). The
phases are ``_update_states``, ``_prepare_inputs``, ``_forward``, ``_sample`` and
``_finish_payloads``. The request-state rules (V1 model-runner semantics, see
``vllm_compat.cached_request_updates``): docs/design.md, "Inside the layers".
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import ModelRunnerOutput

from omni_runtime.adapters.output import (
    OutputProducer,
    PayloadBuilder,
    PayloadInputs,
    PayloadPlan,
)
from omni_runtime.config import OmniStageConfig
from omni_runtime.models import LlamaLM
from omni_runtime.payload import OmniModelRunnerOutput, StagePayload
from omni_runtime.worker import vllm_compat as compat
from omni_runtime.worker.attention import (
    DecodeGroup,
    PagedKVCache,
    PrefillItem,
    StepAttention,
    slots_for,
)
from omni_runtime.worker.materialize import (
    BackgroundMaterializer,
    BackgroundOutput,
    InlineMaterializer,
    Materializer,
    make_materializer,
)
from omni_runtime.worker.recovery import PoisonedBlocks, StepJournal, bisect, describe, log_isolated
from omni_runtime.worker.sampler import Sampler, SamplingState, request_seed

logger = logging.getLogger(__name__)
# A step whose connector output has not been collected yet (None is a collected "nothing").
_UNCOLLECTED: Any = object()


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


@dataclass
class RequestState:
    """What the runner keeps of one request between steps."""

    req_id: str
    token_ids: list[int]  # prompt (0 at embed positions, like vLLM's Request) + sampled outputs
    prompt_len: int
    prompt_embeds: torch.Tensor | None
    prompt_is_token_ids: list[bool] | None
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingState
    conditioning_sent: bool = False
    # Output index of the token sampled in the step that carried the conditioning. If the
    # scheduler later reports fewer outputs, it dropped that step's output (stale output of a
    # forced preemption) and with it the payload: the conditioning must be sent again.
    conditioning_output_index: int = -1
    # First schedule after (re)start with a prefix-cache hit: deliver the cached rows (C-55).
    merge_pending: bool = False
    block_table: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    _table_len: int = -1

    def table(self) -> np.ndarray:
        if self._table_len != len(self.block_ids):
            self.block_table = np.asarray(self.block_ids, dtype=np.int64)
            self._table_len = len(self.block_ids)
        return self.block_table

    def replace_blocks(self, block_ids: list[int]) -> None:
        self.block_ids = list(block_ids)
        self._table_len = -1

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]


# ---- what one phase of a step hands to the next ------------------------------------------------


class DecodeRow(NamedTuple):
    """A single-token request of the step: attended in the batched decode group."""

    row: int  # its token's row in the step's flattened inputs
    context_len: int  # positions it attends to, its own included
    req_index: int  # request index in scheduler order
    table: np.ndarray  # its block table


class EmbedOverride(NamedTuple):
    """Prompt-embed rows that replace the token embedding at prompt positions."""

    row: int  # first row in the step's flattened inputs
    start: int  # first prompt position covered
    state: RequestState
    length: int  # number of rows


class PrefixMerge(NamedTuple):
    """A (re)started request whose prefix-cache hit must deliver the cached hidden rows (C-55)."""

    req_index: int  # request index in scheduler order
    table: np.ndarray  # its block table
    cached_len: int  # prompt positions the cache served


@dataclass(frozen=True)
class StepInputs:
    """What ``_prepare_inputs`` leaves for ``_forward``.

    The token ids, positions, slot mapping, query starts and per-request counts are in the
    runner's persistent buffers (rows ``[0, num_tokens)``); this names everything else.
    """

    req_ids: list[str]
    num_tokens: int
    sample_index: list[int]  # request indices that sample this step
    conditioning_rows: list[int]  # step rows of the prefill conditioning; -1 where none
    decodes: list[DecodeRow]
    prefills: list[PrefillItem]
    embed_overrides: list[EmbedOverride]
    merges: list[PrefixMerge]


@dataclass
class ExecutedStep:
    """What ``execute_model`` leaves for ``sample_tokens``; row numbers index ``hidden_buf``.

    Not frozen: a subclass may rewrite the rows it hands to ``_finish_payloads``.
    """

    req_ids: list[str]
    num_tokens: int
    sample_index: list[int]  # request indices that sample this step
    conditioning_rows: list[int]  # hidden-buffer rows; -1 where none
    prefix_rows: dict[int, torch.Tensor]
    sampled: bool = False  # sampling is done: a later fault is the payload hand-off's


class OmniARModelRunner:
    """See the module docstring."""

    def __init__(
        self, vllm_config: VllmConfig, model: LlamaLM, device: torch.device | None = None
    ) -> None:
        self.vllm_config = vllm_config
        self.model = model
        self.device = device or torch.device("cpu")
        self.dtype = model.lm_head.weight.dtype
        sched = vllm_config.scheduler_config
        self.block_size = int(vllm_config.cache_config.block_size or 16)
        self.max_num_reqs = int(sched.max_num_seqs)
        self.max_num_tokens = int(sched.max_num_batched_tokens)
        self.base_seed = int(getattr(vllm_config.model_config, "seed", 0) or 0)

        self.stage: OmniStageConfig | None = OmniStageConfig.from_vllm_config(vllm_config)
        stage = self.stage
        # Payloads exist only for a stage that has somewhere to send them.
        self.payloads_enabled = stage is not None and stage.has_downstream
        self.include_hidden = bool(stage and stage.omni_pooler_payload_include_hidden)
        self.full_prefix = bool(
            self.payloads_enabled
            and self.include_hidden
            and stage
            and stage.downstream_needs_full_prefix
        )
        self.producers = self._producers(stage.multimodal_outputs if stage else ())
        postprocess = getattr(model, "omni_postprocess", None)
        self.postprocess: Callable[..., Any] | None = postprocess if callable(postprocess) else None
        self.builder = PayloadBuilder(
            include_hidden=self.include_hidden,
            producers=self.producers if self.include_hidden else None,
            postprocess=self.postprocess,
        )
        # Parts of a step re-run in isolation are built inline whatever the stage's mode.
        self._inline = InlineMaterializer(self.builder)
        self.materializer: Materializer = make_materializer(
            stage.materialization if stage else "inline",
            self.builder,
            retries=stage.step_retries if stage is not None else 2,
            stage=stage.stage_id if stage is not None else "?",
        )

        self.sampler = Sampler()
        self.requests: dict[str, RequestState] = {}
        self.kv: PagedKVCache | None = None
        self._pending: ExecutedStep | None = None
        # Step-fault recovery (``worker.recovery``): the running step's undo journal and
        # SchedulerOutput, a step already completed by isolation, the requests a fault was
        # pinned on (until the scheduler finishes them) and the blocks they left unwritten.
        # Pinned faults are reported on ``OmniModelRunnerOutput.omni_failed``, so only an omni
        # stage can isolate; without one a fault that retries do not clear propagates.
        self.step_retries = stage.step_retries if stage is not None else 2
        self._journal: StepJournal | None = None
        self._step_so: SchedulerOutput | None = None
        self._isolated: OmniModelRunnerOutput | None = None
        self.quarantined: dict[str, str] = {}
        self.poisoned = PoisonedBlocks(self.block_size)
        self.main_thread_id = threading.get_ident()
        self._alloc_buffers(self.max_num_reqs, self.max_num_tokens)

    # ---- persistent buffers ---------------------------------------------------------------

    def _alloc_buffers(self, max_reqs: int, max_tokens: int) -> None:
        self.max_num_reqs, self.max_num_tokens = max_reqs, max_tokens
        self.input_ids = np.zeros(max_tokens, dtype=np.int64)
        self.positions = np.zeros(max_tokens, dtype=np.int64)
        self.slot_mapping = np.zeros(max_tokens, dtype=np.int64)
        self.query_start = np.zeros(max_reqs + 1, dtype=np.int64)
        self.num_scheduled = np.zeros(max_reqs, dtype=np.int64)
        self.num_computed = np.zeros(max_reqs, dtype=np.int64)
        self.conditioning_index = np.full(max_reqs, -1, dtype=np.int64)
        self.hidden_buf = torch.zeros((max_tokens, self.model.hidden_size), dtype=self.dtype)

    def persistent_buffers(self) -> dict[str, np.ndarray | torch.Tensor]:
        """The scratch buffers every step reuses (what C-52 says may be overwritten at once)."""
        return {
            "input_ids": self.input_ids,
            "positions": self.positions,
            "slot_mapping": self.slot_mapping,
            "query_start": self.query_start,
            "num_scheduled": self.num_scheduled,
            "num_computed": self.num_computed,
            "conditioning_index": self.conditioning_index,
            "hidden_buf": self.hidden_buf,
        }

    def _producers(self, names: tuple[str, ...]) -> dict[str, OutputProducer]:
        available: dict[str, OutputProducer] = {"logits": self.model.logits}
        extra = getattr(self.model, "omni_output_producers", None)
        if isinstance(extra, Mapping):
            available.update(extra)
        unknown = [n for n in names if n not in available]
        if unknown:
            raise ValueError(
                f"omni_stage.multimodal_outputs: unknown outputs {unknown}; "
                f"this model provides {sorted(available)}"
            )
        return {n: available[n] for n in names}

    # ---- KV cache -------------------------------------------------------------------------

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        spec = compat.full_attention_spec(
            self.block_size, self.model.num_kv_heads, self.model.head_dim, self.dtype
        )
        return {layer_name(i): spec for i in range(self.model.num_layers)}

    def kv_bytes_per_token(self) -> int:
        return PagedKVCache.bytes_per_block(
            num_layers=self.model.num_layers,
            block_size=1,
            num_kv_heads=self.model.num_kv_heads,
            head_dim=self.model.head_dim,
            dtype=self.dtype,
        )

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        geo = compat.kv_cache_geometry(kv_cache_config)
        expected = {layer_name(i) for i in range(self.model.num_layers)}
        if set(geo.layer_names) != expected:
            raise ValueError(
                f"KV cache layers {sorted(geo.layer_names)} != model's {sorted(expected)}"
            )
        self.block_size = geo.block_size
        self.kv = PagedKVCache(
            num_layers=self.model.num_layers,
            num_blocks=geo.num_blocks,
            block_size=geo.block_size,
            num_kv_heads=self.model.num_kv_heads,
            head_dim=self.model.head_dim,
            dtype=self.dtype,
            hidden_size=self.model.hidden_size if self.full_prefix else None,
        )

    # ---- request states -------------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput, journal: StepJournal) -> None:
        for req_id in so.finished_req_ids:
            if req_id in self.requests:
                journal.save_slot(req_id)
                del self.requests[req_id]
            self.quarantined.pop(req_id, None)
        assert self.kv is not None, "initialize_kv_cache must run before execute_model"
        self.kv.zero_blocks(compat.blocks_to_zero(so))
        self.kv.copy_blocks(compat.block_copies(so))

        for new in so.scheduled_new_reqs:
            old = self.requests.get(new.req_id)
            prompt_len = new.prompt_len
            prefill_ids = compat.new_request_prefill_ids(new)
            if prefill_ids is not None:
                token_ids = list(prefill_ids)
            elif new.prompt_token_ids is not None:
                token_ids = list(new.prompt_token_ids)
            else:
                token_ids = [0] * prompt_len
            embeds = new.prompt_embeds
            if embeds is not None:
                embeds = embeds.to(device=self.device, dtype=self.dtype)
            # V2-flavour resumption re-sends a known request as new (with its prefill ids):
            # it keeps its sampling and conditioning state. Otherwise the request is new (or a
            # streaming update) and starts afresh.
            if prefill_ids is None:
                old = None
            sampling = (
                old.sampling
                if old is not None
                else SamplingState.create(
                    new.sampling_params,
                    request_seed(new.sampling_params, self.base_seed, new.req_id),
                )
            )
            st = RequestState(
                req_id=new.req_id,
                token_ids=token_ids,
                prompt_len=prompt_len,
                prompt_embeds=embeds,
                prompt_is_token_ids=compat.new_request_prompt_is_token_ids(new),
                block_ids=list(new.block_ids[0]) if new.block_ids else [],
                num_computed_tokens=new.num_computed_tokens,
                sampling=sampling,
                conditioning_sent=old.conditioning_sent if old is not None else False,
                conditioning_output_index=old.conditioning_output_index if old is not None else -1,
                merge_pending=self.full_prefix and new.num_computed_tokens > 0,
            )
            self._recheck_conditioning(st)
            journal.save_slot(new.req_id)
            self.requests[new.req_id] = st

        for upd in compat.cached_request_updates(so):
            st = self.requests[upd.req_id]
            journal.save(st)
            st.num_computed_tokens = upd.num_computed_tokens
            if upd.all_token_ids is not None:
                st.token_ids = list(upd.all_token_ids)
            elif 0 <= upd.num_output_tokens < len(st.token_ids) - st.prompt_len:
                # The scheduler dropped tokens this runner sampled (stale async output). A new
                # list, not an in-place cut: the journal's undo relies on it (``recovery``).
                st.token_ids = st.token_ids[: st.prompt_len + upd.num_output_tokens]
            self._recheck_conditioning(st)
            if upd.resumed:
                st.replace_blocks(upd.new_block_ids[0] if upd.new_block_ids else [])
                st.merge_pending = self.full_prefix and upd.num_computed_tokens > 0
            elif upd.new_block_ids is not None and upd.new_block_ids[0]:
                st.block_ids.extend(upd.new_block_ids[0])

    @staticmethod
    def _recheck_conditioning(st: RequestState) -> None:
        if st.conditioning_sent and len(st.output_ids) <= st.conditioning_output_index:
            st.conditioning_sent = False

    # ---- the step -------------------------------------------------------------------------

    def _empty_output(self) -> ModelRunnerOutput:
        if self.stage is not None:
            return OmniModelRunnerOutput(req_ids=[], req_id_to_index={})
        return compat.empty_model_runner_output()

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Apply the step's request updates, prepare its inputs and run the forward.

        A fault undoes the step and runs it again, up to ``step_retries`` times; then the step
        is completed by isolation and its output waits for ``sample_tokens``.
        """
        if self._pending is not None or self._isolated is not None:
            raise RuntimeError("execute_model called twice without sample_tokens in between")
        self._step_so = so
        self.poisoned.next_step()
        if self._must_isolate(so):
            self._isolated = self._execute_isolated(so)
            return None
        fault: Exception | None = None
        for _ in range(1 + self.step_retries):
            journal = StepJournal(self.requests)
            try:
                self._update_states(so, journal)
                if so.total_num_scheduled_tokens == 0:
                    return self._empty_output()
                self._pending = self._forward(self._prepare_inputs(so))
            except Exception as exc:
                journal.rollback()
                fault = exc
                self._log_retry(exc)
                continue
            self._journal = journal
            return None
        assert fault is not None
        self._isolated = self._execute_isolated(so, fault)
        return None

    @torch.inference_mode()
    def sample_tokens(
        self, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput | BackgroundOutput:
        """Sample, collect connector output (C-54), then finish payloads inline or in the
        background (C-50..C-53). A fault here undoes the whole step and re-runs it."""
        if self._isolated is not None:
            done, self._isolated = self._isolated, None
            return done
        step, self._pending = self._pending, None
        journal, self._journal = self._journal, None
        if step is None:
            return self._empty_output()
        assert journal is not None and self._step_so is not None
        background = isinstance(self.materializer, BackgroundMaterializer)
        # Once per step (C-54), whatever the retries below do.
        connector = self.collect_connector_output()
        try:
            # Inline payload builds are part of the step: their faults are retried too.
            return self._finish(self._sample_output(step, connector), step)
        except Exception as exc:
            if background and step.sampled:
                # The background hand-off itself raised (an earlier, uncollected build's error,
                # C-54): that fault is not this step's and must reach the caller as it is.
                raise
            journal.rollback()
            fault: Exception = exc
            self._log_retry(exc)
        so = self._step_so
        for _ in range(self.step_retries):
            journal = StepJournal(self.requests)
            try:
                self._update_states(so, journal)
                step = self._forward(self._prepare_inputs(so))
                return self._finish(self._sample_output(step, connector), step)
            except Exception as exc:
                journal.rollback()
                fault = exc
                self._log_retry(exc)
        return self._execute_isolated(so, fault, connector)

    def _sample_output(
        self, step: ExecutedStep, connector: compat.KVConnectorOutput | None
    ) -> ModelRunnerOutput:
        sampled = self._sample(step)
        step.sampled = True
        kwargs: dict[str, Any] = dict(
            req_ids=step.req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(step.req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=connector,
        )
        if self.stage is None:
            return ModelRunnerOutput(**kwargs)
        return OmniModelRunnerOutput(**kwargs)

    def _finish(
        self, output: ModelRunnerOutput, step: ExecutedStep, *, inline: bool = False
    ) -> ModelRunnerOutput | BackgroundOutput:
        if not isinstance(output, OmniModelRunnerOutput) or not self.payloads_enabled:
            return output
        return self._finish_payloads(output, step, inline=inline)

    # ---- step-fault recovery (``worker.recovery``) -----------------------------------------

    def _log_retry(self, exc: BaseException) -> None:
        logger.warning(
            "stage %s: step fault %s; undoing and retrying the step",
            self._stage_name,
            describe(exc),
        )

    @property
    def _stage_name(self) -> str:
        return self.stage.stage_id if self.stage is not None else "?"

    def _must_isolate(self, so: SchedulerOutput) -> bool:
        """A step that schedules a request a fault was pinned on, or that runs while blocks a
        failed request never wrote may still be read, goes straight to isolation."""
        if self.poisoned:
            return True
        quarantined = self.quarantined
        return bool(quarantined) and any(rid in quarantined for rid in so.num_scheduled_tokens)

    def _execute_isolated(
        self,
        so: SchedulerOutput,
        fault: Exception | None = None,
        connector: Any = _UNCOLLECTED,
    ) -> OmniModelRunnerOutput:
        """Complete the step by running its requests in halves (``recovery.bisect``), failing
        only the requests whose faults persist and those that read KV they left unwritten.

        Without an omni stage there is no field to report a pinned fault on, so the fault
        propagates: the engine then fails every request of the step.
        """
        if self.stage is None:
            assert fault is not None
            raise fault
        journal = StepJournal(self.requests)
        try:
            self._update_states(so, journal)
        except Exception:
            # Nothing can be pinned on a request if the step's bookkeeping itself fails.
            journal.rollback()
            raise
        stage = self._stage_name
        ids = list(so.num_scheduled_tokens)
        failed: dict[str, str] = {}
        for rid in ids:
            if rid in self.quarantined:
                failed[rid] = self.quarantined[rid]
        tokens: dict[str, list[int]] = {}
        payloads: dict[str, StagePayload | None] = {}
        built = False

        def run(part: list[str]) -> None:
            nonlocal built
            mark = journal.mark()
            for rid in part:
                journal.save(self.requests[rid])
            try:
                step = self._forward(self._prepare_inputs(so, part))
                out = self._finish(self._sample_output(step, None), step, inline=True)
            except Exception:
                journal.rollback(mark)
                raise
            assert isinstance(out, OmniModelRunnerOutput)
            for rid, toks in zip(part, out.sampled_token_ids, strict=True):
                tokens[rid] = list(toks)
            if out.omni_payloads is not None:
                built = True
                payloads.update(zip(part, out.omni_payloads, strict=True))

        healthy = [rid for rid in ids if rid not in failed]
        pinned = bisect(healthy, run, self.step_retries)
        for rid, exc in pinned.items():
            failed[rid] = f"{stage}: {describe(exc)}"
        # In scheduler order, the order the step's writes and reads happened in: a failed
        # request's step positions hold no valid KV, and whoever attends to them fails with it
        # (a reader of a reader too); a healthy writer makes its fresh blocks valid again.
        for rid in ids:
            st = self.requests[rid]
            c = st.num_computed_tokens
            end = c + so.num_scheduled_tokens[rid]
            if rid not in failed:
                owner = self.poisoned.read_by(st.block_ids, c)
                if owner is None:
                    self.poisoned.rewritten(st.block_ids, c, end)
                    continue
                failed[rid] = self._reader_error(owner)
            self.poisoned.add_written(rid, st.block_ids, c, end)
        for rid, cause in failed.items():
            self.quarantined[rid] = cause
            tokens[rid] = []
            payloads[rid] = None
        if pinned or fault is not None:
            log_isolated(stage, failed, len(ids) - len(failed))
        output = OmniModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[tokens[rid] for rid in ids],
            kv_connector_output=(
                self.collect_connector_output() if connector is _UNCOLLECTED else connector
            ),
        )
        if built:
            output.omni_payloads = [payloads.get(rid) for rid in ids]
        output.omni_failed = {rid: failed[rid] for rid in ids if rid in failed} or None
        return output

    def _reader_error(self, owner: str) -> str:
        return (
            f"{self._stage_name}: attends to KV blocks that failed request {owner!r} never "
            "wrote (a prefix-cache hit scheduled before its failure was known)"
        )

    # ---- phase 1: prepare inputs ------------------------------------------------------------

    def _prepare_inputs(self, so: SchedulerOutput, part: list[str] | None = None) -> StepInputs:
        """Fill the persistent buffers for the step and say how each request is attended.

        Also records, on the request states, that the prefill conditioning is being sent and
        that a pending prefix merge is being served (both happen once per request).
        """
        # This list is "the request ids upstream bookkeeping copied": ModelRunnerOutput.req_ids
        # and every payload build reuse it (C-53). Order = scheduler order (C-20).
        # ``part``: the subset of the step that an isolating re-run executes, in scheduler order.
        req_ids = list(so.num_scheduled_tokens) if part is None else part
        num_reqs = len(req_ids)
        total = (
            so.total_num_scheduled_tokens
            if part is None
            else sum(so.num_scheduled_tokens[rid] for rid in part)
        )
        if num_reqs > self.max_num_reqs or total > self.max_num_tokens:
            self._alloc_buffers(max(num_reqs, self.max_num_reqs), max(total, self.max_num_tokens))
        bs = self.block_size
        qs, nsch, ncomp = self.query_start, self.num_scheduled, self.num_computed
        cond_rows: list[int] = []
        sample_index: list[int] = []
        decodes: list[DecodeRow] = []
        prefills: list[PrefillItem] = []
        embed_overrides: list[EmbedOverride] = []
        merges: list[PrefixMerge] = []
        off = 0
        qs[0] = 0
        for i, req_id in enumerate(req_ids):
            st = self.requests[req_id]
            n = so.num_scheduled_tokens[req_id]
            c = st.num_computed_tokens
            end = c + n
            if end > len(st.token_ids):
                raise RuntimeError(
                    f"{req_id}: scheduled positions [{c}, {end}) but the runner knows only "
                    f"{len(st.token_ids)} tokens"
                )
            self.input_ids[off : off + n] = st.token_ids[c:end]
            pos = np.arange(c, end, dtype=np.int64)
            self.positions[off : off + n] = pos
            table = st.table()
            self.slot_mapping[off : off + n] = slots_for(table, pos, bs)
            if n == 1:
                decodes.append(DecodeRow(off, end, i, table))
            else:
                ctx = np.arange(end, dtype=np.int64)
                allowed = torch.from_numpy(ctx[None, :] <= pos[:, None])
                prefills.append(
                    PrefillItem(off, off + n, torch.from_numpy(slots_for(table, ctx, bs)), allowed)
                )
            if st.prompt_embeds is not None and c < st.prompt_len:
                embed_overrides.append(EmbedOverride(off, c, st, min(end, st.prompt_len) - c))
            if end >= len(st.token_ids):
                sample_index.append(i)
            # Prefill conditioning: the row of the prompt's last position, once per request.
            cond = -1
            if self.payloads_enabled and not st.conditioning_sent and c < st.prompt_len <= end:
                cond = off + st.prompt_len - 1 - c
                st.conditioning_sent = True
                st.conditioning_output_index = len(st.token_ids) - st.prompt_len
            cond_rows.append(cond)
            if st.merge_pending:
                st.merge_pending = False
                if c > 0:
                    merges.append(PrefixMerge(i, table, c))
            qs[i + 1] = off + n
            nsch[i] = n
            ncomp[i] = c
            off += n
        return StepInputs(
            req_ids, total, sample_index, cond_rows, decodes, prefills, embed_overrides, merges
        )

    # ---- phase 2: forward -------------------------------------------------------------------

    def _forward(self, inputs: StepInputs) -> ExecutedStep:
        """Embed, run the layers over the paged KV cache, keep the hidden rows in
        ``hidden_buf`` and read the cached prefix rows a merge delivers."""
        assert self.kv is not None
        total = inputs.num_tokens
        bs = self.block_size
        slot_t = torch.from_numpy(self.slot_mapping[:total])
        decode = self._decode_group(inputs.decodes, bs) if inputs.decodes else None
        attn = StepAttention(
            self.kv,
            slot_t,
            decode,
            inputs.prefills,
            self.model.num_heads,
            self.model.num_kv_heads,
            self.model.head_dim,
        )
        ids_t = torch.from_numpy(self.input_ids[:total])
        hidden = self.model.embed(ids_t)
        for ov in inputs.embed_overrides:
            st, c, m, row = ov.state, ov.start, ov.length, ov.row
            assert st.prompt_embeds is not None
            src = st.prompt_embeds[c : c + m]
            if st.prompt_is_token_ids is None:
                hidden[row : row + m] = src
            else:
                keep = torch.tensor([not t for t in st.prompt_is_token_ids[c : c + m]])
                hidden[row : row + m][keep] = src[keep]
        pos_t = torch.from_numpy(self.positions[:total])
        out = self.model.forward_layers(hidden, pos_t, attn)
        self.hidden_buf[:total].copy_(out)
        prefix_rows: dict[int, torch.Tensor] = {}
        if self.kv.hidden is not None:
            self.kv.write_hidden(slot_t, out)
            # Read merged prefix rows only now: a prefix hit may cover blocks that another
            # request of this very step computes (vLLM allows same-step hits).
            for merge in inputs.merges:
                cached = torch.from_numpy(
                    slots_for(merge.table, np.arange(merge.cached_len, dtype=np.int64), bs)
                )
                prefix_rows[merge.req_index] = self.kv.read_hidden(cached)
        return ExecutedStep(
            inputs.req_ids, total, inputs.sample_index, inputs.conditioning_rows, prefix_rows
        )

    @staticmethod
    def _decode_group(decodes: list[DecodeRow], bs: int) -> DecodeGroup:
        lmax = max(d.context_len for d in decodes)
        ctx = np.arange(lmax, dtype=np.int64)
        slots = np.zeros((len(decodes), lmax), dtype=np.int64)
        valid = np.zeros((len(decodes), lmax), dtype=bool)
        for r, d in enumerate(decodes):
            slots[r, : d.context_len] = slots_for(d.table, ctx[: d.context_len], bs)
            valid[r, : d.context_len] = True
        rows = torch.tensor([d.row for d in decodes], dtype=torch.long)
        return DecodeGroup(rows, torch.from_numpy(slots), torch.from_numpy(valid))

    # ---- phase 3: sample --------------------------------------------------------------------

    def _sample(self, step: ExecutedStep) -> list[list[int]]:
        """Sample the requests whose chunk reached the end of their known tokens, append each
        token to its request, and return the step's sampled ids in scheduler order."""
        req_ids = step.req_ids
        sampled: list[list[int]] = [[] for _ in req_ids]
        if not step.sample_index:
            return sampled
        rows = torch.tensor(
            [int(self.query_start[i + 1]) - 1 for i in step.sample_index], dtype=torch.long
        )
        logits = self.model.logits(self.hidden_buf.index_select(0, rows))
        states = [self.requests[req_ids[i]] for i in step.sample_index]
        tokens = self.sampler.sample(
            logits,
            [s.sampling for s in states],
            [s.token_ids[: s.prompt_len] for s in states] if self._need_history(states) else [],
            [s.output_ids for s in states],
        )
        for i, st, tok in zip(step.sample_index, states, tokens, strict=True):
            st.token_ids.append(tok)
            sampled[i] = [tok]
        return sampled

    @staticmethod
    def _need_history(states: list[RequestState]) -> bool:
        return any(s.sampling.needs_logit_processing for s in states)

    # ---- phase 4: payloads -------------------------------------------------------------------

    def _finish_payloads(
        self, output: OmniModelRunnerOutput, step: ExecutedStep, *, inline: bool = False
    ) -> OmniModelRunnerOutput | BackgroundOutput:
        """Hand the step's rows to the payload builder through the materializer (C-50..C-53)."""
        has_cond = any(r >= 0 for r in step.conditioning_rows)
        if not (
            self.include_hidden
            or self.producers
            or self.postprocess is not None
            or has_cond
            or step.prefix_rows
        ):
            # C-50: nothing to deliver this step: no payload objects at all.
            return output
        num_reqs = len(step.req_ids)
        cond_index = self.conditioning_index
        cond_rows = [r for r in step.conditioning_rows if r >= 0]
        k = 0
        for i, r in enumerate(step.conditioning_rows):
            cond_index[i] = -1 if r < 0 else k
            k += r >= 0
        hidden_view = self.hidden_buf[: step.num_tokens]
        inputs = PayloadInputs(
            hidden=hidden_view if self.include_hidden else None,
            conditioning_rows=(
                self.hidden_buf.index_select(0, torch.tensor(cond_rows, dtype=torch.long))
                if cond_rows
                else None
            ),
            prefix_rows=step.prefix_rows,
            multimodal_rows=(
                {}
                if self.include_hidden
                else {name: fn(hidden_view) for name, fn in self.producers.items()}
            ),
        )
        # Inline reads these live views before returning; background snapshots them (C-53).
        plan = PayloadPlan(
            req_ids=output.req_ids,
            query_start=self.query_start[: num_reqs + 1],
            num_scheduled=self.num_scheduled[:num_reqs],
            num_computed=self.num_computed[:num_reqs],
            conditioning_index=cond_index[:num_reqs],
        )
        # An isolating re-run builds each part at once: its rows live only until the next.
        materializer = self._inline if inline else self.materializer
        return materializer.finish(output, plan, inputs)

    # ---- hooks ----------------------------------------------------------------------------

    def collect_connector_output(self) -> compat.KVConnectorOutput | None:
        """The step's connector output, collected on the calling thread once per step (C-54).

        No KV connector is configured for omni stages, so this returns None; it is the hook
        where a connector's (possibly collective) collection belongs.
        """
        return None

    def take_draft_token_ids(self) -> None:
        return None

    def shutdown(self) -> None:
        self.materializer.shutdown()
        self._pending = None
