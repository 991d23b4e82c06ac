"""The chunk and payload ledger: what a lock-step session delivered downstream, checked at teardown.

During a session each request's prompt, accepted tokens and finish are recorded
(``RequestLedger``); the subject's chunks are read through its ``ChunkDelivery.view``. At
teardown the ledger checks:

* C-42 / C-43 — no chunk for a request final at this stage (or from a plain client), and for
  every other request exactly one EOF, last, with seqs ``0..n-1`` (unless its caller ends it
  downstream: ``caller_ends``, C-46);
* C-40 / C-44 / C-45 — the ids streamed equal ``ChunkDelivery.expected_tokens``, once each, in
  the groups ``expected_chunks`` says where the subject says it;
* with the real worker: C-30, C-31, C-45, C-51, C-52, C-55 against the model reference's rows,
  and C-08 (``hf_problems``), greedy tokens against the reference.

Each clause's statement: docs/contracts.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from conformance._core.capabilities import ChunkDelivery, ChunkView, Feature
from invariants.reference import CachedReference


@dataclass
class RequestLedger:
    prompt: list[int]
    # The accepted ids, one tuple per step that accepted any: the grouping a processor saw them in.
    steps: list[tuple[int, ...]] = field(default_factory=list)
    finish_reason: str | None = None
    aborted: bool = False
    # From a client that knows nothing of the runtime (``AddRequest.plain``).
    plain: bool = False

    @property
    def emitted(self) -> list[int]:
        """Every accepted id, in order."""
        return [t for ids in self.steps for t in ids]


def ledger_problems(
    session: Any,
    feature: Feature,
    delivery: ChunkDelivery,
    *,
    includes_hidden: bool | None = None,
    reference: CachedReference | None = None,
) -> list[str]:
    """The teardown checks (module docstring). ``includes_hidden`` is None without a worker."""
    problems: list[str] = []
    # False: an aborted (errored) request's end is its caller's to deliver downstream
    # (``ChunkDelivery``).
    abort_eof = bool(getattr(delivery, "abort_eof", True))
    error_eof = bool(getattr(delivery, "error_eof", True))
    views: dict[str, list[ChunkView]] = {}
    for chunk in session.sub.chunks:
        view = delivery.view(chunk)
        views.setdefault(view.request_id, []).append(view)
    for rid, entry in session.ledger.items():
        facts = session.facts.get(rid, {})
        chunks = sorted(views.pop(rid, []), key=lambda c: c.seq)
        if entry.plain:
            # Upstream's own request: the runtime must not give it a consumer downstream (its
            # facts would then claim one, and the check below would judge it by that claim).
            if chunks or facts.get("has_downstream"):
                claim = " and claims a downstream" if facts.get("has_downstream") else ""
                problems.append(
                    f"C-42: {rid} came from a client that knows nothing of the runtime, yet "
                    f"sent {len(chunks)} chunk(s){claim}"
                )
            continue
        if not facts.get("has_downstream"):
            if chunks:
                problems.append(
                    f"C-42: {rid} is final at this stage but sent {len(chunks)} chunk(s)"
                )
            continue
        finals = [c for c in chunks if c.is_final]
        ended_by = caller_ends(entry, abort_eof=abort_eof, error_eof=error_eof)
        parent_ends = ended_by is not None
        if parent_ends:
            # None owed. An error may be found in the step that also ended the request's last
            # chunk (a grammar that rejects the sampled token): then one may cross, last.
            most = 1 if ended_by == ERRORED else 0
            if len(finals) > most or (finals and not chunks[-1].is_final):
                problems.append(
                    f"C-43/C-46: {rid} was {ended_by}, and its caller ends it downstream, yet "
                    f"{len(finals)} EOF chunk(s) crossed"
                )
        elif len(finals) != 1 or not chunks[-1].is_final:
            problems.append(
                f"C-43: {rid} ({'aborted' if entry.aborted else entry.finish_reason}) got "
                f"{len(finals)} EOF deliveries in {len(chunks)} chunks"
            )
        if [c.seq for c in chunks] != list(range(len(chunks))):
            problems.append(f"C-43: {rid}: chunk seqs {[c.seq for c in chunks]} not 0..n-1")
        want = delivery.expected_tokens(feature, entry.emitted)
        if want is not None:
            got = [t for c in chunks for t in (c.token_ids or ())]
            if parent_ends:
                # What was buffered for the EOF never crosses; what crossed must be in order.
                want = want[: len(got)]
            if got != want:
                problems.append(
                    f"C-40/C-44/C-45: {rid}: streamed ids {got[:12]}.. != accepted ids "
                    f"{want[:12]}.. ({len(got)} vs {len(want)})"
                )
            else:
                problems.extend(
                    grouping_problems(delivery, feature, rid, entry, chunks, parent_ends)
                )
        if includes_hidden is not None and reference is not None:
            problems.extend(
                payload_problems(session, rid, entry, chunks, includes_hidden, reference)
            )
    for rid in views:
        problems.append(f"C-42/C-43: chunks for unknown request {rid}")
    return problems


ERRORED = "finished with an error"


def caller_ends(entry: RequestLedger, *, abort_eof: bool, error_eof: bool) -> str | None:
    """How the request ended ("aborted by its caller", ``ERRORED``) when its caller, not its
    chunks, ends it downstream (the subject declared ``abort_eof`` or ``error_eof`` False),
    else None."""
    if entry.aborted:
        return None if abort_eof else "aborted by its caller"
    if entry.finish_reason == "error" and not error_eof:
        return ERRORED
    return None


def grouping_problems(
    delivery: ChunkDelivery,
    feature: Feature,
    rid: str,
    entry: RequestLedger,
    chunks: list[ChunkView],
    parent_ends: bool,
) -> list[str]:
    """C-40: the chunks carry the id groups the subject's processor promises, in order.

    Read only once the ids themselves match, so a lost or repeated id is reported once, as such.
    A chunk without ids (a payload crossing with nothing from the processor) is not a group;
    an EOF without ids is, when the promise ends with one."""
    expected_chunks = getattr(delivery, "expected_chunks", None)
    if entry.aborted:
        last_step_ends = False
    elif entry.finish_reason in ("stop", "length"):
        last_step_ends = True
    else:
        return []  # ended by an error: no grouping is promised for what its fault cut short
    want = (
        None if expected_chunks is None else expected_chunks(feature, entry.steps, last_step_ends)
    )
    if want is None:
        return []
    got = [c.token_ids for c in chunks if c.token_ids is not None or c.is_final]
    if parent_ends:
        # The EOF belongs to the caller: the groups before it, as far as they crossed.
        want = want[: len(got)]
    if got == want:
        return []
    at = next((i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w), None)
    if at is None:
        at = min(len(got), len(want))
    seen = "nothing" if at >= len(got) else (list(got[at]) if got[at] is not None else "no ids")
    promised = "nothing" if at >= len(want) else list(want[at])
    return [
        f"C-40: {rid}: chunk {at} of its id stream carries {seen}, the processor's grouping "
        f"promises {promised} ({len(got)} chunks with ids vs {len(want)} promised, over "
        f"{len(entry.steps)} steps that accepted ids)"
    ]


def payload_problems(
    session: Any,
    rid: str,
    entry: RequestLedger,
    chunks: list[ChunkView],
    include_hidden: bool,
    reference: CachedReference,
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
    if entry.emitted and len(conds) != 1:
        problems.append(f"C-31: {rid}: {len(conds)} prefill conditionings delivered, expected 1")
    if conds and len(tokens) >= prompt_len:
        ref = reference.hidden_rows(model_path, tokens)[prompt_len - 1]
        if not torch.allclose(conds[0], ref, atol=1e-4, rtol=1e-4):
            problems.append(
                f"C-31/C-51: {rid}: conditioning is not the row of position {prompt_len - 1}"
            )
    hidden = [c for c in chunks if c.payload is not None and c.payload.hidden is not None]
    if not include_hidden:
        if any(c.payload is not None and c.payload.hidden.shape[0] > 0 for c in hidden):
            problems.append(f"C-30: {rid}: token-only stage delivered hidden rows")
        return problems
    end = 0
    for c in hidden:
        p = c.payload
        assert p is not None
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
        ref = reference.hidden_rows(model_path, tokens)[p.start : stop]
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


def hf_problems(session: Any, reference: CachedReference) -> list[str]:
    """C-08: the runtime's greedy tokens equal the subject's independent reference's."""
    problems = []
    for rid, entry in session.ledger.items():
        if not entry.emitted:
            continue
        want = reference.greedy(session.config.model, entry.prompt, len(entry.emitted))
        if entry.emitted != want:
            problems.append(f"C-08: {rid}: runtime {entry.emitted} != reference {want}")
    return problems
