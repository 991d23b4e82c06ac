"""The KV-connector axes: configuration, per-request parameters, and that each connector path
the axes claim is really taken (on upstream's scheduler, driven as the lock-step drives it).

The harness connector's scenarios check the scheduler's side of each behaviour: a request
waiting for remote KV until its load is reported, a free delayed until a send is reported, a
failed load recomputed or failed by policy; the offloading connector's, a hit after a prefix-cache
reset, served by the worker stand-in's reports. The axes themselves (both sides compared) run in
``invariants/test_scheduler_axes.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from conformance._core import vllm_compat as vc
from conformance._core.axes import AXES, axis
from conformance._core.config import HarnessConfig, build_scheduler, build_vllm_config
from conformance._core.kv_connectors import ENGINE_ID, HARNESS
from conformance._core.machine import TIGHT
from conformance._core.sides import Side, make_side
from conformance._core.subjects import BaseSubject, make_sampling_params
from conformance._core.workload import AddRequest, ResetPrefixCache, Step, op_from_dict, op_to_dict

KV_AXES = [a for a in AXES if a.name.startswith("kv-")]
PROMPT = tuple(100 + i for i in range(40))


def _config(name: str, mode: str = "sync", **over: Any) -> HarnessConfig:
    return axis(name).config(TIGHT.with_(async_scheduling=mode == "async", **over))


class _Run:
    """One upstream side, driven operation by operation; the last snapshot of each kind kept."""

    def __init__(self, cfg: HarnessConfig) -> None:
        self.cfg = cfg
        self.side: Side = make_side(BaseSubject(), cfg, None)
        self.clock = 0.0
        self.outputs: dict[str, dict[str, Any]] = {}
        self.stats: list[dict[str, Any]] = []

    @property
    def sched(self) -> Any:
        return self.side.scheduler

    def add(self, rid: str, params: tuple[tuple[str, Any], ...] | None, **kw: Any) -> None:
        op = AddRequest(rid, kw.pop("prompt", PROMPT), kv_transfer_params=params, **kw)
        self.apply(op, list(op.prompt))

    def apply(self, op: Any, prompt: list[int] | None = None) -> dict[str, Any]:
        self.clock += 1
        snap = self.side.apply(op, prompt, self.cfg, self.clock)
        assert "exception" not in snap, snap["exception"]
        for rid, out in (snap.get("outputs") or {}).items():
            self.outputs.setdefault(rid, {}).update(out)
        if snap.get("stats"):
            self.stats.append(snap["stats"])
        return snap

    def step(self) -> dict[str, Any]:
        return self.apply(Step())

    def status(self, rid: str) -> str | None:
        req = self.sched.requests.get(rid)
        return None if req is None else vc.status_name(req)

    def drain(self, limit: int = 200) -> None:
        for _ in range(limit):
            if not self.side.busy():
                return
            self.step()
        raise AssertionError("the run did not drain")


def test_defaults_leave_traces_unchanged_and_fields_round_trip() -> None:
    assert not {k for k in HarnessConfig().to_dict() if k.startswith("kv_")}
    cfg = _config("kv-offload").with_(kv_load_failure_policy="recompute", kv_role="kv_consumer")
    assert HarnessConfig.from_dict(cfg.to_dict()) == cfg
    op = AddRequest("r0", (1, 2), kv_transfer_params=(("hit_blocks", 2), ("load", "async")))
    assert "kv_transfer_params" not in op_to_dict(AddRequest("r0", (1, 2)))
    assert op_from_dict(op_to_dict(op)) == op
    assert "kv_transfer_params={'hit_blocks': 2, 'load': 'async'}" in op.describe()


def test_transfer_config_is_built_from_the_harness_config() -> None:
    assert build_vllm_config(TIGHT).kv_transfer_config is None
    kv = build_vllm_config(_config("kv-harness-recompute")).kv_transfer_config
    assert (kv.kv_connector, kv.kv_role, kv.kv_load_failure_policy, kv.engine_id) == (
        HARNESS,
        "kv_both",
        "recompute",
        ENGINE_ID,
    )
    example = build_vllm_config(_config("kv-example-producer")).kv_transfer_config
    assert example.is_kv_producer and not example.is_kv_consumer
    assert example.kv_connector_extra_config["shared_storage_path"]
    offload = build_vllm_config(_config("kv-offload")).kv_transfer_config
    assert offload.kv_connector_extra_config["cpu_bytes_to_use"] == 16 * 8192


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("name", [a.name for a in KV_AXES])
def test_each_scheduler_builds_its_own_connector(name: str, mode: str) -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    cfg = _config(name, mode)
    assert cfg.log_stats, "the connector axes compare the connector's statistics"
    cls = AsyncScheduler if mode == "async" else Scheduler
    a, b = build_scheduler(cls, cfg), build_scheduler(cls, cfg)
    assert a.get_kv_connector() is not b.get_kv_connector()
    assert type(a.get_kv_connector()) is type(b.get_kv_connector())
    consumer = cfg.kv_role in ("kv_consumer", "kv_both")
    # With steps in flight a consumer connector defers block frees (vLLM's choice, reached here).
    assert a.defer_block_free == (consumer and mode == "async")


def test_kv_transfer_params_reach_the_request_on_both_subjects() -> None:
    from omni_runtime.conformance_subject import OmniSubject

    params = (("hit_blocks", 1), ("send_steps", 2))
    op = AddRequest("r0", PROMPT, kv_transfer_params=params)
    sp = make_sampling_params(op, TIGHT)
    assert sp.extra_args == {"kv_transfer_params": dict(params)}
    assert make_sampling_params(AddRequest("r1", PROMPT), TIGHT).extra_args is None
    omni = OmniSubject()
    feature = omni.feature_configs()["token-updates"]
    cfg = _config("kv-harness-fail", additional_config=dict(feature["additional_config"]))
    for subject in (BaseSubject(), omni):
        sched = subject.build_scheduler(cfg)
        request = subject.make_request(op, list(PROMPT), cfg, sched, 0.0)
        assert request.kv_transfer_params == dict(params), subject


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_async_load_waits_for_remote_kv_until_reported(mode: str) -> None:
    run = _Run(_config("kv-harness-fail", mode))
    run.add("r0", (("hit_blocks", 2), ("load", "async"), ("load_steps", 2)), max_tokens=2)
    run.step()
    assert run.status("r0") == "WAITING_FOR_REMOTE_KVS"
    assert run.sched.requests["r0"].num_computed_tokens == 32
    seen = set()
    for _ in range(6):
        run.step()
        seen.add(run.status("r0"))
    assert "RUNNING" in seen or run.status("r0") is None
    run.drain()
    assert run.outputs["r0"]["kv_transfer_params"]["remote_send"] is False
    hits = [s["connector_prefix_cache_stats"]["hits"] for s in run.stats]
    assert 32 in hits


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_delayed_free_holds_blocks_until_the_send_is_reported(mode: str) -> None:
    run = _Run(_config("kv-harness-recompute", mode))
    free = run.side.free_blocks()
    run.add("r0", (("send_steps", 3),), max_tokens=2)
    held_after_finish = 0
    for _ in range(20):
        run.step()
        req = run.sched.requests.get("r0")
        if req is not None and vc.is_finished(req):
            held_after_finish += 1
            assert run.side.free_blocks() < free
            assert run.sched.get_kv_connector().has_pending_block_frees()
    assert held_after_finish >= 3
    run.drain()
    assert "r0" not in run.sched.requests and run.side.free_blocks() == free
    assert run.outputs["r0"]["kv_transfer_params"]["remote_send"] is True
    # The connector's own state, compared between sides through its statistics.
    assert ["r0"] in [(s.get("kv_connector_stats") or {}).get("sending") for s in run.stats]


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_sync_load_failure_follows_the_policy(policy: str) -> None:
    run = _Run(_config(f"kv-harness-{policy}"))
    run.add("r0", (("hit_blocks", 2), ("fail", 1)), max_tokens=3)
    run.step()  # loads 32 tokens; the second block fails
    if policy == "fail":
        assert run.outputs["r0"]["finish_reason"] == "error"
        run.drain()
        return
    assert run.sched.requests["r0"].num_computed_tokens == 16  # back to the bad block
    assert "r0" not in run.outputs  # the step's token was discarded
    run.drain()
    assert run.outputs["r0"]["finish_reason"] == "length"


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_async_receive_follows_the_policy(policy: str) -> None:
    run = _Run(_config(f"kv-harness-{policy}"))
    run.add("r0", (("hit_blocks", 1), ("load", "async"), ("fail", "request")), max_tokens=2)
    run.step()  # the load starts and is reported failed in the same step
    run.drain()
    expected = "length" if policy == "recompute" else "error"
    assert run.outputs["r0"]["finish_reason"] == expected


def test_a_late_lookup_keeps_the_request_waiting() -> None:
    run = _Run(_config("kv-harness-recompute"))
    run.add("r0", (("hit_blocks", 1), ("lookup_steps", 2)), max_tokens=1)
    run.step()
    assert run.status("r0") == "WAITING" and run.sched.requests["r0"].num_computed_tokens == 0
    run.drain()
    assert run.outputs["r0"]["finish_reason"] == "length"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_offloaded_prefix_is_hit_after_a_reset(mode: str) -> None:
    run = _Run(_config("kv-offload", mode))
    run.add("r0", None, max_tokens=2)
    run.drain()  # stores issued, then reported by the worker stand-in
    run.apply(ResetPrefixCache())
    run.add("r1", None, max_tokens=2)
    run.drain()
    hits = sum(s["connector_prefix_cache_stats"]["hits"] for s in run.stats)
    assert hits >= 32
    assert not run.sched.get_kv_connector().has_pending_push_work()
