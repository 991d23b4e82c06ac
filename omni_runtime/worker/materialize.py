"""Inline and background payload materialization (C-50 .. C-54).

The runner ends every step that needs payloads by handing its ``ModelRunnerOutput``, the step's
``PayloadPlan`` and ``PayloadInputs`` to a materializer:

* ``InlineMaterializer`` builds on the calling thread before returning, from the live buffers
  (C-53);
* ``BackgroundMaterializer`` snapshots plan and tensors, builds on its one builder thread and
  returns a ``BackgroundOutput`` (vLLM's ``AsyncModelRunnerOutput``) whose ``get_output()``
  joins the build, so the runner may reuse every buffer at once (C-52).

Both reuse the runner's ``req_ids`` list (C-53). A build error is never lost: ``get_output()``
recovers from the snapshot (``recover_build``) and reports a request whose build keeps failing
on ``omni_failed`` (C-54, C-61). Threads, recovery and abandoned outputs: docs/design.md, "Inside
the layers"; C-50..C-54 in docs/contracts.md.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from omni_runtime.adapters.output import PayloadBuilder, PayloadInputs, PayloadPlan
from omni_runtime.payload import OmniModelRunnerOutput, StagePayload
from omni_runtime.worker.recovery import describe
from omni_runtime.worker.vllm_compat import AsyncModelRunnerOutput, KVConnectorOutput

logger = logging.getLogger(__name__)


def recover_build(
    builder: PayloadBuilder, plan: PayloadPlan, inputs: PayloadInputs, retries: int
) -> tuple[list[StagePayload | None], dict[str, BaseException]]:
    """A step's payloads after its build raised: the whole build again, up to ``retries``
    times, then each request alone (each up to ``1 + retries`` times). Returns the payloads
    (None for a request whose build kept failing) and those requests with their last error."""
    for _ in range(retries):
        try:
            return builder.build(plan, inputs), {}
        except Exception:  # noqa: BLE001 - the per-request pass below pins what persists
            continue
    payloads: list[StagePayload | None] = []
    failed: dict[str, BaseException] = {}
    for i, rid in enumerate(plan.req_ids):
        payload: StagePayload | None = None
        for _ in range(1 + retries):
            try:
                [payload] = builder.build(plan.only(i), inputs.only(i))
                failed.pop(rid, None)
                break
            except Exception as exc:  # noqa: BLE001 - pinned on this request
                failed[rid] = exc
        payloads.append(payload)
    return payloads, failed


class InlineMaterializer:
    mode = "inline"

    def __init__(self, builder: PayloadBuilder) -> None:
        self.builder = builder

    def finish(
        self, output: OmniModelRunnerOutput, plan: PayloadPlan, inputs: PayloadInputs
    ) -> OmniModelRunnerOutput:
        output.omni_payloads = self.builder.build(plan, inputs)
        return output

    def shutdown(self) -> None:
        return None


class BackgroundOutput(AsyncModelRunnerOutput):
    """A step's output whose payloads are still being built on the builder thread."""

    def __init__(
        self,
        output: OmniModelRunnerOutput,
        future: Future[list[StagePayload | None]],
        recover: Callable[[], tuple[list[StagePayload | None], dict[str, BaseException]]],
        stage: str = "?",
    ) -> None:
        self._output = output
        self._future = future
        self._recover = recover
        self._stage = stage
        self.collected = False

    def get_output(self) -> OmniModelRunnerOutput:
        self.collected = True
        try:
            payloads = self._future.result()
        except Exception as exc:
            # The builder's error, on the caller's thread (C-54): recovered here, and what
            # persists fails only the requests it is on (C-61).
            payloads, failed = self._recover()
            if failed:
                logger.warning(
                    "stage %s: payload build fault %s pinned on %s",
                    self._stage,
                    describe(exc),
                    sorted(failed),
                )
                causes = dict(self._output.omni_failed or {})
                for rid, err in failed.items():
                    causes.setdefault(rid, f"{self._stage}: payload build: {describe(err)}")
                self._output.omni_failed = causes
        self._output.omni_payloads = payloads
        return self._output

    def get_kv_connector_output(self) -> KVConnectorOutput | None:
        return self._output.kv_connector_output

    def done(self) -> bool:
        return self._future.done()


class BackgroundMaterializer:
    mode = "background"

    def __init__(self, builder: PayloadBuilder, *, retries: int = 2, stage: str = "?") -> None:
        self.builder = builder
        self.retries = retries
        self.stage = stage
        self._pool: ThreadPoolExecutor | None = None
        self._recent: deque[BackgroundOutput] = deque()
        self.builder_thread_ids: set[int] = set()
        self._torch_threads = threading.local()  # per builder thread: the count it last set

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            # One thread: builds of consecutive steps complete in step order.
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-payload")
        return self._pool

    def _build(
        self, plan: PayloadPlan, inputs: PayloadInputs, threads: int
    ) -> list[StagePayload | None]:
        self.builder_thread_ids.add(threading.get_ident())
        # torch's intra-op thread count is per thread: a new thread computes with the process
        # default, not what the worker set (``torch.set_num_threads``), and a matmul split over
        # another count sums in another order. Producers (e.g. logits) would then differ from
        # the inline build in the last bits (C-50); the builder computes as the runner does.
        if getattr(self._torch_threads, "count", None) != threads:
            torch.set_num_threads(threads)
            self._torch_threads.count = threads
        return self.builder.build(plan, inputs)

    def finish(
        self, output: OmniModelRunnerOutput, plan: PayloadPlan, inputs: PayloadInputs
    ) -> BackgroundOutput:
        self.raise_abandoned(keep=self.IN_FLIGHT)
        # Snapshot on the calling thread: after this line the runner's buffers are free.
        snap_plan, snap_inputs = plan.snapshot(), inputs.snapshot()
        future = self._executor().submit(
            self._build, snap_plan, snap_inputs, torch.get_num_threads()
        )
        out = BackgroundOutput(
            output,
            future,
            lambda: recover_build(self.builder, snap_plan, snap_inputs, self.retries),
            self.stage,
        )
        self._recent.append(out)
        return out

    # Earlier steps the engine may still collect when a new step finishes: with vLLM's batch
    # queue of depth 2, step N-1 is collected right after step N is sampled.
    IN_FLIGHT = 1

    def raise_abandoned(self, keep: int) -> None:
        """Join builds older than the newest ``keep`` that nobody collected; raise their error."""
        while self._recent and (self._recent[0].collected or len(self._recent) > keep):
            old = self._recent.popleft()
            if old.collected:
                continue
            exc = old._future.exception()
            if exc is not None:
                raise exc

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._recent.clear()


Materializer = InlineMaterializer | BackgroundMaterializer


def make_materializer(
    mode: str, builder: PayloadBuilder, *, retries: int = 2, stage: str = "?"
) -> Materializer:
    if mode == "inline":
        # Inline builds are part of the runner's step: its own recovery retries them.
        return InlineMaterializer(builder)
    if mode == "background":
        return BackgroundMaterializer(builder, retries=retries, stage=stage)
    raise ValueError(f"omni_stage.materialization: unknown mode {mode!r}")
