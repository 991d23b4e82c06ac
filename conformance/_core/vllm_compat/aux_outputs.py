"""Auxiliary outputs a model runner returns beside its tokens: sampling masks and routed experts.

Owns, per release, how they are switched on (``model_config_kw``, ``vllm_config_kw``, the
runner flavour vLLM demands for them: ``needs_v2_runner``, ``runner_flavour``), what the runner
hands the scheduler (``AuxRunner``: a ``SamplingMaskLists`` with one mask per scheduled request,
and routed experts as ``RoutedExpertsLists`` rows keyed by KV slot on 0.28-0.30, or from 0.31 as
the aux-output connector's worker half answers the metadata its scheduler half sends), and how an output's ``new_sampling_mask`` and ``routed_experts`` read as plain values
(``aux_output_fields``). Masks and routing are pure functions of (request id, position), so two
schedulers that schedule the same work get the same runner outputs.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from conformance._core.vllm_compat.versions import ByRelease, Change

# How the scheduler receives routed experts: "slots" (the runner returns rows with their KV-cache
# slots and the scheduler's RoutedExpertsManager keeps them) or "connector" (the scheduler's
# aux-output connector tells the worker which requests to emit from where; the worker returns
# each emitting request's rows from its emit cursor, which ``AuxRunner`` stands in for).
ROUTED_EXPERTS_PATH: ByRelease[str] = ByRelease(
    "routed experts path",
    "slots",
    [
        Change(
            "0.31.0",
            "connector",
            "routed experts move from ModelConfig and RoutedExpertsManager to the aux-output "
            "connector (AuxOutputConfig, Model Runner V2 only)",
        )
    ],
)
ROUTED_EXPERTS_UNAVAILABLE = (
    "routed experts reach the scheduler through the aux-output connector from 0.31, which "
    "vLLM allows only with Model Runner V2, refused on this release without a usable Triton "
    "(vllm.triton_utils.HAS_TRITON is false here)"
)
HIT_CAPPING_UNAVAILABLE = (
    "routed experts cap prefix and external hits (the aux-output connector's max_cache_hit, "
    "cap_external_hit) from 0.31; before, the routed-experts axis covers them"
)

# Whether the release can return sampling masks at all.
SAMPLING_MASKS: ByRelease[bool] = ByRelease(
    "sampling masks",
    False,
    [
        Change(
            "0.28.0",
            True,
            "ModelConfig.return_sampling_mask, ModelRunnerOutput.sampling_masks and "
            "EngineCoreOutput.new_sampling_mask added",
        )
    ],
)
NO_SAMPLING_MASKS = (
    "this release has no sampling masks (ModelConfig.return_sampling_mask and "
    "EngineCoreOutput.new_sampling_mask are new in 0.28)"
)

# Before 0.33 vLLM refuses Model Runner V2 (so sampling masks) where Triton is missing.
V2_RUNNER_NEEDS_TRITON: ByRelease[bool] = ByRelease(
    "Model Runner V2 needs Triton",
    True,
    [Change("0.33.0", False, "VLLM_USE_V2_MODEL_RUNNER=1 builds the V2 runner without Triton")],
)
SAMPLING_MASKS_UNAVAILABLE = (
    "vLLM returns sampling masks only with Model Runner V2, which this release refuses "
    "without a usable Triton (vllm.triton_utils.HAS_TRITON is false here: Triton missing, or "
    "no active GPU driver)"
)


def aux_axis_unavailable(name: str) -> str | None:
    """Why the installed release cannot run the auxiliary-output axis ``name`` (None: it can,
    or it is another axis)."""
    if name == "routed-experts-hybrid-connector" and ROUTED_EXPERTS_PATH.value() == "slots":
        return HIT_CAPPING_UNAVAILABLE
    if name == "sampling-masks" and not SAMPLING_MASKS.value():
        return NO_SAMPLING_MASKS
    if name.startswith("routed-experts"):
        v2 = ROUTED_EXPERTS_PATH.value() == "connector"
        why = ROUTED_EXPERTS_UNAVAILABLE
    else:
        v2 = name == "sampling-masks"
        why = SAMPLING_MASKS_UNAVAILABLE
    if v2 and v2_scheduler_unavailable() is not None:
        return why
    return None


V2_SCHEDULER_UNAVAILABLE = (
    "the axis builds its scheduler for Model Runner V2, which this release refuses without a "
    "usable Triton (vllm.triton_utils.HAS_TRITON is false here)"
)


def v2_scheduler_unavailable() -> str | None:
    """Why the installed release cannot build a scheduler for Model Runner V2 here (None: it
    can)."""
    if V2_RUNNER_NEEDS_TRITON.value():
        from vllm.triton_utils import HAS_TRITON

        if not HAS_TRITON:
            return V2_SCHEDULER_UNAVAILABLE
    return None


# Whether an EAGLE head's block hashes cover the drafter's read-ahead instead of each hit
# dropping its last block (``SpeculativeConfig.disable_lookahead_block_hashes`` selects the drop).
LOOKAHEAD_HASHES: ByRelease[bool] = ByRelease(
    "EAGLE lookahead block hashes",
    False,
    [Change("0.33.0", True, "num_hash_lookahead_tokens: hashes prove the boundary token")],
)


# A mask keeps the sampled token and up to MASK_EXTRA others (a nucleus of 1-4 ids).
MASK_EXTRA = 3


def model_config_kw(sampling_masks: bool, routed_experts: bool) -> dict[str, Any]:
    """``ModelConfig`` arguments for the two outputs (none when both are off)."""
    kw: dict[str, Any] = {}
    if sampling_masks:
        # vLLM replays sampling only over processed logprobs (the mask's own nucleus).
        kw["return_sampling_mask"] = True
        kw["logprobs_mode"] = "processed_logprobs"
    if routed_experts and ROUTED_EXPERTS_PATH.value() == "slots":
        kw["enable_return_routed_experts"] = True
    return kw


def vllm_config_kw(routed_experts: bool) -> dict[str, Any]:
    """``VllmConfig`` arguments for routed experts on the connector path (as
    ``--enable-return-routed-experts`` sets ``AuxOutputConfig``; none otherwise)."""
    if not routed_experts or ROUTED_EXPERTS_PATH.value() != "connector":
        return {}
    from vllm.config import AuxOutputConfig  # from 0.31

    return {"aux_output_config": AuxOutputConfig(enable_return_routed_experts=True)}


def needs_v2_runner(sampling_masks: bool, routed_experts: bool = False) -> bool:
    """Whether vLLM accepts the configuration only with Model Runner V2: sampling masks are
    "sampling distribution replay", which every supported release refuses on the V1 runner,
    and the aux-output connector (routed experts from 0.31) is wired to V2 only."""
    return sampling_masks or (routed_experts and ROUTED_EXPERTS_PATH.value() == "connector")


def v2_runner_on() -> bool:
    """Whether vLLM would build for the V2 model runner now (``runner_flavour`` holds it)."""
    return os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "") in ("1", "true", "True")


@contextmanager
def runner_flavour(v2: bool) -> Iterator[None]:
    """Build a ``VllmConfig`` and its scheduler for the V2 model runner when ``v2``.

    The harness pins the V1 runner process-wide (``conformance._core.config``); vLLM reads the
    switch when it validates a ``VllmConfig`` and when a scheduler is built (which keeps its
    own copy), so holding the V2 setting over both gives a V2-flavoured scheduler without
    touching the others in the process."""
    if not v2:
        yield
        return
    import vllm.envs as envs

    if envs._is_envs_cache_enabled() and not envs.VLLM_USE_V2_MODEL_RUNNER:
        raise RuntimeError(
            "this configuration needs vLLM's Model Runner V2, but the process froze vLLM's "
            "environment with the V1 runner (an engine started here): run it in a fresh process"
        )
    key = "VLLM_USE_V2_MODEL_RUNNER"
    before = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[key]
        else:
            os.environ[key] = before


# Where the number of experts a token is routed to is read: "hf_config" (the routed-experts
# capturer's own reader of the Hugging Face config) or "model_config" (``ModelConfig``).
EXPERTS_PER_TOKEN: ByRelease[str] = ByRelease(
    "experts per token",
    "hf_config",
    [
        Change(
            "0.28.0",
            "model_config",
            "ModelConfig.get_num_experts_per_tok added (the capturer's hf_config reader gone)",
        )
    ],
)


def routed_experts_shape(model_config: Any) -> tuple[int, int, int]:
    """(layers, experts, experts per token) of a mixture-of-experts model."""
    if EXPERTS_PER_TOKEN.value() == "model_config":
        per_token = model_config.get_num_experts_per_tok()
    else:
        from vllm.model_executor.layers.fused_moe import routed_experts_capturer

        reader = routed_experts_capturer._get_num_experts_per_tok  # type: ignore[attr-defined]
        per_token = reader(model_config.hf_config)
    return (
        int(model_config.get_total_num_hidden_layers()),
        int(model_config.get_num_experts()),
        int(per_token),
    )


def _h(*parts: object) -> int:
    return zlib.crc32(":".join(map(str, parts)).encode())


class AuxRunner:
    """A runner's auxiliary outputs for one ``SchedulerOutput``, as ``ModelRunnerOutput``
    fields: a sampling mask per scheduled request (``sampling_masks``) and routed experts for
    every scheduled token (``routed_experts``). It keeps each request's KV block table from
    the scheduler outputs it sees, as a worker does, to name the slot of each token."""

    def __init__(
        self,
        *,
        vocab: int,
        block_size: int,
        sampling_masks: bool = False,
        routed: tuple[int, int, int] | None = None,
    ) -> None:
        self.vocab = vocab
        self.block_size = block_size
        self.sampling_masks = sampling_masks
        self.routed = routed
        self._blocks: dict[str, list[int]] = {}
        # Connector path: the worker half's per-request cursors (next position to emit, end
        # of what it captured) and the metadata generation they belong to.
        self._emit: dict[str, int] = {}
        self._captured: dict[str, int] = {}
        self._generation = 0

    def mask(self, request_id: str, position: int, sampled: int | None) -> list[int]:
        """The ids sampling kept at ``position``: the sampled one (when there is one) and up to
        ``MASK_EXTRA`` others, sorted."""
        h = _h("mask", request_id, position)
        ids = {(h >> (8 * k)) % self.vocab for k in range(h % (MASK_EXTRA + 1))}
        if sampled is not None:
            ids.add(sampled)
        return sorted(ids)

    def routing(self, request_id: str, start: int, stop: int) -> np.ndarray:
        """Experts per token for positions ``start..stop``: (tokens, layers, experts per token),
        each token's experts distinct within a layer."""
        assert self.routed is not None
        layers, experts, top_k = self.routed
        base = np.array([_h("route", request_id, p) for p in range(start, stop)], dtype=np.int64)
        layer = np.arange(layers, dtype=np.int64)[None, :, None]
        k = np.arange(top_k, dtype=np.int64)[None, None, :]
        first = (base[:, None, None] >> (3 * layer)) % experts
        return ((first + k) % experts).astype(np.int32)

    def _track_blocks(self, so: Any) -> None:
        from conformance._core.vllm_compat.scheduler_output import resumed_ids

        for rid in so.finished_req_ids:
            self._blocks.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self._blocks[new.req_id] = list(new.block_ids[0])
        resumed = resumed_ids(so)
        cached = so.scheduled_cached_reqs
        for rid, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if rid in resumed:  # a resumed request's table is replaced, not extended
                self._blocks[rid] = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                self._blocks.setdefault(rid, []).extend(new_ids[0])

    def outputs(
        self,
        so: Any,
        req_ids: list[str],
        computed: dict[str, int],
        sampled: list[list[int]],
    ) -> dict[str, Any]:
        """The ``ModelRunnerOutput`` fields for the step (``req_ids`` in the runner's order,
        ``computed`` each one's positions before it, ``sampled`` what each sampled)."""
        from conformance._core.vllm_compat.scheduler_output import scheduled_drafts

        kw: dict[str, Any] = {}
        drafts = scheduled_drafts(so)
        if self.sampling_masks:
            from vllm.v1.outputs import SamplingMaskLists

            # One position per request (vLLM pairs masks only with plain decoding before 0.32):
            # the position the step samples at, partial prefill chunks included.
            rows = []
            for rid, ids in zip(req_ids, sampled, strict=True):
                position = computed.get(rid, 0) + so.num_scheduled_tokens[rid]
                position -= len(drafts.get(rid, ()))
                rows.append(self.mask(rid, position, ids[0] if ids else None))
            offsets = np.cumsum([0, *map(len, rows)], dtype=np.int64)
            flat = np.array([t for row in rows for t in row], dtype=np.int32)
            kw["sampling_masks"] = SamplingMaskLists(flat, offsets, None)
        if self.routed is not None and ROUTED_EXPERTS_PATH.value() == "connector":
            kw["aux_output_connector_output"] = self._connector_output(
                so, req_ids, computed, sampled, drafts
            )
        elif self.routed is not None:
            # 0.28-0.30 only (ROUTED_EXPERTS_PATH "slots"); the installed release may lack it.
            from vllm.v1.outputs import RoutedExpertsLists  # type: ignore[attr-defined]

            self._track_blocks(so)
            layers, _, top_k = self.routed
            bs = self.block_size
            data, slots = [], []
            for rid in req_ids:
                start = computed.get(rid, 0)
                stop = start + so.num_scheduled_tokens[rid]
                table = np.asarray(self._blocks.get(rid, ()), dtype=np.int64)
                positions = np.arange(start, stop, dtype=np.int64)
                slots.append(table[positions // bs] * bs + positions % bs)
                data.append(self.routing(rid, start, stop))
            kw["routed_experts"] = RoutedExpertsLists(
                np.concatenate(data) if data else np.zeros((0, layers, top_k), np.int32),
                np.concatenate(slots) if slots else np.zeros(0, np.int64),
            )
        return kw

    def _connector_output(
        self,
        so: Any,
        req_ids: list[str],
        computed: dict[str, int],
        sampled: list[list[int]],
        drafts: dict[str, Any],
    ) -> dict[str, Any] | None:
        """The aux-output connector's worker half for one step, from the metadata the
        scheduler's connector attached: requests start at the emit position it names (kept
        across preemption, dropped when it reports them finished or starts a new generation),
        and a request that sampled gets its rows from its emit cursor to the end of the
        tokens it now holds (rejected drafts excluded). Rows are ``routing`` of (request id,
        position), so a prefix-cached token's rows are as if stored by block hash."""
        meta = getattr(so, "aux_output_connector_metadata", None)
        if meta is None:
            return None  # a scheduler without the connector asks for none
        from vllm.distributed.aux_output_connector.connector import AuxRequestOutput  # 0.31+

        if meta.generation > self._generation:  # a prefix-cache reset: start afresh
            self._emit.clear()
            self._captured.clear()
            self._generation = meta.generation
        for rid, emit_start in meta.requests.items():
            self._emit.setdefault(rid, emit_start)
        for rid in meta.finished_requests:
            self._emit.pop(rid, None)
            self._captured.pop(rid, None)
        assert self.routed is not None
        _, experts, _ = self.routed
        dtype = np.uint8 if experts <= 256 else np.uint16  # as vLLM's capturer stores them
        out: dict[str, Any] = {}
        for rid, ids in zip(req_ids, sampled, strict=True):
            num = so.num_scheduled_tokens[rid]
            rejected = len(drafts.get(rid, ())) + 1 - len(ids) if ids else 0
            # The runner captures from where it really is: after an optimistic (async) step
            # whose drafts were rejected, that is behind the scheduler's count.
            start = computed.get(rid, 0)
            start = min(start, self._captured.get(rid, start))
            end = start + num - rejected
            self._captured[rid] = end
            emit = self._emit.get(rid, start)
            if ids and emit <= end:
                rows = self.routing(rid, emit, end).astype(dtype)
                out[rid] = AuxRequestOutput(emit, rows)
                self._emit[rid] = end
        return out


def aux_runner(vllm_config: Any, vocab: int) -> AuxRunner | None:
    """The auxiliary outputs ``vllm_config`` asks a runner for (None: neither)."""
    model_config = vllm_config.model_config
    masks = SAMPLING_MASKS.value() and bool(model_config.return_sampling_mask)
    routed = bool(getattr(model_config, "enable_return_routed_experts", False))
    aux_config = getattr(vllm_config, "aux_output_config", None)  # the connector path, 0.31+
    routed = routed or bool(aux_config is not None and aux_config.enabled)
    if not masks and not routed:
        return None
    return AuxRunner(
        vocab=vocab,
        block_size=vllm_config.cache_config.block_size,
        sampling_masks=masks,
        routed=routed_experts_shape(model_config) if routed else None,
    )


def _digest(array: np.ndarray) -> str:
    """An array as its shape and a checksum of its values (a prompt's routing is long)."""
    values = np.ascontiguousarray(array, dtype=np.int64)
    shape = "x".join(map(str, values.shape))
    return f"{shape}:{zlib.crc32(values.tobytes()):08x}"


def aux_output_fields(out: Any) -> dict[str, Any]:
    """An ``EngineCoreOutput``'s sampling mask (ids per position) and routed experts (shape
    and checksum), each only when set, so outputs without them read as before."""
    fields: dict[str, Any] = {}
    mask = out.new_sampling_mask if SAMPLING_MASKS.value() else None
    if mask is not None:
        fields["sampling_mask"] = [tuple(row) for row in mask.to_nested_list()]
    routed = out.routed_experts
    if routed is not None:
        fields["routed_experts"] = _digest(np.asarray(routed))
    return fields


def same_aux_outputs(a: Any, b: Any) -> bool:
    """Whether ``aux_output_fields`` of two outputs would be equal."""
    if a.routed_experts is None and b.routed_experts is None:
        if not SAMPLING_MASKS.value():
            return True
        if a.new_sampling_mask is None and b.new_sampling_mask is None:
            return True
    return aux_output_fields(a) == aux_output_fields(b)
