"""What the harness reads and sets of vLLM's structured outputs (grammars).

The engine, not the scheduler, starts a request's grammar compiling (``init_grammar``) on the
``StructuredOutputManager``'s thread pool. A thread finishes when it finishes, so the harness
holds the pool's place with ``CompileClock`` (``hold_grammar_compilation``): it runs each
compilation, for real, in the harness's thread when the request's turn comes, zero to two
``schedule()`` calls after admission (``settle_grammars``, before each one), the same on both
sides. The reads: whether a step defers its sampling, the grammar output's bitmask rows per
request, the step's grammar facts for ``sched_out`` and each structured request's grammar state
(compiled or not, tokens accepted, terminated) for its snapshot, present only when set.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

import numpy as np

from conformance._core.vllm_compat.versions import ByRelease, Change

# A request's grammar compiles after 0, 1 or 2 ``schedule()`` calls (by its id's hash).
COMPILE_DELAYS = 3


def assign_backend(params: Any, backend: str) -> None:
    """Record ``backend`` on ``StructuredOutputsParams`` as the input processor's validation
    does (``_backend``), for parameters that skip that validation."""
    params._backend = backend


class CompileClock:
    """Stands in for the manager's compilation pool: ``submit`` queues the compilation,
    ``tick`` (before each ``schedule()``) runs those whose turn has come, in order."""

    def __init__(self) -> None:
        self.now = 0
        self.queue: list[tuple[int, Future[Any], Callable[..., Any], tuple[Any, ...]]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        request_id = getattr(args[0], "request_id", "") if args else ""
        delay = zlib.crc32(f"compile:{request_id}".encode()) % COMPILE_DELAYS
        self.queue.append((self.now + delay, future, fn, args))
        return future

    def tick(self) -> None:
        due = [entry for entry in self.queue if entry[0] <= self.now]
        self.queue = [entry for entry in self.queue if entry[0] > self.now]
        for _, future, fn, args in due:
            _run(future, fn, args)
        self.now += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        queue, self.queue = self.queue, []
        for _, future, fn, args in queue:
            if cancel_futures:
                future.cancel()
            else:
                _run(future, fn, args)


def _run(future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        future.set_result(fn(*args))
    except Exception as exc:  # a grammar that fails to compile: the scheduler reads it so
        future.set_exception(exc)


def hold_grammar_compilation(scheduler: Any) -> None:
    """Compile ``scheduler``'s grammars on a ``CompileClock`` (a manager built without a
    tokenizer has no pool: nothing to hold)."""
    manager = scheduler.structured_output_manager
    if hasattr(manager, "executor"):
        manager.executor = CompileClock()


def init_grammar(scheduler: Any, request: Any) -> None:
    """What the engine does with a structured request before admitting it: start its grammar
    compiling (``EngineCore.preprocess_add_request``)."""
    structured = request.structured_output_request
    if structured is not None and structured._grammar is None:
        scheduler.structured_output_manager.grammar_init(request)


def settle_grammars(scheduler: Any) -> None:
    """Before ``schedule()``: compilations whose turn has come finish. A pool the harness does
    not hold (a subject built its own manager) is waited for instead, all of it."""
    executor = getattr(scheduler.structured_output_manager, "executor", None)
    if isinstance(executor, CompileClock):
        executor.tick()
        return
    futures = [
        r.structured_output_request._grammar
        for r in scheduler.requests.values()
        if r.structured_output_request is not None
    ]
    wait([f for f in futures if isinstance(f, Future)])


def defers_sampling(so: Any) -> bool:
    """Whether the engine samples this step only after the step in flight has been processed
    (async scheduling: a structured request's grammar still lacks that step's tokens)."""
    return bool(getattr(so, "pending_structured_output_tokens", False))


@dataclass(frozen=True)
class GrammarRows:
    # Per position the step samples (each draft's, then the bonus token's): allowed token ids.
    allowed: list[np.ndarray]
    # How many leading drafts the bitmask constrained; later ones must be rejected.
    acceptable: int


def allowed_tokens(row: np.ndarray, vocab: int) -> np.ndarray:
    """One bitmask row (32 token ids per int32 word, lowest bit first) as booleans per id."""
    bits = np.unpackbits(np.ascontiguousarray(row).view(np.uint8), bitorder="little")
    return bits[:vocab].astype(bool)


# How a step's bitmask lays out each structured request's rows.
FIXED_BITMASK_BLOCKS: ByRelease[bool] = ByRelease(
    "grammar bitmask rows",
    False,
    [
        Change(
            "0.33.0",
            True,
            "each structured request owns a fixed block of num_speculative_tokens + 1 rows; "
            "before, 1 + its scheduled drafts, packed one request after the other",
        )
    ],
)


def grammar_rows(
    grammar_output: Any, num_drafts: int, vocab: int, so: Any = None
) -> dict[str, GrammarRows]:
    """Per structured request of the step, its bitmask rows (one per scheduled draft, then the
    bonus token's: ``num_drafts + 1`` in a fixed block, or packed before 0.33)."""
    if grammar_output is None:
        return {}
    ids = list(grammar_output.structured_output_request_ids)
    bitmask = np.asarray(grammar_output.grammar_bitmask)
    # ``num_acceptable_drafts`` None invalidates every draft; a release without the field
    # constrains every scheduled draft's row (``rows - 1`` acceptable).
    known = hasattr(grammar_output, "num_acceptable_drafts")
    acceptable = grammar_output.num_acceptable_drafts if known else None
    if known and acceptable is None:
        acceptable = [0] * len(ids)
    fixed = FIXED_BITMASK_BLOCKS.value()
    spec = {} if so is None else so.scheduled_spec_decode_tokens
    out: dict[str, GrammarRows] = {}
    start = 0
    for j, rid in enumerate(ids):
        rows = num_drafts + 1 if fixed else 1 + len(spec.get(rid, ()))
        first = j * (num_drafts + 1) if fixed else start
        allowed = [allowed_tokens(bitmask[first + i], vocab) for i in range(rows)]
        out[rid] = GrammarRows(allowed, rows - 1 if acceptable is None else int(acceptable[j]))
        start = first + rows
    return out


def grammar_fields(so: Any, grammar_output: Any) -> dict[str, Any]:
    """The step's grammar facts for ``sched_out``, each only when set: the structured requests
    in bitmask order, the drafts each may accept, each bitmask row (allowed ids, checksum),
    whether sampling waited for the step in flight, the drafts the grammar invalidated."""
    fields: dict[str, Any] = {}
    if grammar_output is not None:
        fields["structured_ids"] = list(grammar_output.structured_output_request_ids)
        acceptable = getattr(grammar_output, "num_acceptable_drafts", None)
        if acceptable is not None and any(acceptable):
            fields["acceptable_drafts"] = list(acceptable)
        bitmask = np.ascontiguousarray(grammar_output.grammar_bitmask)
        fields["bitmask"] = [
            (int(np.unpackbits(row.view(np.uint8)).sum()), zlib.crc32(row.tobytes()))
            for row in bitmask
        ]
    if defers_sampling(so):
        fields["sampling_deferred"] = True
    invalid = getattr(so, "num_invalid_spec_tokens", None)
    if invalid:
        fields["invalid_drafts"] = dict(sorted(invalid.items()))
    return fields


# ---- the request snapshot ---------------------------------------------------------------


def grammar_state(structured: Any) -> dict[str, Any]:
    """A structured request's grammar as read, without resolving a finished compilation (the
    scheduler does that when it looks): compiling / ready / failed (none: never started),
    then for a ready one the tokens it accepted and whether it terminated."""
    grammar = structured._grammar
    if isinstance(grammar, Future):
        if not grammar.done():
            return {"state": "compiling"}
        error = grammar.exception()
        grammar = error if error is not None else grammar.result()
    if grammar is None:
        return {"state": "none"}
    if isinstance(grammar, BaseException):
        return {"state": "failed", "error": type(grammar).__name__}
    return {
        "state": "ready",
        "accepted": getattr(grammar, "num_processed_tokens", None),
        "terminated": bool(grammar.is_terminated()),
    }
