"""A batching chunk processor's ``on_token_batch`` is its per-request calls, at once (C-40).

A runtime that batches relies on that equivalence, deciding per step whether to batch, so the
suite checks it for every batching processor a subject ships
(``ChunkDelivery.batching_processors``, optional): one generated sequence of steps goes to two
fresh instances, per request to one and as batch calls to the other. Every call's data, and
which requests each processor still holds, must match; a final call or a release lets a request
go (C-04).

The ``on_token_batch`` protocol: docs/contracts.md, "Chunk processors"; the steps drawn:
docs/design.md, "How the suite checks".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance._core.needs import features_of, require
from invariants.machines import suite_settings

pytestmark = [pytest.mark.invariants]


@dataclass(frozen=True)
class Call:
    """One request's call in a step: its new ids (nonempty), and whether it ends the request
    (``final``) or is released instead (``release``: its send path failed)."""

    request_id: str
    ids: tuple[int, ...]
    final: bool = False
    release: bool = False


def step_lists(edges: Sequence[int]) -> st.SearchStrategy[list[list[Call]]]:
    """Steps of calls over up to six requests; a request is gone after its final call or its
    release (one call in eight), and an id is one of ``edges`` or lies below the highest edge by
    at most an eighth more (most ids then fall in the range the processor keeps, so buffers
    fill within a request's life), or below 512 when the subject names no edge."""
    top = max(edges) * 9 // 8 if edges else 511
    ids = st.one_of(st.integers(0, top), st.sampled_from(tuple(edges) or (0,)))

    @st.composite
    def build(draw: Any) -> list[list[Call]]:
        live = [f"r{i}" for i in range(draw(st.integers(1, 6)))]
        steps: list[list[Call]] = []
        for _ in range(draw(st.integers(1, 30))):
            if not live:
                break
            step: list[Call] = []
            for rid in draw(st.permutations(live)):
                if not draw(st.booleans()) and len(step) > 0:
                    continue  # not scheduled this step
                end = draw(st.sampled_from(("run",) * 14 + ("final", "release")))
                n = draw(st.sampled_from((1, 1, 1, 2, 3, 4)))
                step.append(
                    Call(rid, tuple(draw(ids) for _ in range(n)), end == "final", end == "release")
                )
                if end != "run":
                    live.remove(rid)
            steps.append(step)
        return steps

    return build()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    return bool(a == b)


def _batched_step(batched: Any, step: list[Call]) -> dict[str, Any]:
    """``step`` as a batching runtime makes it: each run of id-only calls as one batch, the
    final calls and releases between runs per request. Returns each call's data."""
    got: dict[str, Any] = {}
    run: list[Call] = []
    for call in [*step, None]:
        if call is not None and not (call.final or call.release):
            run.append(call)
            continue
        if run:
            counts = None if all(len(c.ids) == 1 for c in run) else [len(c.ids) for c in run]
            data = batched.on_token_batch(
                tuple(c.request_id for c in run), [t for c in run for t in c.ids], counts
            )
            got.update({c.request_id: None if not data else data.get(c.request_id) for c in run})
            run = []
        if call is None:
            break
        if call.release:
            batched.release(call.request_id)
        else:
            got[call.request_id] = batched(
                call.request_id, None, True, new_token_ids=list(call.ids)
            )
    return got


def check_batching(make: Callable[[], Any], name: str, steps: list[list[Call]]) -> None:
    one, batched = make(), make()
    pending = getattr(one, "pending_request_ids", None)
    for s, step in enumerate(steps):
        got = _batched_step(batched, step)
        for call in step:
            if call.release:
                one.release(call.request_id)
                continue
            want = one(call.request_id, None, call.final, new_token_ids=list(call.ids))
            assert _same(want, got[call.request_id]), (
                f"C-40: {name}: step {s}, {call.request_id}: batched call returned "
                f"{got[call.request_id]!r}, its per-request call {want!r}"
            )
        if pending is not None:
            # A request's end (its final call) or its release lets it go (C-04).
            gone = {c.request_id for c in step if c.final or c.release}
            kept = gone & set(one.pending_request_ids())
            assert not kept, (
                f"C-04/C-40: {name}: step {s}: still holds {sorted(kept)} after their final "
                "call or release"
            )
            assert one.pending_request_ids() == batched.pending_request_ids(), (
                f"C-40: {name}: step {s}: requests held per-request "
                f"{sorted(one.pending_request_ids())}, batched "
                f"{sorted(batched.pending_request_ids())}"
            )


def batching_processors(subject: Any) -> dict[str, Callable[[], Any]]:
    delivery = require(subject, "chunk_delivery", "a chunk delivery")
    found = getattr(delivery, "batching_processors", None)
    if found is None:
        pytest.skip("the subject names no batching processor")
    return dict(found())


def edges_of(subject: Any) -> tuple[int, ...]:
    return tuple(sorted({t for f in features_of(subject) for t in f.token_edges}))


@pytest.mark.clauses("C-40")
def test_batch_is_the_per_request_calls(conformance_subject):
    makers = batching_processors(conformance_subject)
    edges = edges_of(conformance_subject)

    @suite_settings(100)
    @given(st.sampled_from(sorted(makers)), step_lists(edges))
    def prop(name: str, steps: list[list[Call]]) -> None:
        check_batching(makers[name], name, steps)

    prop()
