"""Step-fault recovery for the model runner: undo, retry, and pinning a fault on one request.

A fault raised while a step executes (the forward, sampling, an inline payload build) must not
fail requests it did not concern (C-61). Owned here:

* ``StepJournal`` — records what a step changes in the runner's request state, so rolling it
  back lets the same ``SchedulerOutput`` run again (up to ``OmniStageConfig.step_retries`` times);
* ``bisect`` — when retries keep failing, runs the step's requests in halves, in scheduler order,
  until each remaining fault sits on one request, which fails alone;
* ``PoisonedBlocks`` — the blocks a failed request never wrote; a request scheduled onto them as
  a prefix hit fails too, naming the request it depended on.

Why KV writes need no undo, why scheduler order matters and how long blocks stay poisoned:
docs/design.md, "When a step faults".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, Protocol

logger = logging.getLogger(__name__)


class _State(Protocol):
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    conditioning_sent: bool
    conditioning_output_index: int
    merge_pending: bool
    _table_len: int


class _Saved(NamedTuple):
    # The list objects themselves, and their lengths: the runner only ever appends to these
    # lists in place or replaces them with new ones, so truncating the saved object to the saved
    # length and putting it back restores the exact contents.
    state: _State
    token_ids: list[int]
    num_tokens: int
    num_computed_tokens: int
    block_ids: list[int]
    num_blocks: int
    conditioning_sent: bool
    conditioning_output_index: int
    merge_pending: bool


_MISSING: Any = object()


class StepJournal:
    """What one step changed in the runner's request states, in order, so it can be undone."""

    def __init__(self, requests: dict[str, Any]) -> None:
        self._requests = requests
        self._entries: list[_Saved | tuple[str, Any]] = []

    def save(self, state: _State) -> None:
        """Record ``state`` as it is now (call before mutating it)."""
        self._entries.append(
            _Saved(
                state,
                state.token_ids,
                len(state.token_ids),
                state.num_computed_tokens,
                state.block_ids,
                len(state.block_ids),
                state.conditioning_sent,
                state.conditioning_output_index,
                state.merge_pending,
            )
        )

    def save_slot(self, req_id: str) -> None:
        """Record what ``requests[req_id]`` holds now (call before replacing or popping it)."""
        self._entries.append((req_id, self._requests.get(req_id, _MISSING)))

    def mark(self) -> int:
        return len(self._entries)

    def rollback(self, to: int = 0) -> None:
        """Undo every change recorded after ``mark() == to``, newest first."""
        entries = self._entries
        while len(entries) > to:
            entry = entries.pop()
            if isinstance(entry, _Saved):
                st = entry.state
                del entry.token_ids[entry.num_tokens :]
                st.token_ids = entry.token_ids
                del entry.block_ids[entry.num_blocks :]
                st.block_ids = entry.block_ids
                st._table_len = -1  # the cached numpy table may describe the undone list
                st.num_computed_tokens = entry.num_computed_tokens
                st.conditioning_sent = entry.conditioning_sent
                st.conditioning_output_index = entry.conditioning_output_index
                st.merge_pending = entry.merge_pending
            else:
                req_id, old = entry
                if old is _MISSING:
                    self._requests.pop(req_id, None)
                else:
                    self._requests[req_id] = old


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def bisect(
    req_ids: Sequence[str],
    run: Callable[[list[str]], None],
    retries: int,
) -> dict[str, BaseException]:
    """Run ``req_ids`` through ``run`` in halves until every fault sits on a single request.

    ``run(part)`` executes the part and keeps its results, or raises having undone everything
    it changed. A failing part of more than one request is split in two and both halves run,
    first half first (scheduler order). A failing single request is tried ``retries`` more
    times, so a transient fault during isolation does not fail a healthy request. Returns the
    requests that kept failing, with their last fault.
    """
    failed: dict[str, BaseException] = {}
    pending: list[list[str]] = [list(req_ids)] if req_ids else []
    while pending:
        part = pending.pop(0)
        attempts = 1 + (retries if len(part) == 1 else 0)
        last: BaseException | None = None
        for _ in range(attempts):
            try:
                run(part)
                last = None
                break
            except Exception as exc:  # noqa: BLE001 - any step fault is pinned, not propagated
                last = exc
        if last is None:
            continue
        if len(part) == 1:
            failed[part[0]] = last
            continue
        mid = len(part) // 2
        # Both halves go before anything queued later, keeping scheduler order overall.
        pending[:0] = [part[:mid], part[mid:]]
    return failed


class PoisonedBlocks:
    """KV blocks failed requests were writing when their step failed: never read them.

    Each block maps to the request that failed writing it, so a reader's error can name it.
    Entries live for ``lifetime`` further steps: once the scheduler has applied the failed
    step's output it has evicted those blocks from the prefix cache, so only steps it scheduled
    before that (the same step, and under async scheduling the one after) can read them.
    """

    def __init__(self, block_size: int, lifetime: int = 2) -> None:
        self.block_size = block_size
        self.lifetime = lifetime
        self._by_step: list[dict[int, str]] = []

    def __bool__(self) -> bool:
        return bool(self._by_step)

    def next_step(self) -> None:
        """A new step begins: forget the blocks of failures older than ``lifetime`` steps."""
        if self._by_step:
            self._by_step.insert(0, {})
            del self._by_step[self.lifetime + 1 :]
            if not any(self._by_step):
                self._by_step.clear()

    def add_written(self, owner: str, block_ids: Sequence[int], start: int, end: int) -> None:
        """The blocks holding positions ``[start, end)`` of ``owner``'s table: what its failed
        step was writing."""
        if end <= start:
            return
        if not self._by_step:
            self._by_step.append({})
        bs = self.block_size
        for block in block_ids[start // bs : (end - 1) // bs + 1]:
            self._by_step[0][block] = owner

    def read_by(self, block_ids: Sequence[int], num_computed: int) -> str | None:
        """The failed request whose unwritten KV a request attends to, if any: a poisoned block
        among those covering positions it did not compute in this step (``[0, num_computed)``,
        prefix-cache hits included)."""
        if not self._by_step or num_computed <= 0:
            return None
        covered = block_ids[: (num_computed - 1) // self.block_size + 1]
        for blocks in self._by_step:
            for block in covered:
                owner = blocks.get(block)
                if owner is not None:
                    return owner
        return None

    def rewritten(self, block_ids: Sequence[int], start: int, end: int) -> None:
        """A healthy request wrote positions ``[start, end)``: the blocks holding them are its
        own fresh allocations (a prefix hit is never written), so they hold valid KV again."""
        if not self._by_step or end <= start:
            return
        bs = self.block_size
        written = block_ids[start // bs : (end - 1) // bs + 1]
        for blocks in self._by_step:
            for block in written:
                blocks.pop(block, None)


def log_isolated(stage: str, failed: Iterable[str], kept: int) -> None:
    logger.warning(
        "stage %s: step faults pinned on %s; %d other requests of the step kept their results",
        stage,
        sorted(failed),
        kept,
    )
