"""The orchestrator: the only code that knows the stage graph and routes between stages (C-21).

It owns one stage engine per AR stage, the ``Code2WavStage`` and one connector per edge, and
follows every client request from admission to its single terminal outcome (C-62). After each
stage step it drains that stage's connector and routes each chunk by its edge: into an AR stage,
the hidden rows are collected and, on the EOF, become the downstream request's
``prompt_embeds``; into code2wav, each codec chunk is decoded as it arrives. Text-only requests
end at the first stage and send nothing (C-42). An abort ends the request in every stage; a
step, connector, processor, decoder fault or a rejected downstream input ends only the requests
concerned, with reason "error" (C-61). Stages step in graph order once per ``step()``.

The routing step by step: docs/design.md, "One stage step" and "Inside the layers"; faults:
docs/design.md, "Faults and signals".
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from vllm import SamplingParams

from omni_runtime.adapters.input import RequestRejected, StageInput
from omni_runtime.engine.backends import StageBackend, make_stage_engine
from omni_runtime.engine.code2wav_stage import AudioChunk, Code2WavStage
from omni_runtime.engine.config import EngineOptions
from omni_runtime.engine.connectors import Connector, ConnectorLost, make_connector
from omni_runtime.engine.graph import ARStageSpec, PipelineConfig
from omni_runtime.engine.stage import StageOutput, talker_start_embeddings
from omni_runtime.payload import StageChunk

ABORT = "abort"
ERROR = "error"
EventKind = Literal["text", "audio", "finished"]


@dataclass
class RequestResult:
    """The one terminal outcome of a client request."""

    request_id: str
    prompt_token_ids: list[int]
    final_stage: str
    finish_reason: str
    text_token_ids: list[int] = field(default_factory=list)
    # Every id the talker sampled (codec ids and its control tokens, e.g. codec EOS).
    codec_token_ids: list[int] = field(default_factory=list)
    # The codec ids that reached code2wav, in order (control tokens stripped).
    audio_codes: list[int] = field(default_factory=list)
    waveform: torch.Tensor | None = None
    sample_rate: int | None = None
    num_audio_chunks: int = 0
    stages: list[str] = field(default_factory=list)
    stage_finish_reasons: dict[str, str] = field(default_factory=dict)
    # Per AR stage, prompt tokens its prefix cache served (absent: no report from that stage).
    cached_prompt_tokens: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    time_to_first_text_token: float | None = None
    time_to_first_audio_chunk: float | None = None
    total_time: float = 0.0
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.finish_reason not in (ABORT, ERROR)


@dataclass
class PipelineEvent:
    """What ``step()`` produced for a client: new text ids, an audio chunk, or the outcome."""

    kind: EventKind
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    audio: AudioChunk | None = None
    result: RequestResult | None = None


@dataclass
class _Track:
    request_id: str
    prompt_token_ids: list[int]
    final_stage: str
    max_tokens: dict[str, int]
    t0: float
    stage: str
    stages: list[str] = field(default_factory=list)
    text_ids: list[int] = field(default_factory=list)
    codec_ids: list[int] = field(default_factory=list)
    audio_codes: list[int] = field(default_factory=list)
    audio: list[torch.Tensor] = field(default_factory=list)
    rows: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    held_codes: list[torch.Tensor] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    awaiting_eof: str | None = None
    t_first_text: float | None = None
    t_first_audio: float | None = None
    done: bool = False


class Orchestrator:
    """Runs a pipeline of stages in this process; see the module docstring."""

    def __init__(
        self,
        config: PipelineConfig,
        options: EngineOptions | None = None,
        *,
        stream_audio: bool = True,
    ) -> None:
        self.config = config
        # False: code2wav waits for the talker's whole output and decodes it at once (the
        # baseline the streaming path is measured against).
        self.stream_audio = stream_audio
        self.options = options or EngineOptions()
        self.order: tuple[str, ...] = config.stage_ids
        self.engines: dict[str, StageBackend] = {}
        self.connectors: dict[str, Connector] = {}
        self.start_embeds: dict[str, torch.Tensor | None] = {}
        self.code2wav: Code2WavStage | None = None
        try:
            for spec in config.ar_stages:
                # In this process or in its own (``EngineOptions.backend``).
                self.engines[spec.id] = make_stage_engine(spec, config.stage_ids, self.options)
                self.start_embeds[spec.id] = talker_start_embeddings(spec)
            for spec in config.ar_stages:
                if spec.downstream:
                    dst = spec.downstream[0]
                    conn = make_connector(config.connector_for(spec.id, dst), f"{spec.id}->{dst}")
                    self.connectors[spec.id] = conn
                    self.engines[spec.id].set_sink(conn)
            if config.code2wav is not None:
                self.code2wav = Code2WavStage(config.code2wav)
        except BaseException:
            self.close()
            raise
        self._tracks: dict[str, _Track] = {}
        self._events: deque[PipelineEvent] = deque()
        self.steps = 0

    # ---- graph facts (kept here, C-21) --------------------------------------------------------

    @property
    def first_stage(self) -> str:
        return self.order[0]

    @property
    def last_stage(self) -> str:
        return self.order[-1]

    @property
    def sample_rate(self) -> int | None:
        return self.code2wav.sample_rate if self.code2wav is not None else None

    def _ar_spec(self, stage_id: str) -> ARStageSpec:
        spec = self.config.stage(stage_id)
        assert isinstance(spec, ARStageSpec)
        return spec

    # ---- admission and abort ------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: dict[str, int],
        text_only: bool = False,
    ) -> None:
        """Admit a request to the first stage; raises ``RequestRejected`` on bad input."""
        if request_id in self._tracks:
            raise RequestRejected(
                request_id, "request_id", "duplicate: a request with this id is live"
            )
        first = self.first_stage
        final = first if text_only else self.last_stage
        track = _Track(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            final_stage=final,
            max_tokens=dict(max_tokens),
            t0=time.perf_counter(),
            stage=first,
        )
        self.engines[first].add(
            StageInput(
                request_id=request_id,
                sampling_params=self._sampling(first, track),
                prompt_token_ids=list(prompt_token_ids),
                final_stage_id=final,
            )
        )
        track.stages.append(first)
        self._tracks[request_id] = track

    def _sampling(self, stage_id: str, track: _Track) -> SamplingParams:
        spec = self._ar_spec(stage_id)
        return SamplingParams(
            max_tokens=track.max_tokens.get(stage_id, 16),
            temperature=0.0,
            stop_token_ids=list(spec.stop_token_ids),
            detokenize=False,
        )

    def abort(self, request_ids: Sequence[str]) -> list[str]:
        """Abort requests in every stage; each gets exactly one "abort" outcome (C-62)."""
        aborted = []
        for rid in request_ids:
            track = self._tracks.get(rid)
            if track is None or track.done:
                continue
            self._finish(track, ABORT)
            aborted.append(rid)
        self._drain_connectors()
        return aborted

    def discard_outcomes(self, request_ids: Sequence[str]) -> None:
        """Drop queued events of requests the client never learned about (failed submit)."""
        drop = set(request_ids)
        self._events = deque(e for e in self._events if e.request_id not in drop)

    # ---- stepping -----------------------------------------------------------------------------

    def has_work(self) -> bool:
        """Requests in flight, stages still releasing state, or events not yet returned."""
        return (
            bool(self._tracks)
            or bool(self._events)
            or any(e.has_work() for e in self.engines.values())
        )

    def unfinished(self) -> list[str]:
        return [rid for rid, t in self._tracks.items() if not t.done]

    def step(self) -> list[PipelineEvent]:
        """Step every stage that has work once, in graph order; returns the new events."""
        self.steps += 1
        for sid in self.order:
            engine = self.engines.get(sid)
            if engine is None or not engine.has_work():
                continue
            result = engine.step()
            for out in result.outputs:
                self._on_output(sid, out)
            self._receive(sid)
            self._check_eof(sid)
        if self._tracks and not any(e.has_work() for e in self.engines.values()):
            # No stage holds these requests any more and nothing is in flight: without this
            # they would never get an outcome (C-62).
            for track in list(self._tracks.values()):
                self._finish(
                    track, ERROR, f"stalled: no stage holds the request (last {track.stage})"
                )
        events = list(self._events)
        self._events.clear()
        return events

    def _drain_connectors(self) -> None:
        for sid in list(self.connectors):
            self._receive(sid)

    def _receive(self, sid: str) -> None:
        """Route what ``sid``'s connector delivered; a connector that lost chunks (its relay
        died or stalled) fails exactly the requests they belonged to (C-61)."""
        conn = self.connectors.get(sid)
        if conn is None:
            return
        try:
            chunks = conn.recv()
        except ConnectorLost as lost:
            for chunk in lost.delivered:
                self._on_chunk(sid, chunk)
            for rid in lost.lost:
                track = self._tracks.get(rid)
                if track is not None and not track.done:
                    self._finish(track, ERROR, f"{sid}: {lost}")
            return
        for chunk in chunks:
            self._on_chunk(sid, chunk)

    # ---- routing ------------------------------------------------------------------------------

    def _on_output(self, sid: str, out: StageOutput) -> None:
        track = self._tracks.get(out.request_id)
        if track is None or track.done or track.stage != sid:
            return
        if out.num_cached_tokens is not None:
            track.cached[sid] = out.num_cached_tokens
        if out.new_token_ids:
            if sid == self.first_stage:
                if track.t_first_text is None:
                    track.t_first_text = time.perf_counter()
                track.text_ids.extend(out.new_token_ids)
                self._events.append(PipelineEvent("text", out.request_id, list(out.new_token_ids)))
            else:
                # Codec ids reach the client as decoded audio chunks, not as events.
                track.codec_ids.extend(out.new_token_ids)
        if out.finish_reason is None:
            return
        track.reasons[sid] = out.finish_reason
        if out.finish_reason in (ABORT, ERROR):
            self._finish(
                track,
                out.finish_reason,
                out.error or f"stage {sid} finished with {out.finish_reason}",
            )
        elif track.final_stage == sid:
            self._finish(track, out.finish_reason)
        else:
            # The terminal chunk of this step carries the request on (C-43).
            track.awaiting_eof = sid

    def _on_chunk(self, sid: str, chunk: StageChunk) -> None:
        if chunk.source_stage != sid:
            # Only the orchestrator decides where a stage's chunks go (C-21): a chunk that
            # names another source arrived on the wrong edge.
            raise RuntimeError(f"chunk {chunk.ref} arrived on the {sid!r} edge")
        track = self._tracks.get(chunk.request_id)
        if track is None or track.done or track.stage != sid:
            return  # e.g. the EOF an abort caused: the outcome is already decided
        dst = self.config.downstream_of(sid)
        if dst is None:
            return
        if chunk.is_final:
            track.awaiting_eof = None
            if chunk.finish_reason in (ABORT, ERROR):
                self._finish(track, str(chunk.finish_reason), f"stage {sid} ended the request")
                return
        if dst in self.engines:
            self._collect_rows(track, chunk)
            if chunk.is_final:
                self._hand_over(track, sid, dst)
        else:
            self._decode_audio(track, sid, chunk)

    def _collect_rows(self, track: _Track, chunk: StageChunk) -> None:
        data = chunk.data
        if isinstance(data, dict):
            hidden, start = data.get("hidden"), data.get("start")
        elif chunk.payload is not None:
            hidden, start = chunk.payload.hidden, chunk.payload.start
        else:
            hidden, start = None, None
        if hidden is not None and start is not None and hidden.shape[0] > 0:
            track.rows.append((int(start), hidden))

    def _prompt_embeds(self, track: _Track, dst: str) -> torch.Tensor:
        """Upstream hidden rows in position order, then the downstream's start embeddings."""
        spec = self._ar_spec(dst)
        parts: list[torch.Tensor] = []
        position = 0
        for start, rows in sorted(track.rows, key=lambda r: r[0]):
            if start > position:
                raise ValueError(f"hidden rows missing for positions [{position}, {start})")
            skip = position - start
            if skip < rows.shape[0]:
                parts.append(rows[skip:])
                position = start + rows.shape[0]
        if not parts:
            raise ValueError("the upstream stage delivered no hidden rows")
        start_rows = self.start_embeds.get(dst)
        if start_rows is not None:
            parts.append(start_rows.to(parts[0].dtype))
        embeds = torch.cat(parts, dim=0)
        if spec.prompt_embeds_dim is not None and embeds.shape[1] != spec.prompt_embeds_dim:
            raise ValueError(
                f"hidden size {embeds.shape[1]} != stage {dst!r} prompt_embeds_dim "
                f"{spec.prompt_embeds_dim} and no projection is configured"
            )
        return embeds.to(torch.float32).contiguous()

    def _hand_over(self, track: _Track, src: str, dst: str) -> None:
        try:
            embeds = self._prompt_embeds(track, dst)
            track.rows.clear()
            self.engines[dst].add(
                StageInput(
                    request_id=track.request_id,
                    sampling_params=self._sampling(dst, track),
                    prompt_embeds=embeds,
                    final_stage_id=track.final_stage,
                )
            )
        except (RequestRejected, ValueError) as exc:
            self._finish(track, ERROR, f"{src} -> {dst}: {exc}")
            return
        track.stage = dst
        track.stages.append(dst)

    def _decode_audio(self, track: _Track, sid: str, chunk: StageChunk) -> None:
        assert self.code2wav is not None
        if not self.stream_audio:
            if chunk.data is not None:
                track.held_codes.append(torch.as_tensor(chunk.data, dtype=torch.long).reshape(-1))
            if not chunk.is_final:
                return
            codes = (
                torch.cat(track.held_codes)
                if track.held_codes
                else torch.zeros(0, dtype=torch.long)
            )
            track.held_codes.clear()
            chunk = replace(chunk, data=codes)
        elif chunk.data is None and not chunk.is_final:
            # A payload-only delivery (the talker's prefill conditioning, C-31): no codes to decode.
            return
        try:
            audio = self.code2wav.push(chunk)
        except Exception as exc:  # a decoder fault ends only this request (C-61)
            self._finish(track, ERROR, f"{self.code2wav.stage_id}: {type(exc).__name__}: {exc}")
            return
        if self.code2wav.stage_id not in track.stages:
            track.stages.append(self.code2wav.stage_id)
        track.audio_codes.extend(int(c) for c in audio.codes.tolist())
        if audio.samples.numel():
            if track.t_first_audio is None:
                track.t_first_audio = time.perf_counter()
            track.audio.append(audio.samples)
            self._events.append(PipelineEvent("audio", track.request_id, audio=audio))
        if chunk.is_final:
            self._finish(track, track.reasons.get(sid) or str(chunk.finish_reason))

    def _check_eof(self, sid: str) -> None:
        # A finished request whose terminal chunk never came (its processor or connector failed
        # after the stop was recorded) must still end, with an error (C-62).
        for track in list(self._tracks.values()):
            if not track.done and track.awaiting_eof == sid:
                self._finish(track, ERROR, f"stage {sid} made no terminal delivery")

    # ---- outcomes -----------------------------------------------------------------------------

    def _finish(self, track: _Track, reason: str, error: str | None = None) -> None:
        assert not track.done, f"{track.request_id}: second terminal outcome"
        track.done = True
        rid = track.request_id
        # Nothing of the request may survive in any stage (C-04, C-62).
        for engine in self.engines.values():
            engine.abort([rid])
        if self.code2wav is not None:
            self.code2wav.drop(rid)
        now = time.perf_counter()
        waveform = None
        if (
            track.final_stage == self.last_stage
            and self.code2wav is not None
            and reason not in (ABORT, ERROR)
        ):
            waveform = torch.cat(track.audio) if track.audio else torch.zeros(0)
        result = RequestResult(
            request_id=rid,
            prompt_token_ids=track.prompt_token_ids,
            final_stage=track.final_stage,
            finish_reason=reason,
            text_token_ids=list(track.text_ids),
            codec_token_ids=list(track.codec_ids),
            audio_codes=list(track.audio_codes),
            waveform=waveform,
            sample_rate=self.sample_rate if waveform is not None else None,
            num_audio_chunks=len(track.audio),
            stages=list(track.stages),
            stage_finish_reasons=dict(track.reasons),
            cached_prompt_tokens=dict(track.cached),
            error=error,
            time_to_first_text_token=None
            if track.t_first_text is None
            else track.t_first_text - track.t0,
            time_to_first_audio_chunk=(
                None if track.t_first_audio is None else track.t_first_audio - track.t0
            ),
            total_time=now - track.t0,
        )
        track.rows.clear()
        track.audio.clear()
        track.held_codes.clear()
        del self._tracks[rid]
        self._events.append(PipelineEvent("finished", rid, result=result))

    # ---- audits and teardown ------------------------------------------------------------------

    def leftovers(self) -> dict[str, Any]:
        """Per stage, whatever still holds a request (all empty when the pipeline is idle)."""
        out: dict[str, Any] = {sid: e.leftovers() for sid, e in self.engines.items()}
        if self.code2wav is not None:
            out[self.code2wav.stage_id] = {"decoders": sorted(self.code2wav.live_request_ids())}
        out["connectors"] = {sid: c.pending() for sid, c in self.connectors.items()}
        out["tracks"] = sorted(self._tracks)
        return out

    def is_clean(self) -> bool:
        def empty(v: Any) -> bool:
            if isinstance(v, dict):
                return all(empty(x) for x in v.values())
            return not v

        return empty(self.leftovers())

    def close(self) -> None:
        for conn in self.connectors.values():
            conn.close()
        for engine in self.engines.values():
            engine.shutdown()
        self.connectors.clear()
        self.engines.clear()
