"""The structured-outputs axis's parts, checked on their own (C-09).

* The tokenizer the grammars compile against is deterministic, byte-level, sized to the model,
  and the bundled copy is what ``grammars`` builds now.
* ``AddRequest.grammar`` and ``HarnessConfig.structured_outputs`` leave traces as they were at
  their defaults, and reach ``SamplingParams`` as the input processor hands them on, through
  upstream's and the omni subject's ``make_request``.
* Grammars compile on the harness's clock (0-2 ``schedule()`` calls after admission, by the
  request id), the failing one ends its request with an error, and what the token source
  samples follows each grammar except where it deliberately breaks it.
* Snapshots of runs without the axis carry none of its fields.
"""

from __future__ import annotations

import json
import logging
import re
import zlib

import pytest

from conformance._core import grammars
from conformance._core import vllm_compat as vc
from conformance._core.config import HarnessConfig
from conformance._core.lockstep import Lockstep
from conformance._core.subjects import UpstreamSubject, make_sampling_params
from conformance._core.workload import AddRequest, Step, Trace, op_to_dict

pytestmark = pytest.mark.clauses("C-09")

ON = HarnessConfig(structured_outputs="xgrammar")


@pytest.fixture(autouse=True)
def _quiet_vllm():
    # vLLM logs every failed compilation and rejected token with a traceback: expected here.
    logging.disable(logging.ERROR)
    yield
    logging.disable(logging.NOTSET)


def _add(rid: str, grammar: str | None, max_tokens: int = 20) -> AddRequest:
    # EOS ends a request whose grammar terminated (it is the grammar's stop token).
    return AddRequest(
        rid, tuple(range(100, 108)), max_tokens=max_tokens, ignore_eos=False, grammar=grammar
    )


def test_bundled_tokenizer_is_the_one_grammars_builds():
    files = grammars.tokenizer_files(HarnessConfig().model_shape())
    for name, text in files.items():
        assert (grammars.BUNDLED_TOKENIZER / name).read_text() == text, name
    assert grammars.tokenizer_folder(ON) == grammars.BUNDLED_TOKENIZER


def test_tokenizer_is_byte_level_and_fills_the_vocabulary():
    tok = grammars.build_tokenizer(512)
    assert tok.to_str() == grammars.build_tokenizer(512).to_str()
    assert tok.get_vocab_size() == 512
    assert [tok.id_to_token(i) for i in range(3)] == list(grammars.SPECIAL_TOKENS)
    text = '{"name": "ab-12"}'
    assert tok.decode(tok.encode(text).ids) == text
    assert len(tok.encode(text).ids) < len(text.encode())  # merges span several bytes


def test_axis_fields_at_their_defaults_leave_traces_unchanged():
    assert "grammar" not in op_to_dict(_add("a", None))
    assert op_to_dict(_add("a", "json"))["grammar"] == "json"
    assert "grammar=json" in _add("a", "json").describe()
    assert "structured_outputs" not in HarnessConfig().to_dict()
    trace = Trace(config=ON, ops=[_add("a", "regex"), Step()])
    again = Trace.from_json(trace.to_json())
    assert again.config == ON and again.ops == trace.ops


def test_sampling_params_carry_the_grammar_as_the_input_processor_hands_it_on():
    plain = make_sampling_params(_add("a", None), ON)
    assert plain.structured_outputs is None
    choice = make_sampling_params(_add("a", "choice"), ON).structured_outputs
    # Validation for xgrammar turns a choice into the grammar it compiles.
    assert choice is not None and choice.choice is None and '"maybe"' in (choice.grammar or "")
    broken = make_sampling_params(_add("a", "broken"), ON).structured_outputs
    assert broken is not None and broken.grammar == grammars.CATALOGUE["broken"].params["grammar"]
    with pytest.raises(ValueError, match="structured_outputs is off"):
        make_sampling_params(_add("a", "json"), HarnessConfig())
    with pytest.raises(ValueError, match="unknown grammar"):
        make_sampling_params(_add("a", "yaml"), ON)


def test_the_omni_subject_builds_structured_requests():
    from omni_runtime.conformance_subject import OmniSchedulerSubject

    subject = OmniSchedulerSubject()
    sched = subject.build_scheduler(ON)
    request = subject.make_request(_add("a", "regex"), list(range(100, 108)), ON, sched, 0.0)
    assert request.use_structured_output
    subject.admit(sched, request)
    assert vc.request_fields(request)["grammar"] == {"state": "compiling"}


def test_grammars_compile_on_the_harness_clock():
    session = Lockstep(ON, UpstreamSubject())
    ids = [f"r{i}" for i in range(6)]
    for rid in ids:
        session.apply(_add(rid, "json"))
    delays = {
        rid: zlib.crc32(f"compile:{rid}".encode()) % vc.structured.COMPILE_DELAYS for rid in ids
    }
    assert set(delays.values()) == {0, 1, 2}  # the ids above meet every delay
    for n in range(3):
        session.apply(Step())
        held = session._last_up["requests"]  # a ready one may have sampled a forbidden token
        states = {rid: held[rid]["grammar"]["state"] for rid in ids if rid in held}
        assert states == {rid: "ready" if delays[rid] <= n else "compiling" for rid in states}
        assert all(held[rid]["num_computed_tokens"] == 0 for rid in states if delays[rid] > n)
    assert session.failure is None


def _decode(ids: list[int]) -> str:
    tok = grammars.build_tokenizer(512)
    return tok.decode([i for i in ids if i > 2])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sampled_outputs_follow_their_grammars(mode):
    cfg = ON.with_(async_scheduling=mode == "async", num_speculative_tokens=2 * (mode == "sync"))
    session = Lockstep(cfg, UpstreamSubject())
    names = [None, *grammars.CATALOGUE] * 4
    requests = [_add(f"r{i}", name, max_tokens=24) for i, name in enumerate(names)]
    for op in requests:
        session.apply(op)
    tokens: dict[str, list[int]] = {op.request_id: [] for op in requests}
    finish: dict[str, str] = {}
    while session.up.busy():
        session.apply(Step())
        for rid, out in (session._last_up.get("outputs") or {}).items():
            tokens[rid].extend(out["new_token_ids"])
            if out["finish_reason"] is not None:
                finish[rid] = out["finish_reason"]
    assert session.failure is None
    by_grammar: dict[str | None, set[str]] = {}
    for op in requests:
        reason = finish[op.request_id]
        by_grammar.setdefault(op.grammar, set()).add(reason)
        if op.grammar is None or reason != "stop":
            continue
        # Stopped: the grammar terminated, so the text is one the grammar accepts.
        text = _decode(tokens[op.request_id])
        if op.grammar == "json":
            assert set(json.loads(text)) == {"name", "age"}
        elif op.grammar == "regex":
            assert re.fullmatch(grammars.CATALOGUE["regex"].params["regex"], text), text
        elif op.grammar == "choice":
            assert text in grammars.CATALOGUE["choice"].params["choice"], text
    assert by_grammar["broken"] == {"error"}  # never compiled
    # A forbidden token ends some requests with an error; others end as their grammar allows.
    assert "error" in by_grammar["regex"] | by_grammar["choice"] | by_grammar["json"]
    assert "stop" in by_grammar["regex"] | by_grammar["choice"]


def test_snapshots_without_the_axis_carry_none_of_its_fields():
    session = Lockstep(HarnessConfig(), UpstreamSubject())
    session.apply(_add("a", None))
    for _ in range(3):
        session.apply(Step())
        snap = session._last_up
        assert not any("grammar" in f for f in snap["requests"].values())
        keys = set(snap.get("sched_out") or {})
        assert not keys & {"structured_ids", "bitmask", "sampling_deferred", "invalid_drafts"}
