"""Inline and background payload materialization (C-50 .. C-54).

The runner finishes every step that needs payloads by handing its ``ModelRunnerOutput``, the
step's ``PayloadPlan`` (scheduler metadata) and ``PayloadInputs`` (tensors) to a materializer:

* ``InlineMaterializer`` builds the payloads on the calling thread before returning, reading
  the runner's live buffers directly: they are consumed before the next execution can reuse
  them (C-53).
* ``BackgroundMaterializer`` snapshots the plan arrays and the tensors (private copies), submits
  the build to its single builder thread and returns a ``BackgroundOutput``: vLLM's
  ``AsyncModelRunnerOutput``, whose ``get_output()`` joins the build. vLLM's uni executor calls
  ``get_output()`` when the engine collects the step's result, so under async scheduling the
  build overlaps the next step's forward. Because the build reads only the snapshot, the runner
  may overwrite every buffer as soon as ``sample_tokens`` returns (C-52).

Both reuse the request-id list the runner built for ``ModelRunnerOutput.req_ids`` (C-53).
Connector output is collected by the runner on the calling thread before materialization and
never here (C-54). A build error is re-raised by ``get_output()``; should a caller drop a ``BackgroundOutput`` without
collecting it, a later ``finish`` raises its error instead, so an error is never lost (C-54).
vLLM's engine keeps at most ``max_concurrent_batches`` (2) steps in flight, so when step N
finishes only step N-1 may still be legitimately uncollected: anything older is abandoned, and
that is when it is joined.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from omni_runtime.adapters.output import PayloadBuilder, PayloadInputs, PayloadPlan
from omni_runtime.payload import OmniModelRunnerOutput, StagePayload
from omni_runtime.worker.vllm_compat import AsyncModelRunnerOutput, KVConnectorOutput


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
        self, output: OmniModelRunnerOutput, future: Future[list[StagePayload | None]]
    ) -> None:
        self._output = output
        self._future = future
        self.collected = False

    def get_output(self) -> OmniModelRunnerOutput:
        self.collected = True
        # Re-raises the builder's exception on the caller's thread (C-54).
        self._output.omni_payloads = self._future.result()
        return self._output

    def get_kv_connector_output(self) -> KVConnectorOutput | None:
        return self._output.kv_connector_output

    def done(self) -> bool:
        return self._future.done()


class BackgroundMaterializer:
    mode = "background"

    def __init__(self, builder: PayloadBuilder) -> None:
        self.builder = builder
        self._pool: ThreadPoolExecutor | None = None
        self._recent: deque[BackgroundOutput] = deque()
        self.builder_thread_ids: set[int] = set()

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            # One thread: builds of consecutive steps complete in step order.
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-payload")
        return self._pool

    def _build(self, plan: PayloadPlan, inputs: PayloadInputs) -> list[StagePayload | None]:
        self.builder_thread_ids.add(threading.get_ident())
        return self.builder.build(plan, inputs)

    def finish(
        self, output: OmniModelRunnerOutput, plan: PayloadPlan, inputs: PayloadInputs
    ) -> BackgroundOutput:
        self.raise_abandoned(keep=self.IN_FLIGHT)
        # Snapshot on the calling thread: after this line the runner's buffers are free.
        snap_plan, snap_inputs = plan.snapshot(), inputs.snapshot()
        future = self._executor().submit(self._build, snap_plan, snap_inputs)
        out = BackgroundOutput(output, future)
        self._recent.append(out)
        return out

    # Earlier steps the engine may still collect when a new step finishes: with vLLM's batch
    # queue of depth 2, step N-1 is collected right after step N is sampled.
    IN_FLIGHT = 1

    def raise_abandoned(self, keep: int = 0) -> None:
        """Join builds older than the newest ``keep`` that nobody collected; raise their error."""
        while self._recent and (self._recent[0].collected or len(self._recent) > keep):
            old = self._recent.popleft()
            if old.collected:
                continue
            exc = old._future.exception()
            if exc is not None:
                old.collected = True
                raise exc

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._recent.clear()


Materializer = InlineMaterializer | BackgroundMaterializer


def make_materializer(mode: str, builder: PayloadBuilder) -> Materializer:
    if mode == "inline":
        return InlineMaterializer(builder)
    if mode == "background":
        return BackgroundMaterializer(builder)
    raise ValueError(f"omni_stage.materialization: unknown mode {mode!r}")
