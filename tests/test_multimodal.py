"""Images in the harness's requests (the multimodal axes; ``conformance/_core/multimodal.py``):
their placeholder tokens and features are what an engine gets, and vLLM's encoder cache is
driven and compared."""

from __future__ import annotations

import pytest

from conformance._core.config import MM_MODEL
from conformance._core.lockstep import Lockstep
from conformance._core.machine import TIGHT, own_length
from conformance._core.multimodal import IMAGE_TOKEN, IMAGES, expand, placements
from conformance._core.subjects import UpstreamSubject, request_kwargs
from conformance._core.workload import AddRequest, Step, Trace

MM = TIGHT.with_(model=str(MM_MODEL), log_stats=True)


@pytest.mark.parametrize(
    "images",
    [(("cat", 0),), (("chart", 3), ("icon", 3)), (("map", 99),), (("dog", 5), ("cat", 1))],
)
def test_placements_name_the_expanded_placeholder_tokens(images):
    own = tuple(range(100, 110))
    trace = Trace(config=MM, prefixes={"sys": tuple(range(40, 72))})
    op = AddRequest("r", own, prefix="sys", images=images)
    prompt = trace.prompt_of(op)
    places = placements(len(own), images, len(prompt))
    assert [t for t in prompt if t != IMAGE_TOKEN] == list(range(40, 72)) + list(own)
    covered = set()
    for _identifier, offset, size in places:
        assert prompt[offset : offset + size] == [IMAGE_TOKEN] * size
        covered.update(range(offset, offset + size))
    assert covered == {i for i, t in enumerate(prompt) if t == IMAGE_TOKEN}
    assert [p[1] for p in places] == sorted(p[1] for p in places)
    assert expand(own, ()) == list(own)


def test_features_hash_as_the_engine_decodes_them():
    """One image twice in a block: vLLM's sha256 block hash pickles the identifiers, so the
    request the harness builds must hash as the one an engine decodes off its socket (each
    identifier a string of its own), or a subject behind a process boundary differs falsely."""
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.request import Request
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from conformance._core.config import block_hasher

    op = AddRequest("r", tuple(range(100, 108)), images=(("icon", 0), ("icon", 5)))
    prompt = Trace(config=MM).prompt_of(op)
    built = Request(**request_kwargs(op, prompt, MM, 0.0))
    message = EngineCoreRequest(
        request_id="r",
        prompt_token_ids=prompt,
        mm_features=built.mm_features,
        sampling_params=built.sampling_params,
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )
    decoded = MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(message))
    arrived = Request.from_engine_core_request(decoded, block_hasher(MM.block_size))
    assert built.block_hashes and arrived.block_hashes == built.block_hashes


def test_drawn_prompts_leave_room_in_the_context():
    images = {"images": (("cat", 0), ("dog", 1), ("bird", 2))}
    assert 48 + 48 + own_length(40, "doc", images, 127) == 127
    assert own_length(40, None, {}, 127) == 40


def test_the_encoder_cache_evicts_and_the_snapshot_shows_it():
    """Three large images fill the 48-slot cache; a fourth, once the first request finished,
    evicts an unused entry: the step says which, and the snapshots carry the cache."""
    session = Lockstep(MM, UpstreamSubject())
    session.apply(AddRequest("a", (100, 101), max_tokens=1, images=(("cat", 0), ("dog", 1))))
    session.apply(AddRequest("b", (102,), max_tokens=1, images=(("bird", 0),)))
    freed: list[str] = []
    scheduled: dict[str, list[int]] = {}
    for _ in range(4):
        session.apply(Step())
        up = session.last_sub
        assert up is not None
        scheduled.update((up.get("sched_out") or {}).get("scheduled_encoder_inputs", {}))
    session.apply(AddRequest("c", (103,), max_tokens=1, images=(("map", 0),)))
    for _ in range(3):
        session.apply(Step())
        up = session.last_sub
        assert up is not None and session.failure is None
        freed += (up.get("sched_out") or {}).get("free_encoder_mm_hashes", [])
    assert scheduled == {"a": [0, 1], "b": [0]}
    cache = up["encoder_cache"]
    assert freed and set(freed) <= {"img-cat", "img-dog", "img-bird"}
    assert "img-map" in cache["cached"] and cache["num_free_slots"] >= 0
    assert sum(IMAGES[n][1] for n in ("cat", "dog", "bird")) == MM.max_num_batched_tokens


def test_a_consumer_loads_stored_images_instead_of_encoding_them():
    from conformance._core.axes import axis

    cfg = axis("ec-consumer-multimodal").config(TIGHT)
    session = Lockstep(cfg, UpstreamSubject())
    session.apply(AddRequest("r", (100, 101), max_tokens=1, images=(("cat", 0), ("dog", 1))))
    session.apply(Step())
    snap = session.last_sub
    assert snap is not None and session.failure is None
    # "cat" is stored by the producer: loaded through the connector, not scheduled to encode.
    assert snap["sched_out"]["scheduled_encoder_inputs"] == {"r": [1]}
    assert "img-cat" in str(snap["sched_out"]["ec_connector_metadata"])
