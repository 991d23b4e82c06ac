"""``MPStageEngine``: an AR stage whose vLLM ``EngineCore`` runs in its own process.

vLLM's own multiprocess client (``vllm_compat.OmniSyncMPClient``, a ``SyncMPClient``) starts and
drives vLLM's ``EngineCoreProc`` with the uni executor, ``OmniARWorker`` and the schedulers in
their process form (``sched.process_stage``). This class gives the orchestrator the surface of
the in-process ``StageEngine``: requests are validated here by the stage's ``InputAdapter`` and
sent as ``EngineCoreRequest``s with the omni slot in ``SamplingParams.extra_args``; ``step``
turns the messages that arrived into ``StageOutput``s and hands the chunks they name
(``adapters.shm_wire.read_chunks``) to the orchestrator's sink; a fault the worker raises fails
that step's requests (``vllm_compat.FaultContainingExecutor``); a dead engine process fails
exactly the requests it held, naming the stage, and a fresh one is started.

How admission, outputs, aborts, faults, death and segment sweeping work: docs/design.md, "A
stage in its own process, or on another machine".
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable
from multiprocessing import resource_tracker
from typing import Any

from vllm.v1.engine import EngineCoreRequest
from vllm.v1.request import Request

from omni_runtime.adapters.input import (
    EXTRA_ARGS_KEY,
    InputAdapter,
    StageInput,
    omni_state_of,
    slot_to_extra_args,
)
from omni_runtime.adapters.shm_wire import (
    ShmEngineCoreOutputs,
    live_segments,
    read_chunks,
    release_descriptors,
    sweep_segments,
)
from omni_runtime.config import OmniStageConfig
from omni_runtime.engine import vllm_compat as compat
from omni_runtime.engine.config import EngineOptions, stage_vllm_config
from omni_runtime.engine.graph import ARStageSpec
from omni_runtime.engine.remote import (
    StageProcessDied,
    fail_held,
    refused_as_errors,
    route_chunks,
)
from omni_runtime.engine.stage import StageOutput, StageStep
from omni_runtime.platform import install_for_process
from omni_runtime.sched.process_stage import (
    PARENT_CLIENT,
    PROCESS_STAGE_KEY,
    ProcessStageAsyncScheduler,
    ProcessStageScheduler,
)
from omni_runtime.sched.transfer import ChunkSink

__all__ = ["MPStageEngine", "StageProcessDied"]

logger = logging.getLogger(__name__)

_SYNC = f"{ProcessStageScheduler.__module__}.{ProcessStageScheduler.__qualname__}"
_ASYNC = f"{ProcessStageAsyncScheduler.__module__}.{ProcessStageAsyncScheduler.__qualname__}"

# How long ``step`` waits for a message when no stage process has one ready (seconds). Any
# stage process's message ends the wait at once (``_Arrivals``), so this only bounds the wait
# when everything is slow; it keeps an idle orchestrator from spinning on shared cores.
_WAIT = 0.05


class _Arrivals:
    """Wakes an orchestrator waiting in any stage's ``step`` when any stage's message arrives.

    One per process: the orchestrator steps stages one after another, so waiting on one stage's
    queue alone would stall it while another stage already has outputs.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._count = 0

    def notify(self) -> None:
        with self._cond:
            self._count += 1
            self._cond.notify_all()

    def wait(self, ready: Any, timeout: float) -> None:
        """Return once ``ready()`` holds, a message was decoded after entry, or at ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            seen = self._count
            while not ready():
                left = deadline - time.monotonic()
                if left <= 0 or self._count != seen:
                    return
                # Short slices: a message decoded just before entry is queued a moment later
                # without another notification.
                self._cond.wait(min(left, 0.002))


_ARRIVALS = _Arrivals()
_LIVE: set[MPStageEngine] = set()


def _anything_ready() -> bool:
    return any(e._queued() for e in list(_LIVE))


class MPStageEngine:
    """One AR stage in its own engine process; see the module docstring."""

    def __init__(self, spec: ARStageSpec, stages: tuple[str, ...], options: EngineOptions) -> None:
        install_for_process()
        self.spec = spec
        self.stage_id = spec.id
        self.stages = stages
        self.options = options
        self.steps = 0
        self.restarts = 0
        # Ids sent to the engine process whose terminal output has not arrived and that were not
        # aborted: what a death of the process fails.
        self._held: set[str] = set()
        # Error outputs of requests a dead process held, found outside ``step`` (in ``add``).
        self._pending_failures: list[StageOutput] = []
        # Admissions sent since the last release (see ``sched.process_stage``).
        self._unreleased = False
        self._sink: ChunkSink | None = None
        self._prefix = ""
        self._client: compat.OmniSyncMPClient | None = None
        self._start()
        omni_stage = OmniStageConfig.from_vllm_config(self.vllm_config)
        hf = self.vllm_config.model_config.hf_config
        self.adapter = InputAdapter(
            omni_stage or OmniStageConfig(spec.id, stages),
            max_model_len=spec.max_model_len,
            vocab_size=int(hf.vocab_size),
            hidden_size=spec.prompt_embeds_dim,
            # Blocks are hashed where they are cached, in the engine process.
            block_hasher=None,
            live_ids=self._held,
        )
        self.initial_free_blocks = self.num_free_blocks()

    # ---- the process -------------------------------------------------------------------------

    def _start(self) -> None:
        self.vllm_config = stage_vllm_config(self.spec, self.stages, self.options)
        sched = self.vllm_config.scheduler_config
        sched.scheduler_cls = _ASYNC if self.options.async_scheduling else _SYNC
        # One prefix per engine and generation: a restart sweeps exactly its predecessor's.
        self._prefix = f"omni-{os.getpid()}-{self.stage_id}-{uuid.uuid4().hex[:8]}"
        # The stdlib's shared-memory tracker must run here before the engine process is forked:
        # a child that starts its own would leave one more process behind.
        resource_tracker.ensure_running()
        # An engine nobody shut down: at exit, after vLLM's own finalizer stopped the process
        # (finalizers run newest first, and this one is older), whatever it left is swept.
        weakref.finalize(self, sweep_segments, self._prefix)
        extra: dict[str, Any] = dict(self.vllm_config.additional_config or {})  # type: ignore[arg-type]
        extra[PROCESS_STAGE_KEY] = {"shm_prefix": self._prefix}
        self.vllm_config.additional_config = extra
        self._client = compat.OmniSyncMPClient(
            self.vllm_config, ShmEngineCoreOutputs, on_message=_ARRIVALS.notify
        )
        _LIVE.add(self)

    @property
    def client(self) -> compat.OmniSyncMPClient:
        if self._client is None:
            raise RuntimeError(f"stage {self.stage_id!r} is shut down")
        return self._client

    @property
    def pid(self) -> int | None:
        """The engine process's pid (tests kill it)."""
        procs = compat.client_processes(self.client)
        return procs[0].pid if procs else None

    @property
    def shm_prefix(self) -> str:
        return self._prefix

    def _stop(self) -> None:
        client, self._client = self._client, None
        _LIVE.discard(self)
        if client is None:
            return
        try:
            if not compat.client_engine_dead(client):
                # vLLM's engine process runs its SIGTERM handler (which starts its shutdown) in
                # its main thread only, and an idle engine's main thread sleeps on its input
                # queue; when the kernel hands the signal to another thread, nothing wakes it
                # and vLLM's shutdown waits out its 5 s grace, then kills. So: signal first,
                # then a message, which wakes the main thread to run the handler.
                for proc in compat.client_processes(client):
                    if proc.is_alive():
                        proc.terminate()
                with contextlib.suppress(Exception):
                    compat.call_child_scheduler_nowait(client, "audit")
            client.shutdown()
        finally:
            # Messages nobody will read still own segments; then whatever the process left.
            self._drop_queued(client)
            sweep_segments(self._prefix)

    @staticmethod
    def _drop_queued(client: compat.OmniSyncMPClient) -> None:
        q = compat.client_outputs_queue(client)
        while True:
            try:
                item = q.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, ShmEngineCoreOutputs) and item.omni_chunks:
                release_descriptors(item.omni_chunks)

    def _restart(self, cause: str) -> list[StageOutput]:
        """Fail what the dead process held, clean up after it and start a fresh one."""
        failed = fail_held(self.stage_id, self._held, cause)
        self._stop()
        self._unreleased = False
        self._start()
        self.restarts += 1
        return failed

    def _dead(self) -> bool:
        return self._client is not None and compat.client_engine_dead(self._client)

    # ---- wiring ------------------------------------------------------------------------------

    def set_sink(self, sink: ChunkSink) -> None:
        """Where this stage's chunks go; only the orchestrator calls this (C-21)."""
        if not self.spec.downstream:
            raise ValueError(f"stage {self.stage_id!r} has no downstream to send to")
        self._sink = sink

    # ---- requests ----------------------------------------------------------------------------

    def add(self, item: StageInput) -> None:
        """Validate and admit one request; raises ``RequestRejected`` before anything crosses."""
        request = self.adapter.build(item)
        if self._dead():
            # Nothing is held by a dead process that a step has not failed yet; fail those
            # now (they are reported by the next step) so the new request reaches a live one.
            self._pending_failures.extend(self._restart("engine process died"))
        self.client.add_request(self._engine_core_request(request))
        self._held.add(request.request_id)
        self._unreleased = True

    @staticmethod
    def _engine_core_request(request: Request) -> EngineCoreRequest:
        """``request`` as vLLM's engine core client sends it, with its omni slot, if it has
        one, in ``SamplingParams.extra_args`` (where the stage process takes it back out)."""
        params = request.sampling_params
        state = omni_state_of(request)
        if state is not None:
            params = copy.copy(params)
            assert params is not None
            params.extra_args = {
                **(params.extra_args or {}),
                EXTRA_ARGS_KEY: slot_to_extra_args(state),
            }
        return EngineCoreRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            # The images' identifiers key the stage's encoder cache and its block hashes.
            mm_features=request.mm_features or None,
            sampling_params=params,
            # A pooling stage's requests carry these instead of sampling parameters.
            pooling_params=request.pooling_params,
            arrival_time=request.arrival_time,
            lora_request=request.lora_request,
            cache_salt=request.cache_salt,
            data_parallel_rank=None,
            prompt_embeds=request.prompt_embeds,
            # The stage process has one client, this engine: its output thread routes each
            # output to the socket of its request's client, and a request keyed to any other
            # index would have its outputs sent to a socket that does not exist (the stage
            # then never finishes it). Outputs come back here by request id either way.
            client_index=PARENT_CLIENT,
            priority=request.priority,
            trace_headers=request.trace_headers,
            # A streaming session's input (and the end of its stream) is folded into the live
            # request by the stage's scheduler: it must arrive as such.
            resumable=request.resumable,
        )

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        """Abort the given ids that are live here; unknown ids are a no-op (C-60)."""
        live = [rid for rid in request_ids if rid in self._held]
        if not live:
            return []
        self._held.difference_update(live)
        if not self._dead():
            self.client.abort_requests(live)
        return live

    def num_requests(self) -> int:
        return len(self._held)

    def has_work(self) -> bool:
        return bool(self._held) or bool(self._pending_failures) or self._queued()

    def _queued(self) -> bool:
        client = self._client
        return client is not None and not compat.client_outputs_queue(client).empty()

    # ---- stepping ----------------------------------------------------------------------------

    def step(self) -> StageStep:
        if not self.has_work():
            return StageStep()
        self.steps += 1
        if self._pending_failures:
            failed, self._pending_failures = self._pending_failures, []
            return StageStep(failed, True, StageProcessDied(failed[0].error or ""))
        if self._dead():
            failed = self._restart("engine process died")
            return StageStep(failed, True, StageProcessDied(f"{self.stage_id}: process died"))
        if self._unreleased:
            # Everything admitted before this step enters the engine's queue together, as it
            # would in process; the message follows the adds on the same ordered socket.
            self._unreleased = False
            compat.call_child_scheduler_nowait(self.client, "release")
        q = compat.client_outputs_queue(self.client)
        if q.empty() and self._held:
            _ARRIVALS.wait(_anything_ready, _WAIT)
        result = StageStep()
        failures: dict[str, str] = {}
        while True:
            try:
                item = q.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Exception):
                # The output thread stopped: the process is gone or said it is dead.
                failed = self._restart(f"engine process died ({type(item).__name__}: {item})")
                return StageStep(result.outputs + failed, True, item)
            self._take(item, result, failures)
        if failures:
            self._fail_sends(result, failures)
        if not result.outputs and self._dead():
            failed = self._restart("engine process died")
            return StageStep(failed, True, StageProcessDied(f"{self.stage_id}: process died"))
        return result

    def _take(self, eco: Any, result: StageStep, failures: dict[str, str]) -> None:
        chunks = read_chunks(eco.omni_chunks) if getattr(eco, "omni_chunks", None) else []
        if eco.outputs:
            result.executed = True
        for out in eco.outputs:
            if out.finish_reason is not None:
                self._held.discard(out.request_id)
            result.outputs.append(StageOutput.of(out))
        # Chunks of a request refused earlier in this step stay unsent (C-61).
        pending = [c for c in chunks if c.request_id not in failures]
        failures.update(route_chunks(self.stage_id, self._sink, pending))

    def _fail_sends(self, result: StageStep, failures: dict[str, str]) -> None:
        """Requests whose chunk the sink refused: aborted in the process, reported as errors."""
        self.abort(list(failures))
        result.outputs = refused_as_errors(result.outputs, failures)

    # ---- audits ------------------------------------------------------------------------------

    def _audit(self) -> dict[str, Any] | None:
        if self._client is None or self._dead():
            return None
        audit: dict[str, Any] = {}
        for _ in range(50):
            audit = dict(compat.call_child_scheduler(self.client, "audit"))
            # Ids finished since the last schedule() are cleared by the engine process's next
            # (empty) step, which it takes on its own right after: give it that moment.
            if not audit["finished_unsent"] or audit["scheduler_requests"]:
                break
            time.sleep(0.01)
        return audit

    def num_free_blocks(self) -> int:
        audit = self._audit()
        return int(audit["free_blocks"]) if audit is not None else 0

    def call_worker(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(worker, *args)`` in the engine process, through vLLM's ``collective_rpc``
        utility call (``StageBackend``)."""
        return list(self.client.collective_rpc(fn, args=args))

    def leftovers(self) -> dict[str, Any]:
        """Everything that still holds a request, in the engine process and here."""
        audit = self._audit() or {}
        free = audit.pop("free_blocks", self.initial_free_blocks)
        out: dict[str, Any] = {
            "staged": audit.get("staged", []),
            "scheduler_requests": audit.get("scheduler_requests", []),
            "running": audit.get("running", []),
            "waiting": audit.get("waiting", 0),
            "finished_unsent": audit.get("finished_unsent", []),
            "blocks_in_use": self.initial_free_blocks - int(free),
            "transfer_progress": audit.get("transfer_progress", []),
            "processor_buffers": audit.get("processor_buffers", []),
            "outbox": audit.get("outbox", 0),
            "held": sorted(self._held),
            "queued_messages": compat.client_outputs_queue(self.client).qsize()
            if self._client is not None
            else 0,
            "shm_segments": live_segments(self._prefix),
        }
        return out

    def is_clean(self) -> bool:
        return not any(self.leftovers().values())

    def shutdown(self) -> None:
        self._stop()
