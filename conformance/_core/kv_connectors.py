"""KV connectors as scheduler axes: the ``KVTransferConfig`` a ``HarnessConfig`` selects, and the
worker half the harness stands in for.

``HarnessConfig.kv_connector`` names a connector registered with vLLM's ``KVConnectorFactory``
(vLLM's ``ExampleConnector`` and ``OffloadingConnector``, or the harness's own, ``HARNESS``,
registered here); ``kv_transfer_kw`` turns it into the ``VllmConfig`` argument, so each
scheduler builds its own connector instance, identical on both sides. The scheduler side of a
connector reports to the scheduler only through a step's ``KVConnectorOutput``, which a worker
fills; ``WorkerStandIn`` (held by the token source) fills it from the step's
``kv_connector_metadata`` alone, which both sides build identically: the harness connector's
own report, the offloading connector's jobs finished (loads at once, stores a step after they
were issued, as its worker submits them), nothing for the example connector. It also drops
output tokens the scheduler discarded after a failed synchronous load, as vLLM's runner does.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from conformance._core import vllm_compat as vc

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput


class ConnectorFields(Protocol):
    """The ``HarnessConfig`` fields read here (``config`` imports this module, not the reverse)."""

    @property
    def kv_connector(self) -> str: ...
    @property
    def kv_role(self) -> str: ...
    @property
    def kv_load_failure_policy(self) -> str: ...
    @property
    def kv_connector_extra(self) -> Mapping[str, Any]: ...


# The harness's own connector (``conformance._core.harness_connector``) as vLLM's factory knows it.
HARNESS = "OmniConformanceHarnessConnector"
# The same for hybrid KV-cache layouts (``HarnessConfig.kv_layout``): it supports vLLM's hybrid
# KV-cache manager, which vLLM turns off for a connector that does not.
HARNESS_HYBRID = "OmniConformanceHybridHarnessConnector"
# Fixed, so nothing a connector derives from it (keys, events) differs between the two sides.
ENGINE_ID = "omni-conformance"

# Extra configuration a connector needs on this machine, under the axis's own. The example
# connector looks up prompts in a folder nothing ever writes to (the harness runs no worker to
# save KV), so it never hits, on either side.
_MACHINE_EXTRA: dict[str, dict[str, Any]] = {
    "ExampleConnector": {
        "shared_storage_path": os.path.join(tempfile.gettempdir(), "omni-conformance-no-kv")
    },
}

_registered = False


def register_harness_connector() -> None:
    """Make ``HARNESS`` known to vLLM's connector factory (once per process)."""
    global _registered
    if _registered:
        return
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name, cls in ((HARNESS, "HarnessConnector"), (HARNESS_HYBRID, "HybridHarnessConnector")):
        try:
            KVConnectorFactory.register_connector(name, "conformance._core.harness_connector", cls)
        except ValueError:  # registered by an earlier import of this module (a reload)
            pass
    _registered = True


def kv_transfer_kw(cfg: ConnectorFields) -> dict[str, Any]:
    """``VllmConfig`` arguments for ``cfg``'s KV connector (none when it names none)."""
    if not cfg.kv_connector:
        return {}
    from vllm.config import KVTransferConfig

    if cfg.kv_connector in (HARNESS, HARNESS_HYBRID):
        register_harness_connector()
    extra = {**_MACHINE_EXTRA.get(cfg.kv_connector, {}), **cfg.kv_connector_extra}
    return {
        "kv_transfer_config": KVTransferConfig(
            kv_connector=cfg.kv_connector,
            kv_role=cfg.kv_role,  # type: ignore[arg-type]  # checked by KVTransferConfig
            kv_load_failure_policy=cfg.kv_load_failure_policy,  # type: ignore[arg-type]
            kv_connector_extra_config=extra,
            engine_id=ENGINE_ID,
        )
    }


class WorkerStandIn:
    """The worker side of the configured KV connector, for the harness's token source."""

    def __init__(self) -> None:
        self._prompt_len: dict[str, int] = {}
        # Offloading stores issued by the last step: its worker submits them with the next one.
        self._stores: set[int] = set()

    def step(self, so: SchedulerOutput, views: dict[str, Any]) -> KVConnectorOutput | None:
        """The step's ``KVConnectorOutput``; first aligns ``views`` (the token source's requests,
        each with ``num_tokens``) with outputs the scheduler discarded."""
        meta = so.kv_connector_metadata
        if meta is None:
            return None
        for rid in so.finished_req_ids:
            self._prompt_len.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self._prompt_len[new.req_id] = vc.prompt_length(new)
        cached = so.scheduled_cached_reqs
        resumed = vc.resumed_ids(so)
        for rid, num_out in zip(cached.req_ids, cached.num_output_tokens, strict=True):
            view, prompt = views.get(rid), self._prompt_len.get(rid)
            if view is not None and prompt is not None and rid not in resumed:
                # A failed synchronous load discards the step's sampled tokens: the runner
                # trims what it holds to what the scheduler counts.
                view.num_tokens = min(view.num_tokens, prompt + num_out)
        return self._report(meta)

    def _report(self, meta: Any) -> KVConnectorOutput | None:
        from vllm.v1.outputs import KVConnectorOutput

        report = getattr(meta, "worker_report", None)
        if report is not None:  # the harness connector says what its worker reports
            fields = report()
            return None if fields is None else KVConnectorOutput(**fields)
        hisparse = vc.hisparse_worker_meta(meta)
        if hisparse is not None:
            return KVConnectorOutput(kv_connector_worker_meta=hisparse)
        jobs = vc.offload_jobs(meta)
        if jobs is None:  # the example connector: loads and saves are the worker's own affair
            return None
        done = set(self._stores) | set(jobs.loads) | (jobs.stores & jobs.flush)
        self._stores = set(jobs.stores - jobs.flush)
        recving = {rid for rid, sync in jobs.loads.values() if not sync}
        worker_meta = vc.offload_worker_meta(done)
        if worker_meta is None and not recving:
            return None
        return KVConnectorOutput(
            finished_recving=recving or None, kv_connector_worker_meta=worker_meta
        )


# The harness connector's per-request draws (``AddRequest.kv_transfer_params``; keys:
# ``harness_connector.Plan``): no parameters first (the shrinker's simplest), then a sync hit,
# a sync hit whose second block fails, async hits (one a P/D consumer's), async loads that fail
# at their second block (the first is kept) or as a whole, a lookup that needs a step, and
# delayed frees.
HARNESS_PLANS: tuple[tuple[tuple[str, Any], ...] | None, ...] = (
    None,
    (("hit_blocks", 1),),
    (("hit_blocks", 2), ("fail", 1)),
    (("hit_blocks", 2), ("load", "async"), ("load_steps", 1), ("do_remote_prefill", True)),
    (("hit_blocks", 3), ("load", "async")),
    (("hit_blocks", 2), ("load", "async"), ("load_steps", 2), ("fail", 1)),
    (("hit_blocks", 1), ("load", "async"), ("fail", "request")),
    (("hit_blocks", 1), ("lookup_steps", 1), ("send_steps", 0)),
    (("send_steps", 2),),
)
# The hybrid connector's draws: vLLM refuses block-level load failures with several KV-cache
# groups (a failed load fails the request as a whole), so the plans failing one block are left out.
HARNESS_HYBRID_PLANS: tuple[tuple[tuple[str, Any], ...] | None, ...] = tuple(
    plan
    for plan in HARNESS_PLANS
    if not any(key == "fail" and isinstance(value, int) for key, value in plan or ())
)
# The hybrid connector's draws under block pressure: no synchronous external hit (0.33 admits one
# whose Mamba group then cannot allocate, "Cannot get 1 free blocks", on both sides alike) and no
# failed load, so completed async hits, local hits and delayed frees compete for a small pool.
HARNESS_HYBRID_PRESSURE_PLANS: tuple[tuple[tuple[str, Any], ...] | None, ...] = tuple(
    plan
    for plan in HARNESS_HYBRID_PLANS
    if plan is None
    or (
        not any(key == "fail" for key, _ in plan)
        and (dict(plan).get("load") == "async" or "hit_blocks" not in dict(plan))
    )
)
