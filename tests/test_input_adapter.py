"""The input adapter (C-10, C-12, C-13, C-60): stage inputs become a Request plus one omni slot;
malformed input is refused with the request and field named, before any scheduler sees it."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.request import Request

from conformance._core.config import HarnessConfig, block_hasher, build_scheduler
from omni_runtime.adapters import (
    DECLARED_REQUEST_ATTRIBUTES,
    InputAdapter,
    OmniRequest,
    RequestRejected,
    StageInput,
    omni_state_of,
)
from omni_runtime.config import OmniStageConfig, stage_additional_config
from omni_runtime.sched import OmniARScheduler
from tests.sched_steps import TALKER

SP = SamplingParams(max_tokens=4)


@pytest.fixture()
def sched():
    return build_scheduler(
        OmniARScheduler, HarnessConfig(additional_config=stage_additional_config(TALKER))
    )


@pytest.fixture()
def adapter(sched):
    return InputAdapter(
        TALKER,
        max_model_len=sched.max_model_len,
        vocab_size=512,
        hidden_size=64,
        block_hasher=block_hasher(16),
        live_ids=sched.requests,
    )


def test_request_carries_exactly_one_declared_slot(adapter):  # C-10, C-12
    req = adapter.build(
        StageInput(
            "r1",
            SP,
            prompt_token_ids=[5, 6, 7],
            arrival_time=1.0,
            additional_information={"speaker": "a", "scale": 0.5},
        )
    )
    plain = Request("r1", [5, 6, 7], SP, None, arrival_time=1.0, block_hasher=block_hasher(16))
    assert isinstance(req, OmniRequest) and isinstance(req, Request)
    assert set(vars(req)) - set(vars(plain)) == set(DECLARED_REQUEST_ATTRIBUTES)
    state = omni_state_of(req)
    assert state.final_stage_id == "code2wav" and state.downstream == ("code2wav",)
    assert dict(state.additional_information) == {"speaker": "a", "scale": 0.5}
    with pytest.raises(TypeError):
        state.additional_information["x"] = 1  # read-only view: nothing mutates it later
    assert omni_state_of(plain) is None


def test_final_stage_here_means_no_downstream(adapter):  # C-42 metadata
    req = adapter.build(StageInput("r1", SP, prompt_token_ids=[5], final_stage_id="talker"))
    assert omni_state_of(req).downstream == ()


def test_prompt_embeds_enter_upstream_field_as_private_copy(adapter):
    embeds = torch.randn(5, 64)
    req = adapter.build(StageInput("e1", SP, prompt_embeds=embeds))
    assert req.prompt_token_ids is None and req.num_prompt_tokens == 5
    assert torch.equal(req.prompt_embeds, embeds)
    embeds.zero_()  # the caller reuses its buffer
    assert not torch.equal(req.prompt_embeds, embeds)


BAD = [
    ("empty ids", dict(prompt_token_ids=[]), "prompt_token_ids", "empty prompt"),
    ("empty embeds", dict(prompt_embeds=torch.zeros(0, 64)), "prompt_embeds", "empty prompt"),
    ("both", dict(prompt_token_ids=[1], prompt_embeds=torch.zeros(1, 64)), "prompt", "exactly one"),
    ("neither", dict(), "prompt", "exactly one"),
    ("too long", dict(prompt_token_ids=[1] * 300), "prompt", "exceed max_model_len 256"),
    (
        "embeds dtype",
        dict(prompt_embeds=torch.zeros(3, 64, dtype=torch.float16)),
        "prompt_embeds",
        "dtype",
    ),
    ("embeds shape", dict(prompt_embeds=torch.zeros(3, 32)), "prompt_embeds", "hidden size 32"),
    ("embeds rank", dict(prompt_embeds=torch.zeros(64)), "prompt_embeds", "shape"),
    ("embeds nan", dict(prompt_embeds=torch.full((2, 64), float("nan"))), "prompt_embeds", "NaN"),
    ("id range", dict(prompt_token_ids=[1, 600]), "prompt_token_ids[1]", "outside vocabulary"),
    ("id type", dict(prompt_token_ids=[1, 2.5]), "prompt_token_ids[1]", "expected int"),
    (
        "unknown stage",
        dict(prompt_token_ids=[1], final_stage_id="vocoder"),
        "final_stage_id",
        "unknown stage",
    ),
    (
        "earlier stage",
        dict(prompt_token_ids=[1], final_stage_id="thinker"),
        "final_stage_id",
        "before this stage",
    ),
    (
        "info nan",
        dict(prompt_token_ids=[1], additional_information={"x": float("nan")}),
        "additional_information['x']",
        "NaN",
    ),
    (
        "info type",
        dict(prompt_token_ids=[1], additional_information={"x": object()}),
        "additional_information['x']",
        "unsupported type",
    ),
    (
        "trace headers type",
        dict(prompt_token_ids=[1], trace_headers={"traceparent": 7}),
        "trace_headers",
        "mapping of str to str",
    ),
    (
        "conditioning nan",
        dict(prompt_token_ids=[1], conditioning=torch.tensor([float("inf")])),
        "conditioning",
        "NaN",
    ),
]


@pytest.mark.parametrize("name,kw,field,problem", BAD, ids=[b[0] for b in BAD])
def test_malformed_input_is_rejected_naming_request_and_field(
    sched, adapter, name, kw, field, problem
):  # C-13
    free0 = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    sched.add_request(adapter.build(StageInput("neighbour", SP, prompt_token_ids=[9, 9, 9])))
    with pytest.raises(RequestRejected) as err:
        adapter.build(StageInput("bad-7", SP, **kw))
    assert err.value.request_id == "bad-7" and err.value.field == field
    assert str(err.value).startswith(f"bad-7: {field}: ") and problem in str(err.value)
    assert set(sched.requests) == {"neighbour"}  # nothing reached the scheduler
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == free0


def test_duplicate_id_rejected(sched, adapter):  # C-60
    sched.add_request(adapter.build(StageInput("dup", SP, prompt_token_ids=[1, 2])))
    with pytest.raises(RequestRejected, match="dup: request_id: duplicate"):
        adapter.build(StageInput("dup", SP, prompt_token_ids=[3]))


def test_bad_sampling_params_rejected(adapter):
    sp = SamplingParams(max_tokens=1)
    sp.max_tokens = 0
    with pytest.raises(RequestRejected, match="r9: sampling_params.max_tokens"):
        adapter.build(StageInput("r9", sp, prompt_token_ids=[1]))


def test_stage_config_validation():
    with pytest.raises(ValueError, match="stage_id"):
        OmniStageConfig(stage_id="x", stages=("a",))
    with pytest.raises(ValueError, match="unknown keys"):
        OmniStageConfig.from_dict({"stage_id": "a", "stages": ["a"], "bogus": 1})
    cfg = OmniStageConfig.from_dict(TALKER.to_dict())
    assert cfg == TALKER
