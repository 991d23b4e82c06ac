"""The harness's own KV connector, written on vLLM's public ``KVConnectorBase_V1``.

vLLM's shipped connectors reach no external hit, load failure or delayed free on a CPU-only
machine; this one does, deterministically. What it does for a request is a pure function of the
request's ``kv_transfer_params`` (drawn per request by the connector axes, ``Plan``), its token
counts and the connector's step count (one per ``build_connector_meta``), so two schedulers that
make the same calls get the same answers. It models a remote store holding the first
``hit_blocks`` blocks of each prompt: hits loaded synchronously or asynchronously, the first
load of a request failing at a drawn block (or as a whole), and frees delayed after a request
finishes while the KV is "sent". No worker runs: each step's ``HarnessConnectorMetadata`` says
what the worker side reports in that step's output, and the token source echoes it
(``conformance._core.kv_connectors.WorkerStandIn``). Its scheduler-side state (loads in flight,
pending sends) is published as its connector statistics, so sides compare it with ``log_stats``.
``HybridHarnessConnector`` is the same store for hybrid layouts (several KV-cache groups).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.request import RequestStatus

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# A request that finished this way may hand its KV off (a producer's delayed free); an abort,
# an error or a load still in flight never does, as vLLM's P/D connectors behave.
_SENDS_AFTER = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


@dataclass(frozen=True)
class Plan:
    """What the remote store does for one request (``kv_transfer_params`` keys, all optional)."""

    # Prompt blocks the remote store holds (a hit is what lies past the local prefix hit).
    hit_blocks: int = 0
    # "sync": loaded within the step that schedules the request; "async": the request waits
    # (WAITING_FOR_REMOTE_KVS) until the load is reported, ``load_steps`` steps later.
    load: str = "sync"
    load_steps: int = 0
    # The first load of the request fails: an int is the index, among the loaded blocks, of the
    # block reported invalid; "request" reports the whole receive failed (async loads only).
    fail: int | str | None = None
    # Finishing (stopped or length-capped) hands the KV off: blocks stay held until the send is
    # reported, ``send_steps`` steps later. None: freed at once.
    send_steps: int | None = None
    # The store cannot say how much it holds until this many steps after arrival (the scheduler
    # is told None and asks again).
    lookup_steps: int = 0

    @classmethod
    def of(cls, params: Mapping[str, Any] | None) -> Plan | None:
        if not params:
            return None
        known = {k: params[k] for k in cls.__dataclass_fields__ if k in params}
        return cls(**known)


@dataclass
class _Load:
    blocks: tuple[int, ...]  # the blocks the load writes
    due: int  # the step whose output reports it (async)
    bad_block: int | None
    failed: bool  # the whole receive fails ("request")


@dataclass
class HarnessConnectorMetadata(KVConnectorMetadata):
    """One step's instructions to the worker side, and what that side reports back for it."""

    step: int
    loads: dict[str, tuple[int, ...]] = field(default_factory=dict)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    finished_sending: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)

    def worker_report(self) -> dict[str, Any] | None:
        """The ``KVConnectorOutput`` fields a worker returns for this step (None: nothing)."""
        if not (self.finished_recving or self.finished_sending or self.invalid_block_ids):
            return None
        fields: dict[str, Any] = {
            "finished_sending": set(self.finished_sending) or None,
            "finished_recving": set(self.finished_recving) or None,
            "invalid_block_ids": set(self.invalid_block_ids),
        }
        if self.failed_recving:  # request-level failures: set only when there are some
            fields["failed_recving"] = set(self.failed_recving)
        return fields


@dataclass
class HarnessConnectorStats(KVConnectorStats):
    """Counts since the last report, and the requests the connector holds state for."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = dict(self.data)
        for key, value in other.data.items():
            if isinstance(value, int) and isinstance(merged.get(key), int):
                merged[key] += value
            else:
                merged[key] = value
        return HarnessConnectorStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if isinstance(v, int)}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class HarnessConnector(KVConnectorBase_V1):
    """The scheduler side of the harness's remote store; see the module docstring."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        # Set by ``shutdown``: the harness compares whether the scheduler's shutdown reached it.
        self.shut_down = False
        self._step = 0
        self._arrived: dict[str, int] = {}
        # The local hit the scheduler last asked about: the loaded blocks start there.
        self._local: dict[str, int] = {}
        self._failed_once: set[str] = set()
        # The preemption count at each request's last load: the store serves a request once per
        # admission (a P/D connector marks a remote prefill consumed once it is read), so what a
        # failed load lost is recomputed locally, and a one-token prompt whose load completed
        # (the scheduler recomputes its last token from zero) is not loaded again.
        self._loaded: dict[str, int] = {}
        self._sync_loads: dict[str, _Load] = {}
        self._async_loads: dict[str, _Load] = {}
        self._new_async: list[str] = []
        self._sending: dict[str, int] = {}
        # Reported to the worker side, not yet back in an output the scheduler processed.
        self._recv_reported: set[str] = set()
        self._send_reported: set[str] = set()
        self._counts: dict[str, int] = {}
        # The KV-cache group the store loads into: the first full-attention group (the only
        # group, or a hybrid model's dense one, whose blocks cover every prompt token).
        self._load_group = _full_attention_group(kv_cache_config)
        extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {}
        # Whether the store also holds a hybrid model's recurrent (Mamba) state, so that an
        # external hit may complete a local hit whose full-attention part ran deeper.
        self._divergent_hits = bool(extra.get("divergent_hybrid_hits", False))

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self._divergent_hits

    # ---- scheduler side -----------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        self._arrived[request.request_id] = self._step

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        plan = Plan.of(request.kv_transfer_params)
        if plan is None:
            return 0, False
        if self._step < self._arrived.get(rid, 0) + plan.lookup_steps:
            return None, False
        if self._loaded.get(rid) == request.num_preemptions:
            return 0, False
        # A synchronous load must leave the scheduler a token to compute; an asynchronous one
        # may cover the whole prompt (the scheduler recomputes its last token).
        prompt = request.num_prompt_tokens - (plan.load != "async")
        held = min(plan.hit_blocks * self._block_size, max(prompt, 0))
        self._local[rid] = num_computed_tokens
        external = max(0, held - num_computed_tokens)
        return external, external > 0 and plan.load == "async"

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        rid = request.request_id
        plan = Plan.of(request.kv_transfer_params) or Plan()
        ids = blocks.get_block_ids()[self._load_group]
        first = self._local.get(rid, 0) // self._block_size
        last = (self._local.get(rid, 0) + num_external_tokens - 1) // self._block_size
        loaded = tuple(ids[first : last + 1])
        failing = plan.fail is not None and rid not in self._failed_once
        if failing:
            self._failed_once.add(rid)
        self._loaded[rid] = request.num_preemptions
        bad = None
        if failing and isinstance(plan.fail, int) and loaded:
            bad = loaded[min(plan.fail, len(loaded) - 1)]
        is_async = plan.load == "async"
        load = _Load(
            loaded,
            due=self._step + 1 + plan.load_steps,
            bad_block=bad,
            failed=failing and plan.fail == "request" and is_async,
        )
        if is_async:
            self._async_loads[rid] = load
            self._new_async.append(rid)
            self._count("async_loads")
        else:
            self._sync_loads[rid] = load
            self._count("sync_loads")

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._step += 1
        meta = HarnessConnectorMetadata(step=self._step)
        for rid, load in self._sync_loads.items():
            meta.loads[rid] = load.blocks
            if load.bad_block is not None:
                meta.invalid_block_ids.add(load.bad_block)
                self._count("failed_blocks")
        self._sync_loads.clear()
        for rid in self._new_async:
            if rid in self._async_loads:
                meta.loads[rid] = self._async_loads[rid].blocks
        self._new_async.clear()
        for rid, load in list(self._async_loads.items()):
            if load.due > self._step:
                continue
            del self._async_loads[rid]
            meta.finished_recving.add(rid)
            self._recv_reported.add(rid)
            if load.bad_block is not None:
                meta.invalid_block_ids.add(load.bad_block)
                self._count("failed_blocks")
            if load.failed:
                meta.failed_recving.add(rid)
                self._count("failed_requests")
        for rid, due in list(self._sending.items()):
            if due <= self._step:
                del self._sending[rid]
                meta.finished_sending.add(rid)
                self._send_reported.add(rid)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._recv_reported.difference_update(connector_output.finished_recving or ())
        self._send_reported.difference_update(connector_output.finished_sending or ())

    def shutdown(self) -> None:
        self.shut_down = True
        super().shutdown()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        plan = Plan.of(request.kv_transfer_params)
        self._arrived.pop(rid, None)
        self._local.pop(rid, None)
        self._failed_once.discard(rid)
        self._loaded.pop(rid, None)
        self._sync_loads.pop(rid, None)
        if plan is None:
            return False, None
        loading = rid in self._async_loads or rid in self._recv_reported
        delay = plan.send_steps is not None and request.status in _SENDS_AFTER and not loading
        if delay:
            assert plan.send_steps is not None
            self._sending[rid] = self._step + 1 + plan.send_steps
            self._count("delayed_frees")
        # What the client sent, and what a P/D producer adds: how much KV is to be read, and
        # whether it is still being sent (the scheduler adds its own keys to these).
        params = dict(request.kv_transfer_params or {})
        params.update(remote_blocks=len(block_ids), remote_send=delay)
        return delay, params

    def has_pending_block_frees(self) -> bool:
        return bool(self._sending or self._send_reported)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data: dict[str, Any] = dict(self._counts)
        self._counts = {}
        data["loading"] = sorted(set(self._async_loads) | self._recv_reported)
        data["sending"] = sorted(set(self._sending) | self._send_reported)
        stats = HarnessConnectorStats(data=data)
        return None if stats.is_empty() else stats

    def _count(self, key: str) -> None:
        self._counts[key] = self._counts.get(key, 0) + 1

    # ---- worker side: never runs in the harness (no worker) ----------------------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


class HybridHarnessConnector(HarnessConnector, SupportsHMA):
    """The harness connector for hybrid KV-cache layouts (several KV-cache groups): vLLM keeps
    its hybrid KV-cache manager on only with a connector that supports it, and then hands a
    finished request's blocks of every group. The store sends what the full-attention group
    holds, as the single-group connector sends its one group."""

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[self._load_group])

    def register_finished_partial_tail(
        self,
        request: Request,
        block_ids: tuple[list[int], ...],
        partial_tail_offloads: list[tuple[int, int, int]],
    ) -> bool:
        # A kv_producer is handed a finished request's Mamba state at the prompt's sub-block
        # checkpoint (0.33). The store takes no copy of it (no worker), so the blocks are freed
        # at once; counting what it was handed, per group and boundary, makes a tail vLLM
        # drops, or hands from another block, a difference in the connector's statistics.
        for group, _block, boundary in partial_tail_offloads:
            self._count(f"partial_tails_g{group}_at{boundary}")
        return False


def _full_attention_group(kv_cache_config: KVCacheConfig | None) -> int:
    """Index of the first full-attention KV-cache group (0 when there is none or one group)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else ()
    for i, group in enumerate(groups):
        if isinstance(group.kv_cache_spec, FullAttentionSpec):
            return i
    return 0
