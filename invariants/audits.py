"""Run-time audits of the subject side of a lock-step session (AR-INV-002, AR-INV-003).

Each audit reads only what the subject declared (``conformance._core.capabilities``):

* ``audit_requests`` / ``audit_scheduler`` (``DeclaredAttributes``) — declared slots only, each
  of its declared type, and no tensor or payload reachable outside the send path (C-10..C-12);
* ``CheckingExecutor`` — results for exactly the scheduled requests, in order, and one payload
  slot per request that belongs to it (C-20, C-51);
* ``RecordingSink`` (``ChunkDelivery``, ``SourceLayout.worker_roots``) — no send from worker or
  model code (C-21);
* ``crossing_problems`` / ``leftover_problems`` (``ProcessBoundary``) — what crossed a process
  boundary arrived as sent, and nothing of the crossing is held between operations (C-46).

Problems are strings that start with their clause id; the machines raise them. The clauses:
docs/contracts.md; how the suite uses the audits: docs/design.md, "How the suite checks".
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from conformance._core.capabilities import DeclaredAttributes, PayloadView
from conformance._core.driver import Deferred, Executor, collect, submit

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import ModelRunnerOutput

    from conformance._core.capabilities import Crossing
    from conformance._core.sides import AttributeNames

_SCALARS = frozenset({int, float, str, bytes, bool, type(None)})


def find_modality(value: Any, kinds: tuple[type, ...], depth: int = 3) -> str | None:
    """A short description of the first tensor / payload reachable through plain containers."""
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
        hit = find_modality(item, kinds, depth - 1)
        if hit is not None:
            return hit
    return None


def modality_kinds(declared: DeclaredAttributes) -> tuple[type, ...]:
    return (torch.Tensor, np.ndarray, *declared.modality_types)


def audit_requests(
    upstream: AttributeNames, sub_sched: Scheduler, declared: DeclaredAttributes
) -> list[str]:
    """C-10..C-12 over every live request of the subject, against the attribute names of the
    oracle's request of the same id (``upstream``: read in this process or sent by the oracle's)."""
    kinds = modality_kinds(declared)
    problems: list[str] = []
    for rid, req in sub_sched.requests.items():
        up = upstream.requests.get(rid)
        if up is None:
            continue
        added = set(vars(req)) - up
        undeclared = added - set(declared.request)
        if undeclared:
            problems.append(
                f"C-12: {rid}: attributes added to the upstream Request are {sorted(added)}, "
                f"declared {sorted(declared.request)}"
            )
        for name in sorted(added & set(declared.request)):
            value = getattr(req, name)
            if value is not None and not isinstance(value, declared.request[name]):
                problems.append(f"C-10: {rid}: slot {name!r} holds {type(value).__name__}")
        for name, value in vars(req).items():
            if name in declared.request or name in declared.upstream_tensor_fields:
                continue
            hit = find_modality(value, kinds)
            if hit is not None:
                problems.append(f"C-11: {rid}: upstream field {name!r} holds a {hit}")
    return problems


def audit_scheduler(
    upstream: AttributeNames, sub_sched: Scheduler, declared: DeclaredAttributes
) -> list[str]:
    """C-11/C-12 over the scheduler object: added attributes, and tensors outside the send path."""
    kinds = modality_kinds(declared)
    problems: list[str] = []
    added = set(vars(sub_sched)) - upstream.scheduler
    if not added <= declared.scheduler:
        problems.append(
            f"C-12: scheduler attributes {sorted(added - declared.scheduler)} are not declared"
        )
    for name, value in vars(sub_sched).items():
        if name in declared.send_path or name == "requests":
            continue
        hit = find_modality(value, kinds, depth=2)
        if hit is not None:
            problems.append(f"C-11: scheduler field {name!r} holds a {hit}")
    return problems


class RecordingSink:
    """The subject's outbox, recording who called ``send`` (C-21).

    A send whose call stack holds a frame from one of ``worker_roots`` is a worker choosing a
    destination; it is recorded as a violation and still delivered, so the lock-step comparison
    is unaffected.
    """

    def __init__(self, worker_roots: Iterable[Path], describe: Callable[[Any], str]) -> None:
        self._roots = tuple(str(Path(r)) + "/" for r in worker_roots)
        self._describe = describe
        self._chunks: deque[Any] = deque()
        self.violations: list[str] = []
        self.sent = 0
        # The chunks sent since the machine last took them (``take_recent``): one operation's.
        self.recent: list[Any] = []

    def send(self, chunk: Any) -> None:
        self.sent += 1
        if self._roots:
            frame = sys._getframe(1)
            while frame is not None:
                fname = frame.f_code.co_filename
                if fname.startswith(self._roots):
                    self.violations.append(
                        f"C-21: chunk {self._describe(chunk)} sent from "
                        f"{Path(fname).name}:{frame.f_code.co_name}"
                    )
                    break
                frame = frame.f_back
        self._chunks.append(chunk)
        self.recent.append(chunk)

    def take_recent(self) -> list[Any]:
        out, self.recent = self.recent, []
        return out

    def drain(self) -> list[Any]:
        out = list(self._chunks)
        self._chunks.clear()
        return out

    def __len__(self) -> int:
        return len(self._chunks)


def chunk_ref_problems(
    delivery: Any, outputs: Mapping[str, Any], chunks: Sequence[Any], where: str
) -> list[str]:
    """C-43: a step's output of a request names exactly the chunks that step delivered for it,
    for a subject whose outputs name chunks (``ChunkDelivery.output_refs_field`` and ``ref``,
    optional), and, with ``output_eof_field``, flags the step that delivered its EOF: the next
    stage finds a request's chunks, and its end, through them. Requests without an output
    in the step (an EOF after an abort or a free) are not asked, nor is a request the step
    failed: its error output reports the failure (C-61) and names no chunk."""
    field_name = getattr(delivery, "output_refs_field", None)
    ref = getattr(delivery, "ref", None)
    if field_name is None or ref is None:
        return []
    eof_field = getattr(delivery, "output_eof_field", None)
    delivered: dict[str, set[str]] = {}
    ended: set[str] = set()
    for chunk in chunks:
        view = delivery.view(chunk)
        delivered.setdefault(view.request_id, set()).add(ref(chunk))
        if view.is_final:
            ended.add(view.request_id)
    named: dict[str, set[str]] = {}
    flagged: set[str] = set()
    failed: set[str] = set()
    for key, out in outputs.items():
        rid = key.split("#", 1)[0]
        named.setdefault(rid, set()).update(out.get(field_name) or ())
        if eof_field is not None and out.get(eof_field):
            flagged.add(rid)
        if str(out.get("finish_reason")).lower() == "error":
            failed.add(rid)
    problems = [
        f"C-43: {where}: {rid}'s output names chunks {sorted(refs)}, "
        f"the step delivered {sorted(delivered.get(rid, set()))}"
        for rid, refs in sorted(named.items())
        if rid not in failed and refs != delivered.get(rid, set())
    ]
    if eof_field is not None:
        problems += [
            f"C-43: {where}: {rid}'s output says {eof_field}={rid in flagged}, the step "
            f"{'delivered' if rid in ended else 'did not deliver'} its EOF"
            for rid in sorted(named)
            if rid not in failed and (rid in flagged) != (rid in ended)
        ]
    return problems


PayloadReader = Callable[[Any], "list[PayloadView | None] | None"]


class CheckingExecutor:
    """Wraps a side's executor: results must cover exactly the scheduled requests (C-20, C-51).

    Problems are collected, not raised: the harness turns an executor exception into an observed
    "exception" on that side, and identical exceptions on both sides would compare equal.
    """

    def __init__(self, inner: Executor, payloads: PayloadReader | None = None) -> None:
        self.inner = inner
        self.payloads = payloads
        self.problems: list[str] = []
        self.calls = 0

    def submit(self, so: SchedulerOutput) -> object:
        """The inner executor's step, checked when the driver collects it (a worker's async
        output is collected a step later under async scheduling, as in vLLM)."""
        self.calls += 1
        pending = submit(self.inner, so)
        if getattr(pending, "get_output", None) is None:
            return self._checked(so, cast("ModelRunnerOutput", pending))
        return Deferred(lambda: self._checked(so, collect(pending)))

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return collect(self.submit(so))

    def _checked(self, so: SchedulerOutput, out: ModelRunnerOutput) -> ModelRunnerOutput:
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
        slots = self.payloads(out) if self.payloads is not None else None
        if slots is not None:
            if len(slots) != len(got):
                self.problems.append(f"C-51: {len(slots)} payload slots for {len(got)} requests")
            else:
                for rid, p in zip(got, slots, strict=True):
                    if p is not None and p.request_id != rid:
                        self.problems.append(f"C-51: slot of {rid} holds {p.request_id}'s payload")
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# ---- what crosses a process boundary (C-46) -------------------------------------------------


def tensor_difference(a: torch.Tensor, b: torch.Tensor) -> str | None:
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} became {b.dtype}"
    if tuple(a.shape) != tuple(b.shape):
        return f"shape {tuple(a.shape)} became {tuple(b.shape)}"
    # Bit for bit: the bytes, so that -0.0, NaN payloads and the last mantissa bit count.
    x = a.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    y = b.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    if not torch.equal(x, y):
        first = int((x != y).nonzero()[0, 0])
        return f"bytes differ (first at byte {first} of {x.numel()})"
    return None


def same_scalar(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and a != a:
        return b != b
    return bool(a == b)


def crossing_problems(crossings: Iterable[Crossing]) -> list[str]:
    """C-46: each crossing's received fields equal its sent fields (tensors bit for bit, with
    their dtype and shape; scalars with their type)."""
    problems: list[str] = []
    for c in crossings:
        sent, received = dict(c.sent), dict(c.received)
        if not received and sent:
            problems.append(f"C-46: {c.label} was sent but never received")
            continue
        if not sent and received:
            problems.append(f"C-46: {c.label} was received but never sent")
            continue
        if set(sent) != set(received):
            lost, gained = sorted(set(sent) - set(received)), sorted(set(received) - set(sent))
            problems.append(f"C-46: {c.label}: fields lost {lost}, gained {gained} in crossing")
            continue
        for path in sorted(sent):
            a, b = sent[path], received[path]
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
                    problems.append(
                        f"C-46: {c.label}: {path} was {type(a).__name__}, arrived as "
                        f"{type(b).__name__}"
                    )
                    break
                why = tensor_difference(a, b)
                if why is not None:
                    problems.append(f"C-46: {c.label}: tensor {path}: {why}")
                    break
            elif not same_scalar(a, b):
                problems.append(f"C-46: {c.label}: {path} was {a!r}, arrived as {b!r}")
                break
    return problems


def leftover_problems(leftovers: Mapping[str, Any], when: str) -> list[str]:
    """C-46: nothing of the crossing is held between operations (``ProcessBoundary.leftovers``)."""
    held = {kind: value for kind, value in dict(leftovers).items() if value}
    if not held:
        return []
    return [f"C-46: {when}: the process boundary still holds {held}"]
