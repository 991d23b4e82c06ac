"""C-62 at one stage: every request that enters it ends with exactly one terminal outcome.

A lock-step session feeds this ledger what the *subject* did (its outputs after each step, the
state each aborted id was in on the subject's side), so the verdict is about the subject alone and
does not lean on the comparison with upstream (C-07). A request's terminal outcome is one of:

* a finished output: an ``EngineCoreOutput`` whose ``finish_reason`` is set (``stop``,
  ``length``, ``error`` when the subject failed it, ...);
* a client abort of a request the subject still held unfinished (waiting, running, preempted or
  with a step in flight): the client ended it, so it knows. A single ``abort`` output afterwards
  acknowledges that abort and is the same outcome, not a second one.

Problems, each starting with ``C-62``: a second terminal outcome for a request (reported at the
operation that produced it, so the clause, not a downstream difference, names the defect); and,
once the workload has drained, a request the stage accepted that never got an outcome.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from conformance._core import vllm_compat as vc

# Abort states (``conformance._core.sides.Side.abort_state``) in which the abort ends the request;
# in the others it finished already (its finished output is, or will be, its outcome) or is gone.
ENDS_REQUEST = frozenset({"waiting", "running", "in_flight", "preempted"})
CLIENT_ABORT = "client abort"
# A streaming session waiting for input whose client closed the stream: vLLM finishes it as
# aborted, with no output.
STREAM_ENDED = "stream ended"


class TerminalOutcomes:
    """Per request the stage accepted: the terminal outcomes seen so far, in order."""

    def __init__(self) -> None:
        self.outcomes: dict[str, list[str]] = {}
        self._acknowledged: set[str] = set()
        self.problems: list[str] = []

    def entered(self, request_id: str) -> None:
        self.outcomes.setdefault(request_id, [])

    def aborted(self, request_id: str, state: str) -> None:
        seen = self.outcomes.get(request_id)
        if seen is not None and not seen and state in ENDS_REQUEST:
            seen.append(CLIENT_ABORT)

    def stream_ended(self, request_id: str) -> None:
        seen = self.outcomes.get(request_id)
        if seen is not None and not seen:
            seen.append(STREAM_ENDED)

    def emitted(
        self,
        outputs: Mapping[str, Mapping[str, Any]],
        where: str,
        continuing: Collection[str] = (),
    ) -> None:
        """One step's outputs (``conformance._core.observe.observe_outputs``: ``<id>`` or
        ``<id>#n``); ``continuing``: streaming sessions whose turn ended and which go on (their
        finish reason ends the turn, not the request)."""
        for key, out in outputs.items():
            reason = out.get("finish_reason")
            rid = key.split("#", 1)[0]
            seen = self.outcomes.get(rid)
            if reason is None or seen is None or rid in continuing:
                continue
            if seen == [CLIENT_ABORT] and reason == "abort" and rid not in self._acknowledged:
                self._acknowledged.add(rid)
                continue
            if seen:
                self.problems.append(
                    f"C-62: {rid} got a second terminal outcome at {where}: finished "
                    f"({reason}) after {', '.join(seen)}"
                )
            seen.append(f"finished ({reason})")

    def take(self) -> list[str]:
        """The problems found since the last call."""
        found, self.problems = self.problems, []
        return found

    def drained_problems(self) -> list[str]:
        """After the drain: every accepted request has its outcome."""
        return [
            f"C-62: {rid} entered this stage but ended with no terminal outcome (no finished "
            "output and no abort) once the workload drained"
            for rid, seen in self.outcomes.items()
            if not seen
        ]


@dataclass
class Outcome:
    """What the engine's caller received over a run, per request: the tokens, the finish
    reasons of its terminal outputs, in order, and the failure cause a subject gave (the
    output's ``cause_field``, ``FaultContainment.cause_field``)."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    terminal: dict[str, list[str]] = field(default_factory=dict)
    causes: dict[str, str] = field(default_factory=dict)
    steps: int = 0
    # The trace headers each request was sent with (``admitted``), and the distinct ones its
    # outputs carried (sorted pairs, None for none).
    sent: dict[str, tuple[tuple[str, str], ...] | None] = field(default_factory=dict)
    carried: dict[str, set[tuple[tuple[str, str], ...] | None]] = field(default_factory=dict)
    # The chunks each request sent downstream (``ChunkView``s), for a subject that delivers them.
    chunks: dict[str, list[Any]] = field(default_factory=dict)

    def admitted(self, op: Any) -> None:
        """Note an ``AddRequest`` the run admits (its trace headers, for ``header_problems``)."""
        headers = op.trace_headers  # in the form ``vc.output_trace_headers`` reads an output's
        self.sent[op.request_id] = None if headers is None else tuple(sorted(headers))

    def record_chunks(self, subject: Any, scheduler: Any) -> None:
        """The chunks the step sent (``Subject.drain_chunks``), where the subject delivers any."""
        delivery = subject.chunk_delivery()
        if delivery is None:
            return
        for chunk in subject.drain_chunks(scheduler):
            view = delivery.view(chunk)
            self.chunks.setdefault(view.request_id, []).append(view)

    def chunk_problems(self, final_here: Mapping[str, bool], clause: str) -> list[str]:
        """C-42/C-43 over the run: a request that ends at this stage sent no chunk; every other
        one exactly one EOF, as its last chunk, its chunks numbered from 0 (under ``clause``, the
        clause that makes the request's end go downstream)."""
        problems = []
        for rid in self.terminal:
            views = sorted(self.chunks.get(rid, []), key=lambda v: v.seq)
            if final_here.get(rid):
                if views:
                    problems.append(f"C-42: {rid} ends at this stage, yet sent {len(views)} chunks")
                continue
            ends = [v for v in views if v.is_final]
            how = " (it failed)" if self.terminal[rid] == ["error"] else ""
            if len(ends) != 1 or not views[-1].is_final:
                problems.append(f"{clause}: {rid}{how} got {len(ends)} EOF chunks of {len(views)}")
            elif [v.seq for v in views] != list(range(len(views))):
                problems.append(
                    f"{clause}: {rid}{how}'s chunks are numbered {[v.seq for v in views]}"
                )
        return problems

    def record(self, outputs: Mapping[int, Any] | None, cause_field: str) -> None:
        """One step's outputs (``Subject.receive_outputs``'s result)."""
        for eco in (outputs or {}).values():
            for out in eco.outputs:
                self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                self.carried.setdefault(out.request_id, set()).add(vc.output_trace_headers(out))
                if out.finish_reason is not None:
                    reason = getattr(out.finish_reason, "name", str(out.finish_reason))
                    self.terminal.setdefault(out.request_id, []).append(str(reason).lower())
                    cause = getattr(out, cause_field, None)
                    if cause:
                        self.causes[out.request_id] = str(cause)

    def header_problems(self, clause: str) -> list[str]:
        """Requests some output of which did not carry the trace headers the request was sent
        with. Upstream copies a request's headers onto every output it makes for it, so a
        client's tracing context reaches every output, an error that fails the request included.
        """
        return [
            f"{clause}: an output of {rid} carried trace headers {sorted(got, key=repr)} but the "
            f"request was sent with {self.sent[rid]}: upstream puts a request's trace headers on "
            "every output it makes for it"
            for rid, got in self.carried.items()
            if rid in self.sent and got != {self.sent[rid]}
        ]
