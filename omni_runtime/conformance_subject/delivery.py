"""Chunk delivery (C-21, C-40..C-45): how the suite installs a sink on an omni scheduler's
``ChunkTransferAdapter``, reads its ``StageChunk``s and ``StagePayload``s as ``ChunkView`` and
``PayloadView``, installs generated processors, and which ids (and chunks) the configured
processor must stream.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from conformance.api import (
    ChunkView,
    Feature,
    PayloadView,
)
from omni_runtime.conformance_subject.stages import (
    CODEC_CHUNK,
    CODEC_STREAMER,
    CODEC_VOCAB,
    stage_of,
    talker_stage,
)


def payload_view(payload: Any) -> PayloadView | None:
    if payload is None:
        return None
    return PayloadView(
        request_id=payload.request_id,
        start=payload.start,
        num_tokens=payload.num_tokens,
        hidden=payload.hidden,
        conditioning=payload.conditioning,
        multimodal=dict(payload.multimodal),
        has_tensors=payload.has_tensors,
    )


class OmniChunkDelivery:
    """The scheduler's ``ChunkTransferAdapter``: its sink, its chunks, its processor."""

    # ``ChunkTransferAdapter`` asks a processor whose final call raised to release the request.
    releases_on_final_fault = True

    processor_feature = Feature(
        "chunk-contracts",
        {"omni_stage": talker_stage(chunk_processor=None)},
        (None, "talker", "code2wav"),
        # A stage's engine serves vLLM's own clients too: their requests carry no omni slot.
        plain_requests=True,
    )

    def install_sink(self, scheduler: Any, sink: Any) -> bool:
        transfer = getattr(scheduler, "transfer", None)
        if transfer is None:
            return False
        transfer.sink = sink
        return True

    def view(self, chunk: Any) -> ChunkView:
        ids = None
        if isinstance(chunk.data, torch.Tensor) and not chunk.data.is_floating_point():
            ids = tuple(int(t) for t in chunk.data.tolist())
        view = payload_view(chunk.payload)
        data = chunk.data
        if isinstance(data, dict) and view is not None:
            # A processor's dict (``HiddenRowsForwarder``) is what the next stage reads its rows
            # from (the orchestrator's ``_collect_rows``), so the suite reads them there too.
            view = dataclasses.replace(
                view,
                hidden=data.get("hidden"),
                start=data.get("start", -1),  # -1: no start crossed, which no row matches
                conditioning=data.get("conditioning"),
            )
        return ChunkView(
            chunk.request_id, chunk.seq, chunk.is_final, ids, view, chunk.finish_reason
        )

    # Every EOF chunk of this runtime says why its request ended (``StageChunk.finish_reason``).
    eof_reasons = True

    def payload_view(self, payload: Any) -> PayloadView | None:
        return payload_view(payload)

    def batching_processors(self) -> dict[str, Callable[[], Any]]:
        """The shipped processors that define ``on_token_batch`` (C-40: a batch is the
        per-request calls at once)."""
        from omni_runtime.sched.processors import CodecTokenStreamer

        return {"CodecTokenStreamer": CodecTokenStreamer}

    # The step's output of a request names the chunk the step delivered for it
    # (``OmniEngineCoreOutput.omni_chunk_refs``, what a consumer of the outputs reads).
    output_refs_field = "omni_chunk_refs"
    output_eof_field = "omni_eof"

    def ref(self, chunk: Any) -> str:
        return str(chunk.ref)

    def expected_tokens(self, feature: Feature, accepted: Sequence[int]) -> list[int] | None:
        if stage_of(feature).get("chunk_processor") != CODEC_STREAMER:
            return None
        return [t for t in accepted if 0 <= t < CODEC_VOCAB]

    def expected_chunks(
        self, feature: Feature, steps: Sequence[Sequence[int]], last_step_ends: bool
    ) -> list[tuple[int, ...]] | None:
        """What ``CodecTokenStreamer`` promises, written plainly: a step that leaves at least
        ``CODEC_CHUNK`` audio ids buffered sends the largest multiple of it at once, and the EOF
        carries the rest (possibly none), with the ids of the step that ended the request. The
        streamer itself batches steps and spreads them lazily; this is the per-step reading it
        must agree with."""
        if self.expected_tokens(feature, []) is None:
            return None
        chunks: list[tuple[int, ...]] = []
        buffered: list[int] = []
        for i, ids in enumerate(steps):
            buffered += self.expected_tokens(feature, ids) or []
            if last_step_ends and i == len(steps) - 1:
                break
            if len(buffered) >= CODEC_CHUNK:
                cut = len(buffered) - len(buffered) % CODEC_CHUNK
                chunks.append(tuple(buffered[:cut]))
                del buffered[:cut]
        chunks.append(tuple(buffered))
        return chunks

    def set_processor(self, scheduler: Any, processor: Callable[..., Any]) -> None:
        scheduler.transfer.set_processor(processor)

    def with_payloads(self, output: Any, rows: Sequence[tuple[int, Any] | None]) -> Any:
        from omni_runtime.adapters.output import synthetic_payloads
        from omni_runtime.payload import OmniModelRunnerOutput

        payloads = synthetic_payloads(output.req_ids, rows)
        return OmniModelRunnerOutput(
            req_ids=output.req_ids,
            req_id_to_index=output.req_id_to_index,
            sampled_token_ids=output.sampled_token_ids,
            omni_payloads=payloads,
        )
