"""Lock-step machines with run-time audits: the engine of every stateful invariant in this suite.

Built on the harness (``conformance.lockstep.Lockstep`` and ``conformance.machine``): the
workload language, the upstream comparison after every operation (C-01..C-07) and conservation
at teardown (C-06) are the harness's. This module adds what the harness does not observe:

* ``AuditedLockstep`` — after every operation it audits the subject side (AR-INV-002): requests
  carry exactly the declared extra attributes (C-10, C-12), no tensor or modality object sits in
  an upstream request field or in scheduler state outside the declared slot (C-11); the executor
  returned results for exactly the scheduled requests in order (C-20); no chunk was sent from a
  frame of worker or model code (C-21, the recording sink). It keeps a ledger of every request's
  emitted tokens and finish, so at teardown the chunk ledger can be checked: no send for
  final-stage requests (C-42), exactly one EOF for every other request (C-43), delivered ids equal
  the accepted ids (C-40, C-44), no position delivered twice (C-45), hidden rows equal a
  full-recompute reference and start at position 0 with a prefix hit (C-51, C-52, C-55), token-only
  chunks carry no hidden rows but carry the prefill conditioning (C-30, C-31), and, on request,
  greedy tokens equal Hugging Face's (C-08).
* ``WorkerSubject`` — the omni subject with the real model runner as its worker (built here, not
  through ``omni_runtime.worker.make_conformance_worker``, so mutants can swap the runner class).
* ``InvariantMachine`` / ``machine_class`` — ``conformance.machine.LockstepMachine`` bound to a
  recorder, a config, a subject and the audits; ``run_machine`` runs one and, for the mutant
  self-test, reports the length of the (shrunk) failing program.

Why an audit can fail: each message names its clause; the positive controls are the mutants in
``tests/mutants/runtime_mutants.py`` (``tests/test_mutant_selftest.py`` proves each is caught).
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    precondition,
    rule,
    run_state_machine_as_test,
)

from conformance.config import HarnessConfig, build_kv_cache_config, build_vllm_config
from conformance.lockstep import Lockstep, SubjectBroken
from conformance.machine import PREFIXES, LockstepMachine
from conformance.subjects import OmniSubject
from conformance.workload import Abort, AddRequest, DeliverChunks, Step
from invariants.strategies import CODEC_VOCAB, Feature

# Two xdist workers on two cores: torch's default of one thread per core makes each worker's tiny
# ops wait for the other's (measured: a 2 s property took 100 s). ``tests/conftest.py`` pins this
# too, but ``pytest invariants`` alone does not load it.
torch.set_num_threads(1)

PINNED_HASH_SEED = os.environ.get("PYTHONHASHSEED", "random") != "random"

_PKG = Path(__file__).resolve().parent.parent / "omni_runtime"
# Frames from these folders must never be on the stack of a send (C-21).
WORKER_CODE = (str(_PKG / "worker") + "/", str(_PKG / "models") + "/")


# Attributes the omni schedulers add to vLLM's (C-12): the runtime's own declaration when it
# exports one (``omni_runtime.sched.DECLARED_SCHEDULER_ATTRIBUTES``), else exactly what the omni
# scheduler classes assign in their own source (read with ``ast``), so anything that attaches
# state to a scheduler from elsewhere at run time is caught.
def declared_scheduler_attributes() -> frozenset[str]:
    import ast

    import omni_runtime.sched as sched_pkg

    declared = getattr(sched_pkg, "DECLARED_SCHEDULER_ATTRIBUTES", None)
    if declared is not None:
        return frozenset(declared)
    if "sched" not in _DECLARED:
        names: set[str] = set()
        tree = ast.parse((_PKG / "sched" / "scheduler.py").read_text())
        for node in ast.walk(tree):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            for t in targets:
                if (
                    isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Name)
                    and t.value.id == "self"
                ):
                    names.add(t.attr)
        _DECLARED["sched"] = frozenset(names)
    return _DECLARED["sched"]


_DECLARED: dict[str, frozenset[str]] = {}
# The scheduler's send path: its outbox legitimately holds chunks (with tensors) until delivery.
SEND_PATH_ATTRIBUTES = frozenset({"transfer"})
# Upstream fields whose upstream meaning is a tensor (prompt embeds enter through vLLM's field).
UPSTREAM_TENSOR_FIELDS = frozenset({"prompt_embeds"})


# ---- the runtime under test ---------------------------------------------------------------

_MODELS: dict[str, Any] = {}


def thinker_dir() -> str:
    from omni_runtime.models import model_dir

    return str(model_dir("thinker"))


def shared_model(path: str) -> Any:
    """One read-only model per process; runners never write to their model."""
    if path not in _MODELS:
        from omni_runtime.models import load_model

        _MODELS[path] = load_model(path, device="cpu", dtype=torch.float32)
    return _MODELS[path]


class WorkerSubject(OmniSubject):
    """The omni subject whose worker is ``runner_cls`` over the thinker weights."""

    name = "omni"
    runner_cls: type | None = None

    def make_worker(self, cfg: HarnessConfig) -> Any:
        from omni_runtime.worker import OmniARModelRunner

        cls = self.runner_cls or OmniARModelRunner
        vllm_config = build_vllm_config(cfg)
        runner = cls(vllm_config, shared_model(cfg.model), torch.device("cpu"))
        runner.initialize_kv_cache(build_kv_cache_config(cfg))
        return runner


def harness_config(feature: Feature, *, mode: str, prefix: bool, **over: Any) -> HarnessConfig:
    kw: dict[str, Any] = dict(
        num_blocks=14, max_num_batched_tokens=48, max_num_seqs=6, max_model_len=128
    )
    kw.update(over)
    if feature.use_worker:
        kw["model"] = thinker_dir()
    return HarnessConfig(
        async_scheduling=mode == "async",
        enable_prefix_caching=prefix,
        additional_config=dict(feature.additional_config),
        **kw,
    )


# ---- audit helpers ------------------------------------------------------------------------


def _modality_types() -> tuple[type, ...]:
    from omni_runtime.payload import StageChunk, StagePayload

    return (torch.Tensor, np.ndarray, StagePayload, StageChunk)


def find_modality(value: Any, depth: int = 3) -> str | None:
    """A short description of the first tensor / payload reachable through plain containers."""
    kinds = _modality_types()
    if isinstance(value, kinds):
        return type(value).__name__
    if depth <= 0:
        return None
    if isinstance(value, dict):
        items: Iterable[Any] = value.values()
    elif isinstance(value, list | tuple | set | frozenset | deque):
        items = value
    else:
        return None
    for item in items:
        # Token lists are most of what is scanned: skip scalars without a call.
        if type(item) in _SCALARS:
            continue
        hit = find_modality(item, depth - 1)
        if hit is not None:
            return hit
    return None


_SCALARS = frozenset({int, float, str, bytes, bool, type(None)})


class RecordingSink:
    """The scheduler's outbox, recording who called ``send`` (C-21).

    A send whose call stack holds a frame of ``omni_runtime/worker`` or ``omni_runtime/models``
    is a worker choosing a destination; it is recorded as a violation and still delivered, so the
    lock-step comparison is unaffected.
    """

    def __init__(self) -> None:
        self._chunks: deque[Any] = deque()
        self.violations: list[str] = []
        self.sent = 0

    def send(self, chunk: Any) -> None:
        self.sent += 1
        frame = sys._getframe(1)
        while frame is not None:
            fname = frame.f_code.co_filename
            if fname.startswith(WORKER_CODE):
                self.violations.append(
                    f"C-21: chunk {chunk.ref} sent from {Path(fname).name}:{frame.f_code.co_name}"
                )
                break
            frame = frame.f_back
        self._chunks.append(chunk)

    def drain(self) -> list[Any]:
        out = list(self._chunks)
        self._chunks.clear()
        return out

    def __len__(self) -> int:
        return len(self._chunks)


class CheckingExecutor:
    """Wraps a side's executor: results must cover exactly the scheduled requests (C-20, C-51).

    Problems are collected, not raised: the harness turns an executor exception into an observed
    "exception" on that side, and identical exceptions on both sides would compare equal.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.problems: list[str] = []
        self.calls = 0

    def execute(self, so: Any) -> Any:
        self.calls += 1
        out = self.inner.execute(so)
        expected = list(so.num_scheduled_tokens) if so.total_num_scheduled_tokens else []
        got = list(out.req_ids)
        if got != expected:
            self.problems.append(f"C-20: scheduled {expected}, worker returned {got}")
        elif len(out.sampled_token_ids) != len(got):
            self.problems.append(
                f"C-20: {len(got)} requests but {len(out.sampled_token_ids)} sampled lists"
            )
        elif dict(out.req_id_to_index) != {rid: i for i, rid in enumerate(got)}:
            self.problems.append(f"C-20: req_id_to_index {dict(out.req_id_to_index)} out of order")
        payloads = getattr(out, "omni_payloads", None)
        if payloads is not None:
            if len(payloads) != len(got):
                self.problems.append(f"C-51: {len(payloads)} payload slots for {len(got)} requests")
            else:
                for rid, p in zip(got, payloads, strict=True):
                    if p is not None and p.request_id != rid:
                        self.problems.append(f"C-51: slot of {rid} holds {p.request_id}'s payload")
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# ---- the audited session ------------------------------------------------------------------


@dataclass
class RequestLedger:
    prompt: list[int]
    emitted: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    aborted: bool = False


class AuditedLockstep(Lockstep):
    """``Lockstep`` plus the per-operation audits and the chunk ledger (module docstring)."""

    def __init__(self, config: HarnessConfig, subject: Any, *, audits: bool = True, **kw: Any):
        super().__init__(config, subject, **kw)
        self.audits = audits
        self.ledger: dict[str, RequestLedger] = {}
        self.problems: list[str] = []
        self.checkers: list[CheckingExecutor] = []
        for side in (self.up, self.sub):
            checker = CheckingExecutor(side.executor)
            side.executor = checker
            side.driver.executor = checker
            self.checkers.append(checker)
        self.sink: RecordingSink | None = None
        transfer = getattr(self.sub.scheduler, "transfer", None)
        if transfer is not None:
            self.sink = RecordingSink()
            transfer.sink = self.sink

    # The recorder hands sessions an ``apply``; every op (including the drain's) passes here.
    def apply(self, op: Any) -> Any:
        live_before = set(self.sub.scheduler.requests)
        result = super().apply(op)
        if isinstance(op, AddRequest) and op.request_id in self.sub.scheduler.requests:
            self.ledger[op.request_id] = RequestLedger(self.trace.prompt_of(op))
        elif isinstance(op, Abort):
            for rid in op.request_ids:
                if rid in live_before and rid in self.ledger:
                    self.ledger[rid].aborted = True
        if isinstance(op, Step) and self._last_up is not None:
            for key, out in (self._last_up.get("outputs") or {}).items():
                entry = self.ledger.get(key.split("#", 1)[0])
                if entry is None:
                    continue
                entry.emitted.extend(out["new_token_ids"])
                if out.get("finish_reason") is not None:
                    entry.finish_reason = out["finish_reason"]
        if self.failure is None and self.audits:
            self.problems.extend(self.audit())
        return result

    def audit(self) -> list[str]:
        problems: list[str] = []
        for checker in self.checkers:
            problems.extend(checker.problems)
            checker.problems.clear()
        if self.sink is not None:
            problems.extend(self.sink.violations)
            self.sink.violations.clear()
        problems.extend(audit_requests(self.up.scheduler, self.sub.scheduler))
        problems.extend(audit_scheduler(self.up.scheduler, self.sub.scheduler))
        return problems

    def shutdown(self) -> None:
        for side in (self.up, self.sub):
            inner = getattr(side.executor, "inner", side.executor)
            shutdown = getattr(inner, "shutdown", None)
            if shutdown is not None:
                shutdown()


def audit_requests(up_sched: Any, sub_sched: Any) -> list[str]:
    """C-10..C-12 over every live request of the subject."""
    from omni_runtime.adapters import DECLARED_REQUEST_ATTRIBUTES, OmniRequestState, omni_state_of

    declared = set(DECLARED_REQUEST_ATTRIBUTES)
    problems: list[str] = []
    for rid, req in sub_sched.requests.items():
        up = up_sched.requests.get(rid)
        if up is None:
            continue
        added = set(vars(req)) - set(vars(up))
        state = omni_state_of(req)
        expected = declared if state is not None else set()
        if added != expected:
            problems.append(
                f"C-12: {rid}: attributes added to the upstream Request are {sorted(added)}, "
                f"declared {sorted(expected)}"
            )
        if state is not None and not isinstance(state, OmniRequestState):
            problems.append(f"C-10: {rid}: omni slot holds {type(state).__name__}")
        for name, value in vars(req).items():
            if name in declared or name in UPSTREAM_TENSOR_FIELDS:
                continue
            hit = find_modality(value)
            if hit is not None:
                problems.append(f"C-11: {rid}: upstream field {name!r} holds a {hit}")
    return problems


def audit_scheduler(up_sched: Any, sub_sched: Any) -> list[str]:
    """C-11/C-12 over the scheduler object: added attributes, and tensors outside the send path."""
    problems: list[str] = []
    up_attrs = set(vars(up_sched))
    added = set(vars(sub_sched)) - up_attrs
    declared = declared_scheduler_attributes()
    if not added <= declared:
        problems.append(f"C-12: scheduler attributes {sorted(added - declared)} are not declared")
    for name, value in vars(sub_sched).items():
        if name in SEND_PATH_ATTRIBUTES or name == "requests":
            continue
        hit = find_modality(value, depth=2)
        if hit is not None:
            problems.append(f"C-11: scheduler field {name!r} holds a {hit}")
    transfer = getattr(sub_sched, "transfer", None)
    if transfer is not None:
        hit = find_modality(getattr(transfer, "progress", {}), depth=2)
        if hit is not None:
            problems.append(f"C-11: transfer progress holds a {hit}")
    return problems


# ---- the chunk ledger (teardown) ----------------------------------------------------------

_REFERENCE_ROWS: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}


def reference_hidden(model_path: str, tokens: list[int]) -> torch.Tensor:
    """Final-normed hidden rows of ``tokens`` by full recompute (no paging, no cache)."""
    key = (model_path, tuple(tokens))
    if key not in _REFERENCE_ROWS:
        from omni_runtime.models import reference_attention

        model = shared_model(model_path)
        with torch.inference_mode():
            ids = torch.tensor(tokens, dtype=torch.long)
            rows = model.forward_layers(
                model.embed(ids),
                torch.arange(len(tokens)),
                lambda _i, q, k, v: reference_attention(q, k, v),
            )
        _REFERENCE_ROWS[key] = rows
    return _REFERENCE_ROWS[key]


def ledger_problems(session: AuditedLockstep, feature: Feature) -> list[str]:
    """The teardown checks of the chunk ledger (C-30, C-31, C-40, C-42..C-45, C-51, C-55)."""
    problems: list[str] = []
    if not feature.stage:
        return problems
    stage = feature.stage
    chunks_by_req: dict[str, list[Any]] = {}
    for chunk in session.sub.chunks:
        chunks_by_req.setdefault(chunk.request_id, []).append(chunk)
    streams_codec = (stage.get("chunk_processor") or "").endswith("CodecTokenStreamer")
    include_hidden = stage.get("omni_pooler_payload_include_hidden", True)
    for rid, entry in session.ledger.items():
        facts = session.facts.get(rid, {})
        chunks = sorted(chunks_by_req.pop(rid, []), key=lambda c: c.seq)
        if not facts.get("has_downstream"):
            if chunks:
                problems.append(
                    f"C-42: {rid} is final at this stage but sent {len(chunks)} chunk(s)"
                )
            continue
        finals = [c for c in chunks if c.is_final]
        if len(finals) != 1 or not chunks[-1].is_final:
            problems.append(
                f"C-43: {rid} ({'aborted' if entry.aborted else entry.finish_reason}) got "
                f"{len(finals)} EOF deliveries in {len(chunks)} chunks"
            )
        if [c.seq for c in chunks] != list(range(len(chunks))):
            problems.append(f"C-43: {rid}: chunk seqs {[c.seq for c in chunks]} not 0..n-1")
        if streams_codec:
            got: list[int] = []
            for c in chunks:
                if isinstance(c.data, torch.Tensor):
                    got.extend(int(t) for t in c.data.tolist())
            want = [t for t in entry.emitted if 0 <= t < CODEC_VOCAB]
            if got != want:
                problems.append(
                    f"C-40/C-44/C-45: {rid}: streamed codec ids {got[:12]}.. != accepted ids "
                    f"{want[:12]}.. ({len(got)} vs {len(want)})"
                )
        if feature.use_worker:
            problems.extend(_payload_problems(session, rid, entry, chunks, include_hidden))
    for rid in chunks_by_req:
        problems.append(f"C-42/C-43: chunks for unknown request {rid}")
    return problems


def _payload_problems(
    session: AuditedLockstep,
    rid: str,
    entry: RequestLedger,
    chunks: list[Any],
    include_hidden: bool,
) -> list[str]:
    problems: list[str] = []
    model_path = session.config.model
    tokens = entry.prompt + entry.emitted
    prompt_len = len(entry.prompt)
    conds = [
        c.payload.conditioning
        for c in chunks
        if c.payload is not None and c.payload.conditioning is not None
    ]
    prefill_done = bool(entry.emitted)
    if prefill_done and len(conds) != 1:
        problems.append(f"C-31: {rid}: {len(conds)} prefill conditionings delivered, expected 1")
    if conds and len(tokens) >= prompt_len:
        ref = reference_hidden(model_path, tokens)[prompt_len - 1]
        if not torch.allclose(conds[0], ref, atol=1e-4, rtol=1e-4):
            problems.append(
                f"C-31/C-51: {rid}: conditioning is not the row of position {prompt_len - 1}"
            )
    hidden_chunks = [c for c in chunks if c.payload is not None and c.payload.hidden is not None]
    if not include_hidden:
        if any(c.payload.hidden.shape[0] > 0 for c in hidden_chunks):
            problems.append(f"C-30: {rid}: token-only stage delivered hidden rows")
        return problems
    end = 0
    for c in hidden_chunks:
        p = c.payload
        rows = p.hidden
        if rows.shape[0] == 0:
            continue
        if p.start != end:
            clause = "C-45" if p.start < end else ("C-55" if end == 0 else "C-51")
            problems.append(
                f"{clause}: {rid}: chunk {c.seq} starts at position {p.start}, expected {end}"
            )
            return problems
        stop = p.start + rows.shape[0]
        if stop > len(tokens):
            problems.append(f"C-51: {rid}: rows up to {stop} but only {len(tokens)} tokens")
            return problems
        # Causal: the rows of a prefix do not depend on later tokens, so one recompute serves.
        ref = reference_hidden(model_path, tokens)[p.start : stop]
        if not torch.allclose(rows, ref, atol=1e-4, rtol=1e-4):
            problems.append(
                f"C-51/C-52: {rid}: rows [{p.start}, {stop}) differ from the reference by "
                f"{float((rows - ref).abs().max()):.3g}"
            )
            return problems
        end = stop
    if entry.finish_reason is not None and not entry.aborted and end != len(tokens) - 1:
        problems.append(
            f"C-51/C-55: {rid}: hidden rows cover [0, {end}), expected [0, {len(tokens) - 1})"
        )
    return problems


# ---- Hugging Face reference (C-08) ---------------------------------------------------------

_HF: dict[str, Any] = {}
_HF_GREEDY: dict[tuple[int, ...], list[int]] = {}


def hf_greedy(model_path: str, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by ``transformers.LlamaForCausalLM`` (eager attention, recompute)."""
    key = tuple(prompt)
    have = _HF_GREEDY.get(key, [])
    if len(have) < n:
        if model_path not in _HF:
            from transformers import LlamaForCausalLM

            _HF[model_path] = LlamaForCausalLM.from_pretrained(
                model_path, attn_implementation="eager", dtype=torch.float32
            ).eval()
        hf = _HF[model_path]
        ids = list(prompt) + have
        with torch.no_grad():
            while len(ids) - len(prompt) < n:
                logits = hf(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
        have = ids[len(prompt) :]
        _HF_GREEDY[key] = have
    return have[:n]


def hf_problems(session: AuditedLockstep) -> list[str]:
    problems = []
    for rid, entry in session.ledger.items():
        if not entry.emitted:
            continue
        want = hf_greedy(session.config.model, entry.prompt, len(entry.emitted))
        if entry.emitted != want:
            problems.append(f"C-08: {rid}: runtime {entry.emitted} != Hugging Face {want}")
    return problems


# ---- recorders and machines ---------------------------------------------------------------


class LocalRecorder:
    """What the plugin's ``conformance`` recorder offers, for runs outside a pytest test."""

    def __init__(self, subject: Any) -> None:
        self.subject = subject
        self.sessions: list[Any] = []
        self.examples = 0
        self.steps_compared = 0

    def fail(self, session: Any, name: str, *, do_shrink: bool = True) -> None:
        assert session.failure is not None
        raise SubjectBroken(session.failure)

    def total_steps(self) -> int:
        return self.steps_compared + sum(s.steps_compared for s in self.sessions)


def open_session(
    recorder: Any, config: HarnessConfig, subject: Any, *, use_worker: bool, audits: bool = True
) -> AuditedLockstep:
    """An audited session registered with ``recorder`` so its steps are counted."""
    session = AuditedLockstep(
        config, subject, prefixes=PREFIXES, use_worker=use_worker, audits=audits
    )
    recorder.sessions.append(session)
    recorder.examples += 1
    return session


class InvariantMachine(LockstepMachine):
    """``LockstepMachine`` over an ``AuditedLockstep``; see the module docstring."""

    subject: Any = None
    feature: Feature = Feature("off")
    check_hf: bool = False
    # Set on every run so the mutant self-test can read the failing program's length (rules).
    last_ops: int = 0

    def __init__(self) -> None:
        # The base constructor opens a plain session; this one opens an audited one instead.
        RuleBasedStateMachine.__init__(self)
        self.session = open_session(
            self.recorder, self.config, self.subject, use_worker=self.feature.use_worker
        )
        self.counter = 0
        self.ended: list[str] = []
        # Rules run so far: hypothesis checks invariants once before the first rule and after
        # every rule, so this counts the program's operations as hypothesis prints them.
        self.rules_run = -1
        type(self).last_ops = 0

    @precondition(lambda self: self.counter > 0)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        known = [f"r{i}" for i in range(self.counter)]
        ids = data.draw(st.lists(st.sampled_from(known), min_size=1, max_size=3, unique=True))
        if PINNED_HASH_SEED:
            self.session.apply(Abort(tuple(ids)))
            return
        # vLLM's finish_requests frees a multi-id abort in set order, i.e. in an order that
        # depends on PYTHONHASHSEED, and the free order steers later prefix hits and hence step
        # counts. Unless the seed is pinned, abort the subset one id at a time (same ids, same
        # step), so verdicts and step counts are identical run to run.
        for rid in ids:
            if self.session.failure is not None:
                return
            self.session.apply(Abort((rid,)))

    def _fail_on_problems(self) -> None:
        self.rules_run += 1
        type(self).last_ops = max(self.rules_run, 0)
        if self.session.problems:
            raise AssertionError(_describe(self.session, self.session.problems))

    def check_invariants(self, settings: Any, output: Any, runtimes: Any) -> None:
        # Runs after every rule (hypothesis calls it), before the registered @invariants.
        self._fail_on_problems()
        super().check_invariants(settings, output, runtimes)

    def teardown(self) -> None:
        try:
            if self.session.failure is None and not self.session.problems:
                self.session.drain()
                if self.session.failure is not None:
                    self.recorder.fail(self.session, self.name, do_shrink=False)
                problems = list(self.session.problems)
                problems += self.session.conservation_problems()
                problems += ledger_problems(self.session, self.feature)
                if self.check_hf:
                    problems += hf_problems(self.session)
                if problems:
                    raise AssertionError(_describe(self.session, problems))
        finally:
            self.session.shutdown()


def _describe(session: Lockstep, problems: list[str]) -> str:
    ops = "\n".join(f"  {i}: {op.describe()}" for i, op in enumerate(session.trace.ops[-60:]))
    return (
        f"{problems[0]}"
        + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "")
        + (f"\nprogram ({len(session.trace.ops)} ops, last 60 shown):\n{ops}")
    )


def machine_class(
    recorder: Any,
    config: HarnessConfig,
    feature: Feature,
    *,
    subject: Any = None,
    check_hf: bool = False,
    name: str | None = None,
) -> type[InvariantMachine]:
    label = name or f"inv-{feature.name}"
    return type(
        f"Invariant_{label.replace('-', '_')}",
        (InvariantMachine,),
        {
            "recorder": recorder,
            "config": config,
            "feature": feature,
            "final_stages": feature.final_stages,
            "subject": subject if subject is not None else WorkerSubject(),
            "check_hf": check_hf,
            "name": label,
        },
    )


def examples(at_ci: int) -> int:
    """``at_ci`` examples under the ``ci`` profile, scaled with the loaded profile (``thorough``
    runs ten times as many), so the suite's budget is set here, per property."""
    try:
        from conformance.plugin import CI_EXAMPLES
    except ImportError:  # pragma: no cover - the plugin ships with the harness
        CI_EXAMPLES = 20
    return max(1, round(at_ci * settings.default.max_examples / CI_EXAMPLES))


def suite_settings(at_ci: int, **kw: Any) -> settings:
    """The loaded profile with this property's example count (and no example database)."""
    return settings(settings.default, max_examples=examples(at_ci), database=None, **kw)


@dataclass
class MachineOutcome:
    error: BaseException | None
    ops: int


def run_machine(
    machine: type[InvariantMachine], run_settings: settings | None = None
) -> MachineOutcome:
    """Run a machine as a test; return the failure (if any) and its program's length in ops."""
    try:
        run_state_machine_as_test(machine, settings=run_settings)
    except (AssertionError, SubjectBroken, Exception) as exc:  # noqa: B014 - report any failure
        return MachineOutcome(exc, machine.last_ops)
    return MachineOutcome(None, machine.last_ops)


def ops_of(session: Lockstep) -> list[Any]:
    return [op for op in session.trace.ops if not isinstance(op, DeliverChunks)]


def main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


ProblemCheck = Callable[[AuditedLockstep], list[str]]


# ---- runner-level driving (C-22, C-30, C-31, C-50..C-54) -----------------------------------


class RunnerExec:
    """Drives a model runner as the uni executor does; ``after_sample`` runs between
    ``sample_tokens`` returning and the output being collected (where C-52 scribbles)."""

    def __init__(self, runner: Any, after_sample: Callable[[Any], None] | None = None) -> None:
        self.runner = runner
        self.after_sample = after_sample

    def execute(self, so: Any) -> Any:
        out = self.runner.execute_model(so)
        if out is None:
            out = self.runner.sample_tokens(None)
            if self.after_sample is not None:
                self.after_sample(self.runner)
        get = getattr(out, "get_output", None)
        return get() if get is not None else out


def drive_runners(
    workload: list[Any],
    cfg: HarnessConfig,
    execs: list[Any],
    on_step: Callable[[int, Any, Any, list[Any]], None],
    *,
    subject: Any = None,
    max_steps: int = 200,
) -> int:
    """Upstream's scheduler schedules ``workload``; every executor runs each ``SchedulerOutput``
    (the first one's result updates the scheduler); ``on_step(step, scheduler, so, outputs)``
    checks them. Returns the number of steps."""
    from vllm.v1.request import RequestStatus

    from conformance.subjects import UpstreamSubject
    from invariants.strategies import job_prompt

    subject = subject or WorkerSubject()
    sched = UpstreamSubject().build_scheduler(cfg.with_(additional_config={}))
    for i, job in enumerate(workload):
        prompt = job_prompt(i, job)
        op = AddRequest(f"j{i}", tuple(prompt), max_tokens=job.max_tokens)
        sched.add_request(UpstreamSubject().make_request(op, prompt, cfg, sched, float(i)))
    steps = 0
    while sched.has_requests() and steps < max_steps:
        for i, job in enumerate(workload):
            if job.abort_after == steps and f"j{i}" in sched.requests:
                sched.finish_requests([f"j{i}"], RequestStatus.FINISHED_ABORTED)
        so = sched.schedule()
        outs = [e.execute(so) for e in execs]
        on_step(steps, sched, so, outs)
        sched.update_from_output(so, outs[0])
        steps += 1
    return steps
