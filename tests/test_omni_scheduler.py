"""The omni schedulers on real vLLM schedulers: chunk transfer (C-40..C-45), cleanup (C-04),
output structs (C-02 / OMNI-OUT-001), faults (C-61), and parity with omni features off (C-01).

Each test drives ``OmniARScheduler`` (and where it matters ``OmniARAsyncScheduler``) beside
upstream's ``Scheduler`` built from the same ``HarnessConfig``; nothing of vLLM is mocked.
"""

from __future__ import annotations

import msgspec
import pytest
import torch
from vllm import SamplingParams
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.request import Request, RequestStatus

from conformance._core.config import HarnessConfig, block_hasher, build_scheduler
from omni_runtime.adapters import InputAdapter, StageInput
from omni_runtime.config import stage_additional_config
from omni_runtime.payload import OmniEngineCoreOutputs, StagePayload
from omni_runtime.sched import OmniARAsyncScheduler, OmniARScheduler
from omni_runtime.sched.processors import CodecTokenStreamer
from tests.sched_steps import TALKER, hidden_payload, run_to_completion, step, token_of


def omni_cfg(**kw) -> HarnessConfig:
    return HarnessConfig(additional_config=stage_additional_config(TALKER), **kw)


def make(cls=OmniARScheduler, processor=None, **kw):
    sched = build_scheduler(cls, omni_cfg(**kw))
    if processor is not None:
        sched.transfer.set_processor(processor)
    return sched


def add(sched, rid, prompt, *, final=None, max_tokens=4, stop=None, ignore_eos=True):
    adapter = InputAdapter(
        sched.omni_stage,
        max_model_len=sched.max_model_len,
        block_hasher=block_hasher(16),
        live_ids=sched.requests,
    )
    sp = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop or [], ignore_eos=ignore_eos)
    req = adapter.build(
        StageInput(rid, sp, prompt_token_ids=prompt, final_stage_id=final, arrival_time=0.0)
    )
    sched.add_request(req)
    return req


class Recorder:
    """A processor that records every call; returns its input so every call is a delivery."""

    def __init__(self, token_updates=True, returns=True):
        if token_updates is not None:
            self.requires_token_updates = token_updates
        self.returns = returns
        self.calls: list[tuple[str, bool, list[int] | None, StagePayload | None]] = []

    def __call__(self, request_id, payload, is_final, new_token_ids=None):
        self.calls.append((request_id, is_final, new_token_ids, payload))
        return (request_id, new_token_ids) if self.returns else None

    def finals(self, rid):
        return [c for c in self.calls if c[0] == rid and c[1]]


def chunks(sched):
    return sched.transfer.sink.drain()


def test_token_updates_reach_processor_without_tensor_payload():  # C-40
    rec = Recorder(token_updates=True)
    sched = make(processor=rec)
    add(sched, "a", list(range(10, 30)), max_tokens=5)
    run_to_completion(sched)
    ids = [c[2] for c in rec.calls if c[0] == "a" and c[2]]
    assert [t for group in ids for t in group] == [token_of("a", p) for p in range(20, 25)]
    assert len(rec.finals("a")) == 1
    sent = chunks(sched)
    assert [c.seq for c in sent] == list(range(len(sent)))
    assert sent[-1].is_final and sent[-1].finish_reason == "length"


@pytest.mark.parametrize("declared", [1, "yes", [True], None, False])
def test_truthy_but_not_true_is_not_a_declaration(declared):  # C-40, C-41
    rec = Recorder(token_updates=declared)
    sched = make(processor=rec)
    add(sched, "a", list(range(10, 30)), max_tokens=5)
    run_to_completion(sched)
    # Without a tensor payload only the terminal step reaches the processor.
    assert [(c[0], c[1]) for c in rec.calls] == [("a", True)]


def test_undeclared_processor_fires_on_tensor_payloads():  # C-41
    rec = Recorder(token_updates=None)
    sched = make(processor=rec)
    add(sched, "a", list(range(10, 30)), max_tokens=3)
    run_to_completion(sched, payload=hidden_payload)
    # One call per step (all carry hidden rows): prefill + 2 decodes, the last one final.
    assert [c[1] for c in rec.calls] == [False, False, True]
    assert torch.equal(rec.calls[0][3].hidden[:, 0], torch.arange(0, 20, dtype=torch.float32))


def test_new_token_ids_only_when_signature_accepts_it():
    seen = []

    def positional(request_id, payload, is_final):
        seen.append(("positional", is_final))
        return None

    positional.requires_token_updates = True

    def kwargs_style(request_id, payload, is_final, **kw):
        seen.append(("kwargs", kw.get("new_token_ids")))
        return None

    kwargs_style.requires_token_updates = True
    for fn in (positional, kwargs_style):
        sched = make(processor=fn)
        add(sched, "a", list(range(10, 30)), max_tokens=2)
        run_to_completion(sched)
    assert ("positional", True) in seen
    assert ("kwargs", [token_of("a", 20)]) in seen


def test_final_stage_requests_never_send():  # C-42
    rec = Recorder(token_updates=True)
    sched = make(processor=rec)
    add(sched, "ends-here", list(range(10, 30)), final="talker", max_tokens=4)
    add(sched, "goes-on", list(range(40, 60)), max_tokens=4)
    run_to_completion(sched, payload=hidden_payload)
    sent = chunks(sched)
    assert {c.request_id for c in sent} == {"goes-on"}
    assert all(c[0] == "goes-on" for c in rec.calls)
    # Abort paths too.
    add(sched, "ends-here-2", list(range(10, 30)), final="talker")
    sched.finish_requests(["ends-here-2"], RequestStatus.FINISHED_ABORTED)
    assert chunks(sched) == []


def test_exactly_one_eof_even_when_processor_returns_nothing():  # C-43
    rec = Recorder(token_updates=True, returns=False)
    sched = make(processor=rec)
    for i in range(3):
        add(sched, f"r{i}", list(range(10 + i, 40 + i)), max_tokens=3 + i)
    run_to_completion(sched)
    sent = chunks(sched)
    for i in range(3):
        finals = [c for c in sent if c.request_id == f"r{i}" and c.is_final]
        assert len(finals) == 1 and finals[0].data is None
        assert len(rec.finals(f"r{i}")) == 1
    # Non-final calls returning None deliver nothing.
    assert all(c.is_final for c in sent)
    assert sched.omni_request_ids() == set()


@pytest.mark.parametrize("where", ["waiting", "running", "preempted"])
def test_abort_gets_one_terminal_and_leaves_no_omni_state(where):  # C-04, C-43
    rec = Recorder(token_updates=True)
    sched = make(processor=rec, num_blocks=6)  # 5 usable blocks: two 40-token prompts collide
    add(sched, "first", list(range(100, 130)), max_tokens=40)
    victim = "first"
    if where == "running":
        step(sched)
    elif where == "preempted":
        add(sched, "second", list(range(200, 230)), max_tokens=40)
        for _ in range(40):
            step(sched)
            preempted = [
                r.request_id for r in sched.requests.values() if r.status == RequestStatus.PREEMPTED
            ]
            if preempted:
                victim = preempted[0]
                break
    expected = {
        "waiting": RequestStatus.WAITING,
        "running": RequestStatus.RUNNING,
        "preempted": RequestStatus.PREEMPTED,
    }[where]
    assert sched.requests[victim].status == expected
    sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
    finals = [c for c in chunks(sched) if c.request_id == victim and c.is_final]
    assert len(finals) == 1 and finals[0].finish_reason == "abort"
    assert victim not in sched.omni_request_ids()
    assert len(rec.finals(victim)) == 1
    run_to_completion(sched)
    assert sched.omni_request_ids() == set()


def test_abort_in_flight_under_async_scheduling():  # C-04, C-07
    rec = Recorder(token_updates=True)
    sched = make(OmniARAsyncScheduler, processor=rec, async_scheduling=True)
    add(sched, "a", list(range(10, 30)), max_tokens=20)
    add(sched, "b", list(range(40, 60)), max_tokens=6)
    from tests.sched_steps import runner_output

    so1 = sched.schedule()
    out1 = runner_output(sched, so1)
    so2 = sched.schedule()  # step 2 scheduled before step 1's update, as EngineCore does
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)  # "a" is in flight twice
    sched.update_from_output(so1, out1)
    out2 = (
        runner_output(sched, so2)
        if all(r in sched.requests for r in so2.num_scheduled_tokens)
        else None
    )
    if out2 is not None:
        sched.update_from_output(so2, out2)
    finals = [c for c in sched.transfer.sink.drain() if c.request_id == "a" and c.is_final]
    assert len(finals) == 1 and finals[0].finish_reason == "abort"
    assert "a" not in sched.omni_request_ids() and "a" not in sched.requests


def test_ids_are_trimmed_at_stop_and_immutable():  # C-44
    rec = Recorder(token_updates=True)
    sched = make(processor=rec)
    stop_tok = token_of("a", 22)
    add(sched, "a", list(range(10, 30)), max_tokens=10, stop=[stop_tok])
    run_to_completion(sched)
    delivered = [t for c in chunks(sched) for t in c.token_ids]
    assert delivered == [token_of("a", p) for p in range(20, 23)]
    # Mutating the list the processor got changes nothing that was delivered.
    for c in rec.calls:
        if c[2]:
            c[2].append(-1)
    assert [t for c in sched.transfer.sink.drain() for t in c.token_ids] == []


def test_no_redelivery_after_preemption_and_recompute():  # C-45
    rec = Recorder(token_updates=None)
    sched = make(processor=rec, num_blocks=6)
    add(sched, "x", list(range(100, 130)), max_tokens=40)
    add(sched, "y", list(range(200, 230)), max_tokens=40)
    results = run_to_completion(sched, payload=hidden_payload)
    preempted = any(so.preempted_req_ids for so, _ in results)
    assert preempted, "workload must force a preemption"
    sent = chunks(sched)
    for rid in ("x", "y"):
        rows = [
            c.payload.hidden[:, 0] for c in sent if c.request_id == rid and c.payload is not None
        ]
        positions = torch.cat(rows).tolist() if rows else []
        assert positions == sorted(set(positions)), f"{rid}: a position was delivered twice"
        assert positions == list(map(float, range(len(positions))))


def test_chunk_refs_ride_on_engine_core_outputs():  # C-02, OMNI-OUT-001
    rec = Recorder(token_updates=True)
    sched = make(processor=rec)
    add(sched, "a", list(range(10, 30)), max_tokens=2)
    outputs = [eco for _, res in run_to_completion(sched) for eco in res.values()]
    omni = [o for eco in outputs for o in eco.outputs if getattr(o, "omni_chunk_refs", None)]
    assert omni and omni[-1].omni_eof and omni[-1].omni_chunk_refs == ["talker/a/1"]
    container = next(eco for eco in outputs if isinstance(eco, OmniEngineCoreOutputs))
    wire = msgspec.msgpack.encode(container)
    upstream_view = msgspec.msgpack.decode(wire, type=EngineCoreOutputs)
    assert [o.new_token_ids for o in upstream_view.outputs] == [
        o.new_token_ids for o in container.outputs
    ]
    omni_view = msgspec.msgpack.decode(wire, type=OmniEngineCoreOutputs)
    assert omni_view.outputs[0].omni_chunk_refs == container.outputs[0].omni_chunk_refs


def test_processor_fault_fails_only_its_request():  # C-61, OMNI-ERR-001
    def flaky(request_id, payload, is_final, new_token_ids=None):
        if request_id == "bad" and new_token_ids:
            raise RuntimeError("processor exploded")
        return new_token_ids

    flaky.requires_token_updates = True
    sched = make(processor=flaky)
    free0 = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    add(sched, "bad", list(range(10, 30)), max_tokens=5)
    add(sched, "good", list(range(40, 60)), max_tokens=5)
    results = run_to_completion(sched)
    finals = {
        o.request_id: o.finish_reason
        for _, res in results
        for eco in res.values()
        for o in eco.outputs
        if o.finish_reason is not None
    }
    assert str(finals["bad"]) == "error" and str(finals["good"]) == "length"
    assert not sched.has_requests()
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == free0
    assert sched.omni_request_ids() == set()


@pytest.mark.parametrize("async_", [False, True])
def test_parity_with_omni_features_off(
    async_,
):  # C-01 (the full lock-step is in test_lockstep_scripted)
    cfg = HarnessConfig(async_scheduling=async_, num_blocks=12)
    up = build_scheduler(AsyncScheduler if async_ else Scheduler, cfg)
    om = build_scheduler(OmniARAsyncScheduler if async_ else OmniARScheduler, cfg)
    assert om.transfer is None
    h = block_hasher(16)
    for s in (up, om):
        for i in range(4):
            prompt = list(range(7, 39)) + [100 + i] * (8 + i)
            s.add_request(
                Request(
                    f"r{i}",
                    prompt,
                    SamplingParams(max_tokens=6 + i),
                    None,
                    arrival_time=0.0,
                    block_hasher=h,
                )
            )
    if async_:
        return  # async lock-step needs the batch-queue driver: covered by the scripted lock-step.
    for _ in range(100):
        if not up.has_requests():
            break
        so_u, out_u = step(up)
        so_o, out_o = step(om)
        assert so_u.num_scheduled_tokens == so_o.num_scheduled_tokens
        assert sorted(so_u.preempted_req_ids or ()) == sorted(so_o.preempted_req_ids or ())
        assert {
            c: [(o.request_id, o.new_token_ids, o.finish_reason) for o in e.outputs]
            for c, e in out_u.items()
        } == {
            c: [(o.request_id, o.new_token_ids, o.finish_reason) for o in e.outputs]
            for c, e in out_o.items()
        }
        assert (
            up.kv_cache_manager.block_pool.get_num_free_blocks()
            == om.kv_cache_manager.block_pool.get_num_free_blocks()
        )
    assert not om.has_requests()


def test_codec_streamer_groups_and_flushes():
    s = CodecTokenStreamer(chunk_size=4, codec_vocab=256)
    assert s("r", None, False, new_token_ids=[1, 2, 3]) is None
    assert s("r", None, False, new_token_ids=[4, 300, 5]).tolist() == [1, 2, 3, 4]
    assert s("r", None, True, new_token_ids=[6]).tolist() == [5, 6]
    assert s.pending_request_ids() == set()


def test_processor_fault_on_the_terminal_step_still_ends_once():  # C-43, C-61
    def fails_at_eof(request_id, payload, is_final, new_token_ids=None):
        if is_final:
            raise RuntimeError("flush exploded")
        return new_token_ids

    fails_at_eof.requires_token_updates = True
    sched = make(processor=fails_at_eof)
    add(sched, "a", list(range(10, 30)), max_tokens=3)
    results = run_to_completion(sched)
    finals = [
        o
        for _, res in results
        for eco in res.values()
        for o in eco.outputs
        if o.finish_reason is not None
    ]
    assert [(o.request_id, str(o.finish_reason)) for o in finals] == [("a", "error")]
    eofs = [c for c in sched.transfer.sink.drain() if c.is_final]
    assert [(c.request_id, c.finish_reason, c.data) for c in eofs] == [("a", "error", None)]
    assert sched.omni_request_ids() == set() and not sched.has_requests()


def test_declared_scheduler_attributes_are_exactly_what_is_added():  # C-12
    up = build_scheduler(Scheduler, omni_cfg())
    om = make()
    from omni_runtime.sched import DECLARED_SCHEDULER_ATTRIBUTES

    assert set(vars(om)) - set(vars(up)) == set(DECLARED_SCHEDULER_ATTRIBUTES)


def test_conditioning_crosses_when_processor_has_nothing_yet():  # C-31
    streamer = CodecTokenStreamer(chunk_size=8)
    sched = make(processor=streamer)
    add(sched, "a", list(range(10, 30)), max_tokens=3)

    def conditioning_on_prefill(rid, start, n):
        if start == 0:
            return StagePayload(rid, start, n, hidden=None, conditioning=torch.ones(4))
        return None

    run_to_completion(sched, payload=conditioning_on_prefill)
    sent = chunks(sched)
    carried = [c for c in sent if c.payload is not None and c.payload.conditioning is not None]
    assert len(carried) == 1 and carried[0].data is None and not carried[0].is_final
    assert sent[-1].is_final and sent[-1].data.tolist() == [
        token_of("a", p) for p in range(20, 23) if token_of("a", p) < 256
    ]


@pytest.mark.parametrize(
    "path,problem",
    [
        ("CodecTokenStreamer", "is not a dotted path"),
        ("omni_runtime.sched.processors.NoSuchStreamer", "names nothing importable"),
        ("omni_runtime.no_such_module.Streamer", "names nothing importable"),
        ("omni_runtime.config.ADDITIONAL_CONFIG_KEY", "is not callable"),
    ],
)
def test_a_processor_path_that_names_nothing_usable_is_refused_by_field(path, problem):
    """A stage whose ``chunk_processor`` path is mistyped is refused when its scheduler is built,
    with an error naming the configuration field (not an import error from inside vLLM)."""
    from dataclasses import replace

    cfg = HarnessConfig(
        additional_config=stage_additional_config(replace(TALKER, chunk_processor=path))
    )
    with pytest.raises((TypeError, ValueError), match=f"omni_stage.chunk_processor: .*{problem}"):
        build_scheduler(OmniARScheduler, cfg)
