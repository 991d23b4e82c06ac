"""Handles on the real model runner (C-22, C-30..C-31, C-50..C-55, C-61): the runner probes
(payload features, payloads and failures read from a step's output, reusable buffers, retry
budgets), the materialization probe that counts and faults background builds, and the worker's
fault containment.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import Any

import torch

from conformance.api import (
    Feature,
    PayloadView,
)
from omni_runtime.conformance_subject.delivery import payload_view
from omni_runtime.conformance_subject.stages import (
    CODEC_STREAMER,
    HIDDEN_FORWARDER,
    MODEL_KEY,
    POSTPROCESS_MODEL,
    STAGES,
    stage_of,
    thinker_stage,
)


class LazyFuture(Future):
    """A future whose work runs when its result is first asked for."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        super().__init__()
        self._call: tuple[Callable[..., Any], tuple[Any, ...]] | None = (fn, args)

    def _run(self) -> None:
        if self._call is not None:
            fn, args = self._call
            self._call = None
            try:
                self.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - delivered through the future
                self.set_exception(exc)

    def result(self, timeout: float | None = None) -> Any:
        self._run()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._run()
        return super().exception(timeout)

    def done(self) -> bool:
        return self._call is None


class DeferredPool:
    """An executor whose builds run on collection: buffer reuse always precedes the build."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> LazyFuture:
        return LazyFuture(fn, args)

    def shutdown(self, wait: bool = True) -> None:
        return None


class OmniMaterializationProbe:
    """Counts connector collections (and their threads) and builds of one runner."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.collector_threads: list[int] = []
        self.builds = 0
        self.build_threads: list[int] = []
        self._fail: tuple[int, BaseException] | None = None
        self._fail_request: tuple[str, BaseException, int | None] | None = None
        collect = runner.collect_connector_output
        build = runner.materializer.builder.build

        def collecting() -> Any:
            self.collector_threads.append(threading.get_ident())
            return collect()

        def building(plan: Any, inputs: Any) -> Any:
            self.builds += 1
            self.build_threads.append(threading.get_ident())
            if self._fail is not None and self.builds == self._fail[0]:
                raise self._fail[1]
            if self._fail_request is not None and self._fail_request[0] in plan.req_ids:
                rid, error, left = self._fail_request
                if left is None or len(plan.req_ids) > 1:
                    raise error
                if left > 0:  # the request alone: a fault that clears after ``times`` builds
                    self._fail_request = (rid, error, left - 1)
                    raise error
            return build(plan, inputs)

        runner.collect_connector_output = collecting
        runner.materializer.builder.build = building

    def fail_build(self, number: int, error: BaseException) -> None:
        self._fail = (number, error)

    def fail_request(self, request_id: str, error: BaseException, times: int | None = None) -> None:
        self._fail_request = (request_id, error, times)

    def builder_threads(self) -> set[int]:
        return set(getattr(self.runner.materializer, "builder_thread_ids", ()))


GRAPHS: dict[str, dict[str, Any]] = {
    "thinker>talker>code2wav": {
        "stages": list(STAGES),
        "downstream": ["talker"],
        "chunk_processor": HIDDEN_FORWARDER,
    },
    "thinker>talker": {
        "stages": ["thinker", "talker"],
        "downstream": ["talker"],
        "chunk_processor": None,
    },
    "thinker>talker(codec)": {
        "stages": list(STAGES),
        "downstream": ["talker"],
        "chunk_processor": CODEC_STREAMER,
    },
}


class OmniRunnerProbes:
    graphs = tuple(GRAPHS)

    def payload_feature(
        self,
        *,
        include_hidden: bool,
        full_prefix: bool,
        materialization: str = "inline",
        graph: str | None = None,
        multimodal: bool = False,
        postprocess: bool = False,
    ) -> Feature:
        stage = thinker_stage(
            include_hidden=include_hidden, full_prefix=full_prefix, materialization=materialization
        )
        if graph is not None:
            stage.update(GRAPHS[graph])
        if multimodal:
            # One output every model has and one the model adds (``omni_output_producers``).
            stage["multimodal_outputs"] = ["logits", "hidden_norm"]
        name = f"thinker-{include_hidden}-{full_prefix}-{materialization}-{graph}-{multimodal}"
        extra: dict[str, Any] = {"omni_stage": stage}
        if postprocess:
            # The thinker's weights, with the payload postprocess its config turns on
            # (``LlamaLM.omni_postprocess``, "positions"); ``worker_config`` loads it.
            extra[MODEL_KEY] = POSTPROCESS_MODEL
            name += "-post"
        return Feature(name, extra, use_worker=True)

    def postprocessed(self, payload: PayloadView) -> bool:
        """The model's postprocess ran on ``payload``: it carries the positions its rows
        cover (``LlamaLM.tag_positions``)."""
        positions = payload.multimodal.get("positions")
        expected = torch.arange(payload.start, payload.start + payload.num_tokens)
        return isinstance(positions, torch.Tensor) and torch.equal(positions, expected)

    def final_feature(self, include_hidden: bool) -> Feature:
        stage = thinker_stage(include_hidden=include_hidden, downstream=[], chunk_processor=None)
        # Per-token multimodal outputs too: what the stage would build had it a downstream.
        stage["multimodal_outputs"] = ["logits", "hidden_norm"]
        return Feature(f"thinker-final-{include_hidden}", {"omni_stage": stage}, use_worker=True)

    def unknown_output_feature(self, name: str) -> Feature:
        stage = thinker_stage(include_hidden=False, full_prefix=False, materialization="inline")
        stage["multimodal_outputs"] = ["logits", name]
        return Feature(f"thinker-unknown-output-{name}", {"omni_stage": stage}, use_worker=True)

    def includes_hidden(self, feature: Feature) -> bool:
        stage = stage_of(feature)
        return bool(stage) and bool(stage.get("omni_pooler_payload_include_hidden", True))

    def payloads(self, output: Any) -> list[PayloadView | None] | None:
        payloads = getattr(output, "omni_payloads", None)
        return None if payloads is None else [payload_view(p) for p in payloads]

    def failed_requests(self, output: Any) -> Mapping[str, str]:
        return dict(getattr(output, "omni_failed", None) or {})

    def retry_features(self) -> tuple[Feature, ...]:
        # Budgets other than the default (2): a materializer that ignored the stage's setting
        # would retry as often as with the default, and only another budget shows it.
        base = self.payload_feature(
            include_hidden=True, full_prefix=True, materialization="background", multimodal=True
        )
        features = []
        for retries in (0, 1, 3):
            stage = {**stage_of(base), "step_retries": retries}
            config = {**base.additional_config, "omni_stage": stage}
            features.append(Feature(f"{base.name}-retries{retries}", config, use_worker=True))
        return tuple(features)

    def recovery_builds(self, feature: Feature, n: int) -> int:
        """The step's own build, ``step_retries`` builds of the whole step again, then each
        request alone: once for those that build, ``1 + step_retries`` times for the one that
        keeps failing (``omni_runtime.worker.materialize.recover_build``)."""
        retries = int(stage_of(feature).get("step_retries", 2))
        return 1 + retries + (n - 1) + (1 + retries)

    def reusable_buffers(self, runner: Any) -> Iterable[Any]:
        return runner.persistent_buffers().values()

    def defer_background_builds(self, runner: Any) -> None:
        # The materializer asks ``_executor()`` for its pool on every build.
        runner.materializer._executor = DeferredPool

    def instrument(self, runner: Any) -> OmniMaterializationProbe:
        return OmniMaterializationProbe(runner)

    def shutdown(self, runner: Any) -> None:
        runner.shutdown()


class OmniFaultContainment:
    """C-61: the runner retries a faulting step, then splits the batch to pin a persistent
    fault on its request (``omni_runtime.worker.recovery``); the scheduler fails that request."""

    cause_field = "omni_error"

    def stage_name(self, additional_config: Mapping[str, Any]) -> str | None:
        # Causes start with the stage id ("thinker: send path: ...", "thinker: payload build").
        stage = additional_config.get("omni_stage")
        return str(stage.get("stage_id")) if isinstance(stage, Mapping) else None

    def feature(self, materialization: str) -> Feature:
        feature = OmniRunnerProbes().payload_feature(
            include_hidden=True, full_prefix=False, materialization=materialization
        )
        # Requests may also end at the thinker (nothing of theirs goes downstream).
        return dataclasses.replace(feature, final_stages=(None, "thinker"))

    def embedding(self, worker: Any) -> Any:
        return worker.model.get_input_embeddings()

    def shutdown(self, worker: Any) -> None:
        worker.shutdown()
