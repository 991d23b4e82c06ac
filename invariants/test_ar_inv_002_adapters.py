"""AR-INV-002 (C-10..C-13): stage data crosses the stage boundary only through the adapters.

Three properties, each on what the subject declares:

* run-time audit (C-10..C-12; ``declared_attributes``) — ``invariants.audits`` on every live
  request and the scheduler after every operation; ``test_runtime_audit`` runs it once more
  with the subject's first token-source feature;
* malformed stage inputs (C-13, C-60; ``input_adapter``) — each input with exactly one defect
  is rejected by the adapter, naming request and field, and leaves the scheduler untouched;
  well-formed inputs are accepted;
* static check (C-10, C-11; ``source_layout``) — only the declared builder modules construct
  the subject's payload type.

Clauses and mutants: docs/contracts.md; the method: docs/design.md, "How the suite checks".
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings

from conformance._core import vllm_compat as vc
from conformance._core.capabilities import NotApplicable, SourceLayout
from conformance._core.needs import features_of, require
from invariants.audits import same_scalar, tensor_difference
from invariants.machines import check_machine, lockstep_run, suite_settings
from invariants.strategies import Malformed, malformed_inputs, malformed_kinds

pytestmark = [pytest.mark.invariants]


# ---- run-time audit -----------------------------------------------------------------------


@pytest.mark.clauses("C-10", "C-11", "C-12")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_runtime_audit(conformance, conformance_subject, mode):
    require(conformance_subject, "declared_attributes", "declared attributes")
    feature = features_of(conformance_subject, worker=False)[-1]
    run = lockstep_run(
        conformance, conformance_subject, feature, f"AR-INV-002-{mode}", mode=mode, prefix=True
    )
    check_machine(run, suite_settings(10))
    require_audited(run)


def require_audited(run: Any) -> None:
    """``NotApplicable`` when no session of ``run`` audited a live request: the request audits
    (C-10, C-12, most of C-11) iterated over nothing, which is no pass."""
    if not sum(s.requests_audited for s in run.sessions):
        raise NotApplicable(
            f"the run's {len(run.sessions)} programs never audited a live request "
            "(no request was live on both sides at any operation)"
        )


# ---- malformed inputs ---------------------------------------------------------------------


def _sampling(max_tokens: int = 4) -> Any:
    from vllm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens)


def says_what_is_wrong(text: str, rid: str, field: str) -> bool:
    """Whether a rejection's message says what is wrong, in words of its own (any words: their
    wording is the subject's), not only the request's and the field's names or a bare "None"."""
    for name in (rid, field, "None"):
        text = text.replace(name, " ") if name else text
    return re.search(r"[A-Za-z]{3,}", text) is not None


def check_malformed(case: Malformed, probe: Any, scheduler: Any) -> None:
    """Raises AssertionError when the adapter does not reject ``case`` as C-13 requires."""
    kw = dict(case.kwargs)
    rid = kw.pop("request_id", "req-bad")
    sp = _sampling()
    if "max_tokens" in kw:
        # vLLM's own SamplingParams refuses 0; a stage input may still arrive with it.
        sp.max_tokens = kw.pop("max_tokens")
    if "sampling_params" in kw:
        sp = kw.pop("sampling_params")
    pool = vc.block_pool(scheduler)
    free_before = pool.get_num_free_blocks()
    live_before = set(scheduler.requests)
    try:
        request = probe.build(scheduler, rid, sp, **kw)
    except probe.rejection as exc:
        named = getattr(exc, "request_id", None)
        assert named in (rid, repr(rid)), f"C-13: {case.describe()}: error names {named!r}"
        field = str(getattr(exc, "field", ""))
        assert field.startswith(case.field.split("[")[0]) and (
            "[" not in case.field or field == case.field
        ), f"C-13: {case.describe()}: error names field {field!r}, expected {case.field!r}"
        # What a client reads is the message: it must name both as well.
        text = str(exc)
        assert rid in text and field in text, (
            f"C-13: {case.describe()}: the error's message {text!r} does not name the request "
            f"{rid!r} and the field {field!r}"
        )
        assert says_what_is_wrong(text, rid, field), (
            f"C-13: {case.describe()}: the error's message {text!r} does not say what is wrong"
        )
        if hasattr(exc, "problem"):
            problem = str(exc.problem)
            assert says_what_is_wrong(problem, rid, field), (
                f"C-13: {case.describe()}: the error's problem {problem!r} does not say what is "
                "wrong"
            )
        if case.wrong_type and getattr(probe.spec, "names_types", False):
            assert re.search(rf"\b{case.wrong_type}\b", text.replace(field, " ")), (
                f"C-13: {case.describe()}: the error's message {text!r} does not name the "
                f"wrong value's type, {case.wrong_type}"
            )
    else:
        raise AssertionError(
            f"C-13: {case.describe()}: adapter accepted the input as {type(request).__name__} "
            f"(scheduler holds {sorted(scheduler.requests)})"
        )
    assert set(scheduler.requests) == live_before, "C-13: a rejected input reached the scheduler"
    assert pool.get_num_free_blocks() == free_before, "C-13: a rejected input took blocks"


def wellformed_inputs(probe: Any) -> list[dict[str, Any]]:
    """Positive controls: one defect-free input of every kind the strategy corrupts, and the
    edges of what is valid (ids 0 and vocab - 1, a one-row prompt, a prompt one token short of
    the context)."""
    spec = probe.spec
    later = spec.stages[spec.stages.index(spec.stage_id) :]
    optional: list[dict[str, Any]] = []
    if spec.id_tensors:
        optional.append({"prompt_token_ids": torch.tensor([0, 11, spec.vocab_size - 1])})
    if spec.trace_headers:
        optional.append({"prompt_token_ids": [1], "trace_headers": {"traceparent": "00-ab"}})
    if spec.request_fields:
        # Not the defaults: each must come through as given (a client's second frontend, a
        # salted cache, a high priority, an arrival time in the past).
        optional.append({"prompt_token_ids": [3, 4], **PASSED_THROUGH})
    return [
        {"prompt_token_ids": [10, 11, 12]},
        {"prompt_token_ids": [0, spec.vocab_size - 1]},
        # The longest prompt upstream takes: one token short of the context.
        {"prompt_token_ids": [7] * (spec.max_model_len - 1)},
        {"prompt_embeds": torch.zeros((3, spec.hidden_size))},
        {"prompt_embeds": torch.zeros((1, spec.hidden_size))},
        *optional,
        {
            "prompt_token_ids": [1],
            "conditioning": torch.ones(spec.hidden_size),
            "additional_information": {"speaker": 0.5, "voice": torch.ones(3), "tags": ["a"]},
        },
        *({"prompt_token_ids": [1], "final_stage_id": s} for s in later),
    ]


# vLLM's per-request fields an adapter with ``StageInputSpec.request_fields`` passes through, each
# away from its default.
PASSED_THROUGH: dict[str, Any] = {
    "arrival_time": 12.5,
    "priority": -3,
    "cache_salt": "salt-a",
    "client_index": 1,
}


def check_wellformed_accepted(probe: Any, scheduler: Any) -> None:
    """Every well-formed input is accepted, as a request whose prompt is as long as the input's
    (vLLM's ``Request.num_prompt_tokens``) and, where the adapter takes vLLM's per-request
    fields, that carries them as given (an arrival time of its own when none is given)."""
    for i, kw in enumerate(wellformed_inputs(probe)):
        request = probe.build(scheduler, f"ok{i}", _sampling(2), **kw)
        prompt = kw.get("prompt_token_ids", kw.get("prompt_embeds"))
        assert prompt is not None
        assert request.num_prompt_tokens == len(prompt), (
            f"C-13: well-formed input {i} ({', '.join(kw)}) of {len(prompt)} prompt tokens became "
            f"a request of {request.num_prompt_tokens}"
        )
        carried = getattr(probe, "additional_information", None)
        if carried is not None and "additional_information" in kw:
            problem = information_problem(kw["additional_information"], carried(request))
            assert problem is None, f"C-13: well-formed input {i}: {problem}"
        if not probe.spec.request_fields:
            continue
        for name, value in PASSED_THROUGH.items():
            got = getattr(request, name, None)
            if name in kw:
                assert got == value, (
                    f"C-13: well-formed input {i} gave {name}={value!r}; the request has {got!r}"
                )
        assert isinstance(request.arrival_time, float), (
            f"C-13: well-formed input {i} became a request with arrival_time "
            f"{request.arrival_time!r}, not a time"
        )


def information_problem(given: Mapping[str, Any], carried: Mapping[str, Any]) -> str | None:
    """What the request's additional information lost or changed of ``given`` (None: nothing).
    A list may come back as a tuple and a tensor as a copy (bit for bit, as C-46 compares them)."""
    if sorted(carried) != sorted(given):
        return f"additional information {sorted(given)} arrived as keys {sorted(carried)}"
    for key, value in given.items():
        got = carried[key]
        if isinstance(value, torch.Tensor):
            same = isinstance(got, torch.Tensor) and tensor_difference(value, got) is None
        elif isinstance(value, list | tuple):
            same = isinstance(got, list | tuple) and len(got) == len(value)
            same = same and all(map(same_scalar, value, got))
        else:
            same = same_scalar(value, got)
        if not same:
            return f"additional information {key!r} was {value!r}, the request carries {got!r}"
    return None


@pytest.mark.clauses("C-13", "C-60")
def test_malformed_inputs_rejected_at_adapter(conformance_subject):
    probe = require(conformance_subject, "input_adapter", "input adapter")
    scheduler = probe.scheduler()
    check_wellformed_accepted(probe, scheduler)
    check_every_defect(probe, scheduler, suite_settings(200))


def check_every_defect(probe: Any, scheduler: Any, budget: settings) -> None:
    """``check_malformed`` over every defect kind, each in a run of its own with an equal share
    of ``budget``'s examples (at least one): a single run drawing the kind among all of them
    meets some kinds many times and others never (30 derandomized draws met 10 of 28)."""
    kinds = malformed_kinds(probe.spec)
    share = max(1, budget.max_examples // len(kinds))
    for kind in kinds:

        @settings(budget, max_examples=share)
        @given(malformed_inputs(probe.spec, kinds=(kind,)))
        def prop(case: Malformed) -> None:
            check_malformed(case, probe, scheduler)

        prop()


@pytest.mark.clauses("C-13", "C-60")
def test_duplicate_live_id_rejected(conformance_subject):
    probe = require(conformance_subject, "input_adapter", "input adapter")
    scheduler = probe.scheduler()
    request = probe.build(scheduler, "dup", _sampling(2), prompt_token_ids=[5, 6, 7])
    conformance_subject.admit(scheduler, request)
    with pytest.raises(probe.rejection) as info:
        probe.build(scheduler, "dup", _sampling(2), prompt_token_ids=[8])
    assert (info.value.request_id, info.value.field) == ("dup", "request_id")
    assert says_what_is_wrong(str(info.value), "dup", "request_id"), (
        f"C-13: the duplicate's rejection {str(info.value)!r} does not say what is wrong"
    )
    assert list(scheduler.requests) == ["dup"]


# ---- static check -------------------------------------------------------------------------


def payload_constructions(
    root: Path, payload_type: str, builders: tuple[str, ...], exceptions: Mapping[Any, str]
) -> list[str]:
    """``file:line (function)`` of every ``payload_type(...)`` call outside ``builders``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(builders):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for func in [tree, *ast.walk(tree)]:
            if func is not tree and not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            owner = getattr(func, "name", "<module>")
            for node in _own_nodes(func):
                if isinstance(node, ast.Call) and _called_name(node.func) == payload_type:
                    if (rel, owner) not in exceptions:
                        found.append(f"{rel}:{node.lineno} ({owner})")
    return found


def layout_constructions(layout: SourceLayout, root: Path | None = None) -> list[str]:
    if layout.payload_root is None or layout.payload_type is None:
        raise NotApplicable("subject declares no payload type and builder modules")
    return payload_constructions(
        root or layout.payload_root,
        layout.payload_type,
        layout.payload_builders,
        layout.payload_exceptions,
    )


def require_constructed(layout: SourceLayout) -> None:
    """``NotApplicable`` when nothing under the payload root constructs the payload type, in
    the builders or outside them: the check would scan for a name no code uses, which is no
    pass (a misspelt or renamed type, or an empty root)."""
    if layout.payload_root is None or layout.payload_type is None:
        return  # ``layout_constructions`` says so
    if not payload_constructions(layout.payload_root, layout.payload_type, (), {}):
        raise NotApplicable(
            f"no module under {layout.payload_root} constructs {layout.payload_type}"
        )


def _called_name(fn: ast.expr) -> str | None:
    if isinstance(fn, ast.Name):
        return fn.id
    if isinstance(fn, ast.Attribute):
        return fn.attr
    return None


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """Nodes of ``scope`` not inside a nested function (those are visited as their own scope)."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


@pytest.mark.clauses("C-10", "C-11")
def test_only_adapters_build_payloads(conformance_subject):
    layout = require(conformance_subject, "source_layout", "source layout")
    require_constructed(layout)
    offenders = layout_constructions(layout)
    assert not offenders, (
        f"C-11: {layout.payload_type} constructed outside {layout.payload_builders}: {offenders}"
    )


@pytest.mark.clauses("C-10", "C-11")
def test_static_check_sees_a_planted_construction(tmp_path):
    """Positive control: a planted construction in scheduler code is reported."""
    (tmp_path / "sched").mkdir()
    (tmp_path / "sched" / "leak.py").write_text("def f(rid):\n    return StagePayload(rid, 0, 1)\n")
    assert payload_constructions(tmp_path, "StagePayload", ("adapters/",), {}) == [
        "sched/leak.py:2 (f)"
    ]
