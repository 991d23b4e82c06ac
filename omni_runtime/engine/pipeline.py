"""``OmniPipeline``: the Python API over the orchestrator (text in; text, codec ids, audio out).

It owns text encoding (``omni_runtime.text``), request ids, the default token limits from the
pipeline file, and the two ways of consuming results: ``generate`` (wait for every outcome) and
``stream`` (events as they happen: text ids, audio chunks, outcomes).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from omni_runtime import text as text_codec
from omni_runtime.config import Materialization
from omni_runtime.engine.config import Backend, EngineOptions
from omni_runtime.engine.graph import ConnectorKind, PipelineConfig, load_pipeline_config
from omni_runtime.engine.orchestrator import Orchestrator, PipelineEvent, RequestResult

Prompt = str | Sequence[int]

DEFAULT_MAX_TEXT_TOKENS = 32
DEFAULT_MAX_CODEC_TOKENS = 64


class OmniPipeline:
    """The thinker -> talker -> code2wav pipeline (or any graph file) in this process.

    Switches that must not change any output: ``async_scheduling``, ``materialization``,
    ``prefix_caching`` and ``connector`` (C-22, C-52). ``torch_threads`` (default 1) is applied
    process-wide with ``torch.set_num_threads``; pass None to leave torch's setting alone.
    ``stream_audio=False`` holds codec ids until the talker finishes and decodes them at once
    (same waveform; the first audio arrives only at the end).
    """

    def __init__(
        self,
        config: PipelineConfig | str | os.PathLike[str] | None = None,
        *,
        async_scheduling: bool = True,
        materialization: Materialization = "inline",
        prefix_caching: bool = True,
        connector: ConnectorKind | None = None,
        seed: int = 0,
        torch_threads: int | None = 1,
        stream_audio: bool = True,
        backend: Backend = "inprocess",
        ray_address: str | None = None,
    ) -> None:
        if torch_threads is not None:
            # The embedded models are tiny: with more than one intra-op thread every matmul
            # pays a thread hand-off that costs ~100x the arithmetic (measured on 2 cores).
            torch.set_num_threads(torch_threads)
        if not isinstance(config, PipelineConfig):
            config = load_pipeline_config(Path(config) if config is not None else None)
        if connector is not None:
            config = config.with_connectors(connector)
        self.config = config
        self.options = EngineOptions(
            async_scheduling=async_scheduling,
            materialization=materialization,
            prefix_caching=prefix_caching,
            seed=seed,
            backend=backend,
            ray_address=ray_address,
        )
        self.orchestrator = Orchestrator(config, self.options, stream_audio=stream_audio)
        self._backlog: list[PipelineEvent] = []
        self._ids = itertools.count()

    # ---- properties ----------------------------------------------------------------------------

    @property
    def sample_rate(self) -> int | None:
        return self.orchestrator.sample_rate

    @property
    def stage_ids(self) -> tuple[str, ...]:
        return self.config.stage_ids

    # ---- requests ------------------------------------------------------------------------------

    def _limits(self, max_text_tokens: int | None, max_codec_tokens: int | None) -> dict[str, int]:
        d = self.config.defaults
        text = max_text_tokens or int(d.get("max_text_tokens", DEFAULT_MAX_TEXT_TOKENS))
        codec = max_codec_tokens or int(d.get("max_codec_tokens", DEFAULT_MAX_CODEC_TOKENS))
        ar = [s.id for s in self.config.ar_stages]
        return {sid: (text if i == 0 else codec) for i, sid in enumerate(ar)}

    def submit(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        max_text_tokens: int | None = None,
        max_codec_tokens: int | None = None,
        text_only: bool = False,
        request_ids: Sequence[str] | None = None,
    ) -> list[str]:
        """Admit prompts (text, or thinker token ids) without stepping; returns request ids."""
        items = _as_prompt_list(prompts)
        if request_ids is not None and len(request_ids) != len(items):
            raise ValueError(f"{len(request_ids)} request ids for {len(items)} prompts")
        limits = self._limits(max_text_tokens, max_codec_tokens)
        ids: list[str] = []
        try:
            for i, prompt in enumerate(items):
                rid = request_ids[i] if request_ids is not None else f"req-{next(self._ids)}"
                token_ids = text_codec.encode(prompt) if isinstance(prompt, str) else list(prompt)
                self.orchestrator.add(rid, token_ids, max_tokens=limits, text_only=text_only)
                ids.append(rid)
        except Exception:
            # All or nothing: the caller never learns these ids, so they must not run.
            if ids:
                self.orchestrator.abort(ids)
                self.orchestrator.discard_outcomes(ids)
            raise
        return ids

    def _advance(self) -> list[PipelineEvent]:
        events = self.orchestrator.step()
        for ev in events:
            if ev.result is not None:
                ev.result.text = text_codec.decode(ev.result.text_token_ids)
        return events

    def _split(self, events: list[PipelineEvent], wanted: set[str]) -> list[PipelineEvent]:
        """Events of ``wanted`` requests; the rest wait in the backlog for ``step``/``drain``."""
        mine = [ev for ev in events if ev.request_id in wanted]
        self._backlog.extend(ev for ev in events if ev.request_id not in wanted)
        return mine

    def has_work(self) -> bool:
        return bool(self._backlog) or self.orchestrator.has_work()

    def step(self) -> list[PipelineEvent]:
        """One step of every stage; returns new events (and any held for this caller)."""
        events, self._backlog = self._backlog, []
        if self.orchestrator.has_work():
            events.extend(self._advance())
        return events

    def abort(self, request_ids: str | Sequence[str]) -> list[str]:
        """Abort in every stage; each aborted request gets one "abort" outcome (C-62)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        return self.orchestrator.abort(ids)

    def drain(self) -> list[PipelineEvent]:
        """Step until no request is left and every stage has released everything."""
        events: list[PipelineEvent] = []
        while self.has_work():
            events.extend(self.step())
        return events

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        max_text_tokens: int | None = None,
        max_codec_tokens: int | None = None,
        text_only: bool = False,
        request_ids: Sequence[str] | None = None,
        on_step: Callable[[list[PipelineEvent]], Any] | None = None,
    ) -> list[RequestResult]:
        """Run prompts to completion; results in prompt order.

        Requests submitted earlier keep running alongside; their events are kept for the next
        ``step``/``drain`` call rather than returned here.
        """
        ids = self.submit(
            prompts,
            max_text_tokens=max_text_tokens,
            max_codec_tokens=max_codec_tokens,
            text_only=text_only,
            request_ids=request_ids,
        )
        wanted = set(ids)
        results: dict[str, RequestResult] = {}
        while len(results) < len(ids):
            if not self.orchestrator.has_work():
                missing = [rid for rid in ids if rid not in results]
                raise RuntimeError(f"pipeline went idle without outcomes for {missing}")
            events = self._split(self._advance(), wanted)
            for ev in events:
                if ev.result is not None:
                    results[ev.request_id] = ev.result
            if on_step is not None:
                on_step(events)
        return [results[rid] for rid in ids]

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        max_text_tokens: int | None = None,
        max_codec_tokens: int | None = None,
        text_only: bool = False,
        request_ids: Sequence[str] | None = None,
    ) -> Iterator[PipelineEvent]:
        """Events of these prompts as they are produced: ``text`` (new thinker ids), ``audio``
        (one decoded chunk of one request, while its talker still generates) and ``finished``
        (its outcome, last). Closing the iterator early aborts the requests it started."""
        ids = self.submit(
            prompts,
            max_text_tokens=max_text_tokens,
            max_codec_tokens=max_codec_tokens,
            text_only=text_only,
            request_ids=request_ids,
        )
        wanted = set(ids)
        open_ids = set(ids)
        try:
            while open_ids:
                for ev in self._split(self._advance(), wanted):
                    if ev.kind == "finished":
                        open_ids.discard(ev.request_id)
                    yield ev
        finally:
            if open_ids:
                # The consumer is gone: abort, and drop the outcomes nobody will read.
                self.abort(sorted(open_ids))
                self.orchestrator.discard_outcomes(sorted(open_ids))

    # ---- audits and teardown -------------------------------------------------------------------

    def leftovers(self) -> dict[str, Any]:
        return self.orchestrator.leftovers()

    def is_clean(self) -> bool:
        return self.orchestrator.is_clean()

    def close(self) -> None:
        self.orchestrator.close()

    def __enter__(self) -> OmniPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(isinstance(x, int) for x in items):
        return [items]  # one prompt given as token ids
    return items
