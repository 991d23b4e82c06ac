"""``RayStageEngine``: an AR stage whose vLLM ``EngineCore`` runs inside a Ray actor.

The actor (``StageActor``) holds an ordinary in-process ``StageEngine``, so admission, stepping,
aborts and fault recovery are the in-process backend's code. This class gives the orchestrator
that surface (``backends.StageBackend``) from the driver's side: one actor per AR stage, placed
by the stage's ``ray_resources`` in a Ray session it joins, reuses or starts (``RaySession``);
validation in the driver before anything is sent; a waited-for call per step, adds and aborts
sent without waiting; chunks back with each step, through shared memory on the driver's host
(``adapters.shm_wire``) or Ray's object store across hosts, handed to the stage's connector
(a refused chunk fails its request, C-61); a dead actor fails exactly the requests it held and
is replaced.

Ray is an optional extra (``pip install 'omni-conformance[ray]'``), imported only when this
backend is chosen. Details: docs/design.md, "A stage in its own process, or on another machine".
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from omni_runtime.adapters.input import InputAdapter, RequestRejected, StageInput
from omni_runtime.adapters.shm_wire import (
    ShmChunkWriter,
    live_segments,
    read_chunks,
    sweep_segments,
)
from omni_runtime.engine.config import EngineOptions
from omni_runtime.engine.graph import ARStageSpec
from omni_runtime.engine.remote import (
    BackendUnavailable,
    StageProcessDied,
    fail_held,
    refused_as_errors,
    route_chunks,
)
from omni_runtime.engine.stage import StageEngine, StageOutput, StageStep
from omni_runtime.sched.transfer import ChunkSink, OutboxSink

__all__ = ["RaySession", "RayStageEngine", "StageActor", "actor_env"]

logger = logging.getLogger(__name__)

# The driver's environment that decides what a stage computes or where it finds its models.
_ENV_PREFIXES = ("HF_", "VLLM_", "OMNI_RUNTIME_")
_ENV_NAMES = ("PYTHONHASHSEED",)
# A local Ray instance's object store: chunks are small; Ray's default (30% of RAM) would
# reserve gigabytes of /dev/shm on a shared host for nothing.
_LOCAL_OBJECT_STORE_BYTES = 256 * 1024 * 1024
# A local Ray instance's logical CPUs: room for every stage's ``ray_resources.num_cpus``.
_LOCAL_LOGICAL_CPUS = 64


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise BackendUnavailable(
            "backend 'ray' needs Ray: pip install 'omni-conformance[ray]'"
        ) from exc
    return ray


def actor_env() -> dict[str, str]:
    """The driver's variables a stage actor must share (see the module docstring)."""
    return {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES}


# How long joining a cluster may take to open a connection before it is refused (seconds).
_CONNECT_TIMEOUT = 10.0


def _reachable(address: str) -> None:
    """Refuse an address nothing listens on, before Ray retries it for minutes."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return  # "auto", a client URL or a bare host: Ray's own resolution applies
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), _CONNECT_TIMEOUT).close()
    except OSError as exc:
        raise BackendUnavailable(
            f"--ray-address {address}: no Ray cluster answers there ({exc})"
        ) from exc


class RaySession:
    """This process's connection to Ray, shared by its stage engines.

    Joins ``address`` when one is given; uses Ray as already initialised in this process (a
    test's or an application's own ``ray.init``) when there is one; otherwise starts a local
    instance sized for the stages. Only an instance this class started is shut down, when the
    last stage engine using it releases it.
    """

    _lock = threading.Lock()
    _users = 0
    _owned = False

    @classmethod
    def acquire(cls, address: str | None) -> Any:
        ray = _ray()
        with cls._lock:
            if not ray.is_initialized():
                kwargs: dict[str, Any] = {
                    "runtime_env": {"env_vars": actor_env()},
                    "log_to_driver": False,
                    "include_dashboard": False,
                }
                if address is None:
                    # Ray's CPUs are bookkeeping, not a thread limit. Sized from the first stage
                    # alone, a later stage's reservation could find nothing left and its actor
                    # would wait for ever; the stages share the host's cores either way.
                    cpus = max(os.cpu_count() or 1, _LOCAL_LOGICAL_CPUS)
                    kwargs.update(num_cpus=cpus, object_store_memory=_LOCAL_OBJECT_STORE_BYTES)
                else:
                    _reachable(address)
                    kwargs["address"] = address
                try:
                    ray.init(**kwargs)
                except Exception as exc:
                    where = f"--ray-address {address}" if address else "a local Ray instance"
                    raise BackendUnavailable(f"{where}: cannot start or join Ray: {exc}") from exc
                cls._owned = True
            cls._users += 1
        return ray

    @classmethod
    def release(cls) -> None:
        ray = _ray()
        with cls._lock:
            cls._users = max(0, cls._users - 1)
            if cls._users == 0 and cls._owned:
                cls._owned = False
                ray.shutdown()


class StageActor:
    """The actor side: one ``StageEngine`` and the sink its chunks wait in until the step returns.

    A plain class; ``RayStageEngine`` makes it a Ray actor with the stage's resources.
    """

    def __init__(
        self,
        spec: ARStageSpec,
        stages: tuple[str, ...],
        options: EngineOptions,
        driver_node: str,
        shm_prefix: str,
        torch_threads: int,
    ) -> None:
        import ray

        # Ray sets OMP_NUM_THREADS from the reserved CPUs; the stage computes with the driver's
        # thread count instead, so its results do not depend on where it was placed.
        torch.set_num_threads(torch_threads)
        self.node = str(ray.get_runtime_context().get_node_id())
        self.engine = StageEngine(spec, stages, options)
        self.writer: ShmChunkWriter | None = None
        self.outbox: OutboxSink | None = None
        if spec.downstream:
            # Shared memory only when the driver can open it: on the driver's own host.
            if self.node == driver_node:
                self.writer = ShmChunkWriter(shm_prefix)
                self.engine.set_sink(self.writer)
            else:
                self.outbox = OutboxSink()
                self.engine.set_sink(self.outbox)
        # Requests the actor's own adapter refused, reported by the next step.
        self.refused: list[StageOutput] = []

    def describe(self) -> dict[str, Any]:
        hf = self.engine.vllm_config.model_config.hf_config
        return {
            "pid": os.getpid(),
            "node": self.node,
            "shm": self.writer is not None,
            "omni_stage": self.engine.adapter.stage,
            "vocab_size": int(hf.vocab_size),
            "free_blocks": self.engine.num_free_blocks(),
        }

    def add(self, item: StageInput) -> None:
        try:
            self.engine.add(item)
        except RequestRejected as exc:
            self.refused.append(
                StageOutput(item.request_id, [], "error", f"{self.engine.stage_id}: {exc}")
            )

    def abort(self, request_ids: list[str]) -> None:
        self.engine.abort(request_ids)
        # EOF chunks the abort delivered belong to requests whose outcome the driver decided.
        self._drop_chunks()

    def step(self) -> tuple[list[StageOutput], bool, str | None, list[Any], bool]:
        """One engine step: outputs, executed, the fault (as text), the chunks, has_work."""
        result = self.engine.step()
        outputs = self.refused + result.outputs
        self.refused = []
        fault = result.fault
        text = None if fault is None else f"{type(fault).__name__}: {fault}"
        return outputs, result.executed, text, self._take_chunks(), self.has_work()

    def has_work(self) -> bool:
        return bool(self.refused) or self.engine.has_work()

    def _take_chunks(self) -> list[Any]:
        if self.writer is not None:
            return list(self.writer.flush()) if len(self.writer) else []
        return self.outbox.drain() if self.outbox is not None else []

    def _drop_chunks(self) -> None:
        if self.writer is not None:
            self.writer.discard()
        elif self.outbox is not None:
            self.outbox.drain()

    def leftovers(self) -> dict[str, Any]:
        out = self.engine.leftovers()
        out["outbox"] = len(self.writer or self.outbox or ())
        out["refused"] = [o.request_id for o in self.refused]
        return out

    def num_free_blocks(self) -> int:
        return self.engine.num_free_blocks()

    def call_worker(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> list[Any]:
        return self.engine.call_worker(fn, *args)

    def close(self) -> None:
        self.engine.shutdown()


class RayStageEngine:
    """One AR stage in a Ray actor; see the module docstring."""

    def __init__(self, spec: ARStageSpec, stages: tuple[str, ...], options: EngineOptions) -> None:
        self.spec = spec
        self.stage_id = spec.id
        self.stages = stages
        self.options = options
        self.steps = 0
        self.restarts = 0
        self.ray = RaySession.acquire(options.ray_address)
        self._released = False
        self._actor_cls = self.ray.remote(max_restarts=0, max_task_retries=0)(StageActor)
        # Ids sent to the actor whose terminal output has not come back and that were not
        # aborted: what the actor's death fails.
        self._held: set[str] = set()
        # The actor's own answer, as of its last step, to whether it still has work (e.g. a
        # finished request whose scheduler bookkeeping clears on the next step).
        self._actor_busy = False
        self._sink: ChunkSink | None = None
        self._actor: Any = None
        self._info: dict[str, Any] = {}
        self._prefix = ""
        try:
            self._start()
        except BaseException:
            self._release()
            raise
        self.adapter = InputAdapter(
            self._info["omni_stage"],
            max_model_len=spec.max_model_len,
            vocab_size=self._info["vocab_size"],
            hidden_size=spec.prompt_embeds_dim,
            # Blocks are hashed where they are cached, in the actor.
            block_hasher=None,
            live_ids=self._held,
        )
        self.initial_free_blocks = int(self._info["free_blocks"])

    # ---- the actor -----------------------------------------------------------------------------

    def _start(self) -> None:
        ray = self.ray
        self._prefix = f"omni-ray-{os.getpid()}-{self.stage_id}-{uuid.uuid4().hex[:8]}"
        # An engine nobody shut down: whatever its actor left on this host is swept at exit.
        weakref.finalize(self, sweep_segments, self._prefix)
        driver_node = str(ray.get_runtime_context().get_node_id())
        actor = self._actor_cls.options(**self.spec.ray_resources.actor_options()).remote(
            self.spec, self.stages, self.options, driver_node, self._prefix, torch.get_num_threads()
        )
        self._actor = actor
        self._info = ray.get(actor.describe.remote())
        self._actor_busy = False

    @property
    def pid(self) -> int:
        """The actor's process id (tests kill it)."""
        return int(self._info["pid"])

    @property
    def node(self) -> str:
        """The Ray node the actor runs on."""
        return str(self._info["node"])

    @property
    def uses_shared_memory(self) -> bool:
        """True when chunks come back through shared memory, False through Ray's object store."""
        return bool(self._info.get("shm"))

    @property
    def shm_prefix(self) -> str:
        return self._prefix

    def _kill(self) -> None:
        actor, self._actor = self._actor, None
        if actor is None:
            return
        try:
            self.ray.get(actor.close.remote(), timeout=30)
        except Exception:  # already dead, or stuck: killed below either way
            pass
        self.ray.kill(actor, no_restart=True)
        sweep_segments(self._prefix)

    def _restart(self, cause: str) -> list[StageOutput]:
        """Fail what the dead actor held, clean up after it and start a fresh one."""
        failed = fail_held(self.stage_id, self._held, cause)
        self._kill()
        self._start()
        self.restarts += 1
        return failed

    # ---- wiring --------------------------------------------------------------------------------

    def set_sink(self, sink: ChunkSink) -> None:
        """Where this stage's chunks go; only the orchestrator calls this (C-21)."""
        if not self.spec.downstream:
            raise ValueError(f"stage {self.stage_id!r} has no downstream to send to")
        self._sink = sink

    # ---- requests ------------------------------------------------------------------------------

    def add(self, item: StageInput) -> None:
        """Validate and admit one request; raises ``RequestRejected`` before anything is sent."""
        self.adapter.build(item)
        self._live_actor().add.remote(item)
        self._held.add(item.request_id)

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        """Abort the given ids that are live here; unknown ids are a no-op (C-60)."""
        live = [rid for rid in request_ids if rid in self._held]
        if live:
            self._held.difference_update(live)
            self._live_actor().abort.remote(live)
        return live

    def _live_actor(self) -> Any:
        if self._actor is None:
            raise RuntimeError(f"stage {self.stage_id!r} is shut down")
        return self._actor

    def num_requests(self) -> int:
        return len(self._held)

    def has_work(self) -> bool:
        return bool(self._held) or self._actor_busy

    # ---- stepping ------------------------------------------------------------------------------

    def step(self) -> StageStep:
        if not self.has_work():
            return StageStep()
        self.steps += 1
        ray = self.ray
        try:
            outputs, executed, fault, wire, busy = ray.get(self._live_actor().step.remote())
        except ray.exceptions.RayActorError as exc:
            cause = f"actor died ({type(exc).__name__})"
            return StageStep(self._restart(cause), True, StageProcessDied(cause))
        self._actor_busy = bool(busy)
        for out in outputs:
            if out.finish_reason is not None:
                self._held.discard(out.request_id)
        chunks = read_chunks(wire) if self.uses_shared_memory else wire
        result = StageStep(list(outputs), bool(executed), RuntimeError(fault) if fault else None)
        refused = route_chunks(self.stage_id, self._sink, chunks)
        if refused:
            self.abort(list(refused))
            result.outputs = refused_as_errors(result.outputs, refused)
        return result

    # ---- audits --------------------------------------------------------------------------------

    def num_free_blocks(self) -> int:
        return int(self.ray.get(self._live_actor().num_free_blocks.remote()))

    def call_worker(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(worker, *args)`` in the actor, through its engine's ``collective_rpc``
        (``StageBackend``); ``fn`` travels by Ray's pickling."""
        return list(self.ray.get(self._live_actor().call_worker.remote(fn, args)))

    def leftovers(self) -> dict[str, Any]:
        """Everything that still holds a request, in the actor and here."""
        out: dict[str, Any] = dict(self.ray.get(self._live_actor().leftovers.remote()))
        out["held"] = sorted(self._held)
        out["shm_segments"] = live_segments(self._prefix)
        return out

    def is_clean(self) -> bool:
        return not any(self.leftovers().values())

    def shutdown(self) -> None:
        try:
            self._kill()
        finally:
            self._release()

    def _release(self) -> None:
        if not self._released:
            self._released = True
            RaySession.release()
