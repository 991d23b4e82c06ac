"""The batched ids-only call (``on_token_batch``) against per-request calls of the same processor.

``ChunkTransferAdapter`` hands a processor that defines ``on_token_batch`` each run of ids-only
requests in one call; ``CodecTokenStreamer`` keeps such steps whole until a chunk can be due.
Nothing of that may be visible: the chunks (contents, order, seqs, EOFs), the failures, the sent
map and the processor's pending buffers must be those of the same processor called per request.
The reference is the same streamer behind a wrapper that only forwards the per-request call,
which the adapter never batches.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from vllm.v1.engine import EngineCoreOutput, FinishReason

from omni_runtime.adapters.input import OmniRequestState
from omni_runtime.payload import StagePayload
from omni_runtime.sched import OmniARScheduler
from omni_runtime.sched.processors import CodecTokenStreamer
from omni_runtime.sched.transfer import ChunkTransferAdapter, _batch_method
from tests.sched_steps import run_to_completion
from tests.test_omni_scheduler import add, make

DOWN = OmniRequestState("talker", "code2wav", ("code2wav",))
FINAL_HERE = OmniRequestState("talker", "talker", ())


class PerRequest:
    """The streamer's per-request call and audits only: never batched by the adapter."""

    requires_token_updates = True

    def __init__(self, inner: CodecTokenStreamer) -> None:
        self.inner = inner

    def __call__(self, request_id, payload, is_final, new_token_ids=None):
        return self.inner(request_id, payload, is_final, new_token_ids=new_token_ids)

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)

    def pending_request_ids(self) -> set[str]:
        return self.inner.pending_request_ids()


def view(chunk: Any) -> tuple:
    data = chunk.data
    if isinstance(data, torch.Tensor):
        data = ("tensor", str(data.dtype), tuple(data.shape), data.tolist())
    payload = None
    if chunk.payload is not None:
        payload = (chunk.payload.start, chunk.payload.hidden[:, 0].tolist())
    return (
        chunk.request_id,
        chunk.seq,
        chunk.token_ids,
        data,
        chunk.is_final,
        chunk.finish_reason,
        payload,
    )


def random_steps(rng: random.Random, n_steps: int, lockstep: bool, multi: bool):
    """Per step: (steps, payloads, freed, dropped, live states after the update)."""
    live: dict[str, OmniRequestState] = {}
    position: dict[str, int] = {}
    counter = 0
    for _ in range(n_steps):
        arrivals = (1 if not live else 0) if lockstep else rng.choice((0, 0, 1, 2))
        if lockstep and not live:
            arrivals = rng.randint(3, 12)
        for _ in range(arrivals):
            rid = f"q{counter}"
            counter += 1
            live[rid] = DOWN if rng.random() < 0.85 else FINAL_HERE
            position[rid] = 0
        steps: list[tuple[str, Any]] = []
        payloads: dict[str, StagePayload] = {}
        freed: dict[str, tuple[OmniRequestState, str]] = {}
        dropped: set[str] = set()
        ended: list[str] = []
        for rid in list(live):
            r = rng.random()
            if not lockstep and r < 0.03:
                # Aborted during the update, without a step of its own.
                if live[rid].has_downstream:
                    freed[rid] = (live[rid], "abort")
                ended.append(rid)
                continue
            if not lockstep and r < 0.06:
                steps.append((rid, None))
                if rng.random() < 0.5:
                    dropped.add(rid)
                continue
            k = rng.choice((1, 1, 1, 2, 3, 0)) if multi else 1
            ids = [
                rng.choice((11, 40, 255, 256, 300, 7, 0)) if multi else 11 + position[rid] % 200
                for _ in range(k)
            ]
            finish = None
            if not lockstep and rng.random() < 0.04 or position[rid] > 40:
                finish = rng.choice((FinishReason.STOP, FinishReason.LENGTH))
                ended.append(rid)
            steps.append(
                (rid, EngineCoreOutput(request_id=rid, new_token_ids=ids, finish_reason=finish))
            )
            if not lockstep and rng.random() < 0.05:
                rows = torch.tensor([[float(position[rid] + i)] * 2 for i in range(2)])
                payloads[rid] = StagePayload(rid, position[rid], 2, hidden=rows)
            position[rid] += max(k, 1)
        for rid in ended:
            state = live.pop(rid)
            if rid not in freed and state.has_downstream and rng.random() < 0.5:
                # Freed in this update as well as stepped (its slot was captured at the free).
                freed[rid] = (state, "stop")
        yield steps, payloads, freed, dropped, dict(live)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("chunk_size", [1, 3, 8])
def test_batched_streamer_equals_per_request_calls(seed, chunk_size):
    rng = random.Random(seed * 101 + chunk_size)
    lockstep = seed % 3 == 0
    multi = seed % 2 == 1
    batched = CodecTokenStreamer(chunk_size=chunk_size)
    reference = CodecTokenStreamer(chunk_size=chunk_size)
    # A third adapter gets every step whose outputs align with its requests (one each) through
    # ``on_aligned_steps``, as the scheduler hands it steady decode steps: its whole-step path
    # must be invisible too.
    whole = CodecTokenStreamer(chunk_size=chunk_size)
    a = ChunkTransferAdapter("talker", batched)
    b = ChunkTransferAdapter("talker", PerRequest(reference))
    c = ChunkTransferAdapter("talker", whole)
    assert a._batch_of(batched) is not None and b._batch_of(b.processor) is None
    general = c.on_steps
    for steps, payloads, freed, dropped, live in random_steps(rng, 120, lockstep, multi):
        sent = [
            adapter.on_steps(list(steps), payloads, dict(freed), dropped, live.get)
            for adapter in (a, b)
        ]
        if all(out is not None for _, out in steps):
            ids, outs = [rid for rid, _ in steps], [out for _, out in steps]
            sent.append(c.on_aligned_steps(ids, outs, payloads, dict(freed), dropped, live.get))
        else:
            sent.append(general(list(steps), payloads, dict(freed), dropped, live.get))
        for other in sent[1:]:
            assert [(rid, view(c)) for rid, c in sent[0].items()] == [
                (rid, view(c)) for rid, c in other.items()
            ]
        drained = [[view(c) for c in adapter.sink.drain()] for adapter in (a, b, c)]
        assert drained[0] == drained[1] == drained[2]
        failures = [adapter.take_failures().keys() for adapter in (a, b, c)]
        assert failures[0] == failures[1] == failures[2]
        assert a.progress == b.progress == c.progress
        if rng.random() < 0.2:
            # Audits between steps see the buffers per-request calls would have left.
            pending = [s.pending_request_ids() for s in (batched, reference, whole)]
            assert pending[0] == pending[1] == pending[2]
            assert batched._buffers == reference._buffers == whole._buffers
    assert batched.pending_request_ids() == reference.pending_request_ids()
    assert whole.pending_request_ids() == reference.pending_request_ids()


def test_steady_decode_steps_are_taken_whole():
    # Every request live, with a downstream and one id a step: ``on_aligned_steps`` must not
    # fall back to the per-request loop, and must stream what per-request calls stream.
    whole, reference = CodecTokenStreamer(chunk_size=4), CodecTokenStreamer(chunk_size=4)
    c = ChunkTransferAdapter("talker", whole)
    b = ChunkTransferAdapter("talker", PerRequest(reference))
    ids = [f"q{i}" for i in range(6)]
    live = dict.fromkeys(ids, DOWN)
    general, fallbacks = c.on_steps, []
    c.on_steps = lambda *args: fallbacks.append(args) or general(*args)  # type: ignore[method-assign]
    for step in range(13):
        outs = [
            EngineCoreOutput(request_id=r, new_token_ids=[11 + step + i]) for i, r in enumerate(ids)
        ]
        sent = c.on_aligned_steps(ids, outs, {}, {}, set(), live.get)
        expected = b.on_steps(list(zip(ids, outs, strict=True)), {}, {}, set(), live.get)
        assert [(r, view(x)) for r, x in sent.items()] == [
            (r, view(x)) for r, x in expected.items()
        ]
    # Only the first step, which creates the progress records, took the general path.
    assert len(fallbacks) == 1
    assert [view(x) for x in c.sink.drain()] == [view(x) for x in b.sink.drain()]
    assert whole.pending_request_ids() == reference.pending_request_ids()


def test_release_spreads_kept_steps_first():
    s = CodecTokenStreamer(chunk_size=8)
    s.on_token_batch(("a", "b"), [1, 2], None)
    s.on_token_batch(("a", "b"), [3, 4], None)
    s.release("a")
    assert s.pending_request_ids() == {"b"}
    # A new request under a released id starts empty, not with the old request's kept ids.
    assert s("a", None, True, new_token_ids=[9]).tolist() == [9]
    assert s("b", None, True, new_token_ids=[]).tolist() == [2, 4]


def test_streamer_batch_matches_calls_with_out_of_vocab_and_multi_token_steps():
    s, r = CodecTokenStreamer(chunk_size=4), CodecTokenStreamer(chunk_size=4)
    got = s.on_token_batch(("a", "b"), [1, 300, 2, 3, -1], [2, 3])
    assert not got
    assert r("a", None, False, new_token_ids=[1, 300]) is None
    assert r("b", None, False, new_token_ids=[2, 3, -1]) is None
    got = s.on_token_batch(("b", "a"), [4, 5, 6, 7], [1, 3])
    want = {
        rid: r(rid, None, False, new_token_ids=ids) for rid, ids in (("b", [4]), ("a", [5, 6, 7]))
    }
    assert {k: v.tolist() for k, v in (got or {}).items()} == {
        k: v.tolist() for k, v in want.items() if v is not None
    }
    assert s._buffers == r._buffers


class RaisingBatch:
    requires_token_updates = True

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def __call__(self, request_id, payload, is_final, new_token_ids=None):
        self.calls.append(("call", request_id, is_final))
        return "data"

    def on_token_batch(self, request_ids, token_ids, counts):
        self.calls.append(("batch", request_ids, token_ids, counts))
        raise RuntimeError("batch fault")


def test_batch_fault_fails_each_request_of_its_run_only():
    proc = RaisingBatch()
    a = ChunkTransferAdapter("talker", proc)
    live = {rid: DOWN for rid in ("a", "b", "c", "d")}
    rows = torch.zeros(1, 2)
    steps = [
        ("a", EngineCoreOutput(request_id="a", new_token_ids=[1])),
        ("b", EngineCoreOutput(request_id="b", new_token_ids=[2, 3])),
        ("c", EngineCoreOutput(request_id="c", new_token_ids=[4])),
        ("d", EngineCoreOutput(request_id="d", new_token_ids=[5])),
    ]
    sent = a.on_steps(steps, {"c": StagePayload("c", 0, 1, hidden=rows)}, {}, set(), live.get)
    # The payload step of c splits the runs: (a, b) and (d), each one batch call, in order.
    assert proc.calls == [
        ("batch", ("a", "b"), [1, 2, 3], [1, 2]),
        ("call", "c", False),
        ("batch", ("d",), [5], None),
    ]
    failures = a.take_failures()
    assert list(failures) == ["a", "b", "d"]
    assert all(str(e) == "batch fault" for e in failures.values())
    assert list(sent) == ["c"]
    # The failed requests keep their progress until the EOF their failure leads to, which then
    # continues their numbering (C-43): nothing was sent for a, so its EOF is chunk 0.
    assert set(a.progress) == {"a", "b", "c", "d"}
    eof = a.on_terminated("a", DOWN, "error")
    assert eof is not None and eof.seq == 0 and eof.is_final and "a" not in a.progress


class SubclassedCall(CodecTokenStreamer):
    def __call__(self, request_id, payload, is_final, new_token_ids=None):
        return super().__call__(request_id, payload, is_final, new_token_ids)


class SubclassedBoth(SubclassedCall):
    def on_token_batch(self, request_ids, token_ids, counts):
        return super().on_token_batch(request_ids, token_ids, counts)


class Forwarding:
    requires_token_updates = True

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, *a: Any, **kw: Any) -> Any:
        return self.inner(*a, **kw)


def test_batch_method_belongs_to_the_processors_own_call():
    s = CodecTokenStreamer()
    assert _batch_method(s) == s.on_token_batch
    assert _batch_method(SubclassedCall()) is None
    both = SubclassedBoth()
    assert _batch_method(both) == both.on_token_batch
    assert _batch_method(Forwarding(s)) is None
    assert _batch_method(lambda rid, payload, is_final: None) is None
    assert _batch_method(None) is None


def test_scheduler_streams_the_same_chunks_batched_and_per_request():
    def run(processor):
        sched = make(OmniARScheduler, processor=processor, max_num_seqs=6)
        for i in range(9):
            add(sched, f"r{i}", list(range(10 + i, 20 + 2 * i)), max_tokens=3 + 2 * i)
        run_to_completion(sched)
        return [view(c) for c in sched.transfer.sink.drain()]

    batched = CodecTokenStreamer(chunk_size=4, codec_vocab=300)
    reference = CodecTokenStreamer(chunk_size=4, codec_vocab=300)
    got = run(batched)
    assert got == run(PerRequest(reference))
    assert sum(1 for c in got if c[4]) == 9
    assert batched.pending_request_ids() == set() == reference.pending_request_ids()
