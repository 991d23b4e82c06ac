"""vllm-omni's chunk transfer path as the gate's chunk delivery (C-21, C-40..C-45, C-51, C-61).

An AR stage with ``async_chunk`` builds vllm-omni's ``OmniChunkTransferAdapter``: each step's
``update_from_output`` hands a request's inter-stage output (or its end) to ``save_async``, a
background thread runs the stage's ``custom_process_next_stage_input_func`` over it and puts the
resulting ``OmniPayloadStruct`` through the stage's connector. Here that connector is vllm-omni's
own ``SharedMemoryConnector``, registered in process under ``CONNECTOR_NAME``: every chunk is
written to shared memory and read back as the next stage reads it, and what was read goes to the
gate's sink. The adapter's two background loops are stopped at construction and run one pass at
a time on the harness's thread after every step (``pump``), so a run is deterministic: the
sender has sent everything a step queued before the next operation. Nothing here imports
vllm-omni at import time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from conformance.api import ChunkView, Feature, PayloadView

CONNECTOR_NAME = "OmniConformanceSharedMemoryConnector"
FEATURE_KEY = "vllm_omni_stage"
# The flat inter-stage key the harness's synthetic rows travel under (``OmniPayloadStruct.hidden``).
HIDDEN_KEY = "hidden"

# A thinker stage that streams to a downstream stage through the connector: vllm-omni then calls
# ``save_async`` for every request's inter-stage outputs and its end.
CHUNK_STAGE: dict[str, Any] = {
    "async_chunk": True,
    "final_output": False,
    # The stage id also in the connector's own config: 0.28 reads it only there.
    "stage_connector_config": {"name": CONNECTOR_NAME, "extra": {"role": "sender", "stage_id": 0}},
}


class ChunkInbox:
    """Where chunks go while the gate installed no sink of its own."""

    def __init__(self) -> None:
        self.chunks: list[Any] = []

    def send(self, chunk: Any) -> None:
        self.chunks.append(chunk)

    def drain(self) -> list[Any]:
        out, self.chunks = self.chunks, []
        return out


class ReadChunk:
    """One chunk as the next stage read it back from shared memory: its connector key
    (``<external id>_<stage>_<chunk index>``) and the decoded ``OmniPayloadStruct`` (a dict)."""

    def __init__(self, key: str, data: Any) -> None:
        self.key = key
        self.data = data

    def __repr__(self) -> str:
        return f"ReadChunk({self.key!r})"


def register_connector() -> None:
    """Register ``CONNECTOR_NAME`` with vllm-omni's connector factory (once per process)."""
    from vllm_omni.distributed.omni_connectors.connectors.shm_connector import (
        SharedMemoryConnector,
    )
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory

    if CONNECTOR_NAME in OmniConnectorFactory.list_registered_connectors():
        return

    class ReadBackConnector(SharedMemoryConnector):  # type: ignore[misc]
        """vllm-omni's shared-memory connector whose every put is read back, as the next stage
        would read it, and handed to ``sink``; a sink that raises is a failed put."""

        sink: Any = None

        def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> Any:
            ok, size, meta = super().put(from_stage, to_stage, put_key, data)
            if ok:
                got = self.get(from_stage, to_stage, put_key, meta)
                if got is None:
                    return False, 0, None
                # ``step_driven`` gives every connector a sink before its first put.
                self.sink.send(ReadChunk(put_key, got[0]))
            return ok, size, meta

    OmniConnectorFactory.register_connector(CONNECTOR_NAME, ReadBackConnector)


class _OnePass:
    """Stands in for a transfer loop's stop event so that the loop body runs exactly once on the
    caller's thread (the loops' threads are stopped): the first ``is_set`` after ``arm`` says
    no, every later one says yes. ``set`` is what the adapter's ``shutdown`` calls."""

    def __init__(self) -> None:
        self._armed = False

    def arm(self) -> None:
        self._armed = True

    def is_set(self) -> bool:
        armed, self._armed = self._armed, False
        return not armed

    def set(self) -> None:
        self._armed = False


def step_driven(adapter: Any) -> None:
    """Stop the adapter's background loops (idle at construction) and let ``pump`` run them."""
    adapter.stop_event.set()
    for cond in (adapter._recv_cond, adapter._save_cond):
        with cond:
            cond.notify_all()
    for thread in (adapter.recv_thread, adapter.save_thread):
        thread.join(timeout=5)
    adapter.stop_event = _OnePass()
    if adapter.connector is not None and getattr(adapter.connector, "sink", False) is None:
        adapter.connector.sink = ChunkInbox()


def pump(adapter: Any) -> None:
    """One pass of the adapter's send loop (everything queued) and of its receive loop."""
    gate = adapter.stop_event
    if not isinstance(gate, _OnePass):
        return
    gate.arm()
    adapter.save_loop()
    gate.arm()
    adapter.recv_loop()


def transfer_adapter(scheduler: Any) -> Any:
    return getattr(scheduler, "chunk_transfer_adapter", None)


def _hidden_of(data: Any) -> torch.Tensor | None:
    if isinstance(data, Mapping):
        hidden = data.get(HIDDEN_KEY)
        if isinstance(hidden, torch.Tensor):
            return hidden
    return None


def payload_view(payload: Any, request_id: str = "") -> PayloadView | None:
    """An inter-stage output (``{"hidden": rows}``) or a read chunk's data as the suite reads
    payloads: row ``i`` of the harness's synthetic rows holds (owner, position)."""
    hidden = _hidden_of(payload)
    if hidden is None:
        return None
    start = int(hidden[0, 1].item()) if hidden.shape[0] else -1
    return PayloadView(request_id, start, int(hidden.shape[0]), hidden, has_tensors=True)


def as_payload_struct(returned: Any) -> Any:
    """What a harness processor returned, as vllm-omni's processors return it: None sends
    nothing; rows (a payload dict) go as ``hidden``; ids as ``ids.output``; anything else as a
    chunk that carries nothing the next stage reads."""
    from vllm_omni.data_entry_keys import IdsStruct, OmniPayloadStruct

    if returned is None:
        return None
    hidden = _hidden_of(returned)
    if hidden is not None:
        return OmniPayloadStruct(hidden=hidden)
    if isinstance(returned, tuple) and all(isinstance(t, int) for t in returned):
        return OmniPayloadStruct(ids=IdsStruct(output=list(returned)))
    return OmniPayloadStruct()


def vllm_omni_processor(processor: Callable[..., Any]) -> Callable[..., Any]:
    """The harness's ``processor(request_id, payload, is_final[, new_token_ids])`` in vllm-omni's
    form (``transfer_manager``, ``multimodal_output``, ``request``, ``is_finished`` and, when the
    processor takes them, ``new_token_ids``: vllm-omni reads that from the signature)."""
    import inspect

    takes_ids = "new_token_ids" in inspect.signature(processor).parameters

    if takes_ids:

        def with_ids(
            transfer_manager: Any,
            multimodal_output: Any,
            request: Any,
            is_finished: bool,
            new_token_ids: Sequence[int] = (),
        ) -> Any:
            # vllm-omni hands an immutable snapshot; the harness's processors take a list.
            ids = list(new_token_ids)
            got = processor(
                harness_id(request.external_req_id), multimodal_output, is_finished, ids
            )
            return as_payload_struct(got)

        return with_ids

    def without_ids(
        transfer_manager: Any, multimodal_output: Any, request: Any, is_finished: bool
    ) -> Any:
        rid = harness_id(request.external_req_id)
        return as_payload_struct(processor(rid, multimodal_output, is_finished))

    return without_ids


class VllmOmniChunkDelivery:
    """``ChunkDelivery`` over vllm-omni's ``OmniChunkTransferAdapter`` (see the module
    docstring)."""

    processor_feature = Feature("chunk-contracts", {FEATURE_KEY: CHUNK_STAGE})
    # vllm-omni's processors have no token-update declaration: it calls one for a step that
    # carried an inter-stage output and at the request's end (``save_async``), passing the
    # step's ids to one whose signature names ``new_token_ids``.
    processor_shapes: tuple[str, ...] = ("payload-driven",)
    # An abort sends no terminal chunk: the adapter reclaims the sender (``finish_requests``),
    # and vllm-omni's orchestrator aborts the request in every stage itself.
    abort_eof = False
    # Nor does an error finish: the orchestrator answers a stage's ``FinishReason.ERROR`` output
    # by reporting the error and aborting the request in every stage
    # (``Orchestrator._handle_stage_error`` -> ``_cleanup_request_ids(..., abort=True)``).
    error_eof = False

    def install_sink(self, scheduler: Any, sink: Any) -> bool:
        adapter = transfer_adapter(scheduler)
        if adapter is None or adapter.connector is None:
            return False
        adapter.connector.sink = sink
        return True

    def view(self, chunk: Any) -> ChunkView:
        external_id, _, seq = chunk.key.rsplit("_", 2)
        external_id = harness_id(external_id)
        data = chunk.data if isinstance(chunk.data, Mapping) else {}
        meta = data.get("meta") or {}
        finished = meta.get("finished")
        is_final = bool(finished.item()) if isinstance(finished, torch.Tensor) else bool(finished)
        ids = (data.get("ids") or {}).get("output")
        return ChunkView(
            external_id,
            int(seq),
            is_final,
            tuple(int(t) for t in ids) if ids is not None else None,
            payload_view(data, external_id),
        )

    def payload_view(self, payload: Any) -> PayloadView | None:
        return payload_view(payload)

    def expected_tokens(self, feature: Feature, accepted: Sequence[int]) -> list[int] | None:
        return None

    def set_processor(self, scheduler: Any, processor: Callable[..., Any]) -> None:
        transfer_adapter(scheduler).custom_process_next_stage_input_func = vllm_omni_processor(
            processor
        )

    def with_payloads(self, output: Any, rows: Sequence[tuple[int, torch.Tensor] | None]) -> Any:
        from vllm_omni.outputs import OmniModelRunnerOutput

        inter = [None if r is None else {HIDDEN_KEY: r[1]} for r in rows]
        return OmniModelRunnerOutput(
            req_ids=output.req_ids,
            req_id_to_index=output.req_id_to_index,
            sampled_token_ids=output.sampled_token_ids,
            inter_stage_outputs=inter if any(x is not None for x in inter) else None,
        )


# ---- a receiving stage (C-47) --------------------------------------------------------------

# A talker stage fed by the thinker's chunks: vllm-omni parks each of its requests
# (``WAITING_FOR_CHUNK``) until a chunk for it has been read, and after the final one lets it run.
RECEIVING_STAGE: dict[str, Any] = {
    "stage_id": 1,
    "model_stage": "talker",
    "async_chunk": True,
    "final_output": True,
    "stage_connector_config": {
        "name": "SharedMemoryConnector",
        "extra": {"role": "receiver", "stage_id": 1},
    },
}

# The same talker fed a whole payload at once (vllm-omni's full-payload stage input,
# ``requires_full_payload_input``): its scheduler's ``OmniSchedulingCoordinator`` parks each new
# request in ``WAITING_FOR_INPUT`` until the stage's runner reports the payload received
# (``OmniConnectorOutput.stage_recv_req_ids``).
FULL_PAYLOAD_STAGE: dict[str, Any] = {
    "stage_id": 1,
    "model_stage": "talker",
    "async_chunk": False,
    "final_output": True,
    "requires_full_payload_input": True,
}

# Where the adapter keeps a request waiting for chunks outside the scheduler's queues (the
# parked request objects), and every per-request record of its receiving side, by attribute.
_PARKED_QUEUES = (
    "waiting_for_chunk_waiting_requests",
    "waiting_for_chunk_running_requests",
    "_held_non_active",
)
_RECEIVER_RECORDS = (
    "_registered_load_entries",
    "get_req_chunk",
    "_pending_ar_prompt_updates",
    "_finished_load_reqs",
    "requests_with_ready_chunks",
    "requests_origin_status",
    "upstream_exhausted_requests",
    "segment_finished_requests",
    "replaced_streaming_prompt_ids",
    "_waiting_since",
    "_active_streams",
    "_streaming_condition_lengths",
    "_streaming_condition_seqs",
)


# The full-payload coordinator's per-request records (requests, handles, ids), by attribute.
# (``pending_input_registrations`` is not one: it is the step's outgoing message to the runner,
# rebuilt at every schedule, as a ``SchedulerOutput`` is.)
_COORDINATOR_RECORDS = (
    "_waiting_for_input",
    "_waiting_since",
    "_full_payload_input_received",
    "finished_requests",
)


class VllmOmniReceivingStage:
    """``ReceivingStage`` over vllm-omni's two ways for a talker to wait for the thinker.

    Streamed chunks (``feature``): a chunk arrives as the thinker's adapter would write it,
    through vllm-omni's ``SharedMemoryConnector``, under the connector key the talker polls
    (``<external id>_0_<index>``); the adapter's receive loop then reads it (one pass, ``pump``).
    A whole payload (``FULL_PAYLOAD``): only the final arrival means anything, and it reaches the
    scheduler as the stage's runner reports it, an ``OmniConnectorOutput`` naming the request in
    ``stage_recv_req_ids``."""

    feature = Feature("receiving-stage", {FEATURE_KEY: RECEIVING_STAGE})
    FULL_PAYLOAD = Feature("full-payload-stage", {FEATURE_KEY: FULL_PAYLOAD_STAGE})

    def __init__(self, omni_version: tuple[int, int] = (0, 30)) -> None:
        # The coordinator's full-payload path reaches the AR scheduler from 0.28 on.
        self.features = (
            (self.feature, self.FULL_PAYLOAD) if omni_version >= (0, 28) else (self.feature,)
        )

    @staticmethod
    def _thinker(adapter: Any) -> Any:
        """The upstream stage's connector, one per receiving adapter and living as long as it:
        a connector that is closed unlinks the chunks it wrote and nobody read yet."""
        sender = getattr(adapter, "_conformance_thinker", None)
        if sender is None:
            from vllm_omni.distributed.omni_connectors.connectors.shm_connector import (
                SharedMemoryConnector,
            )

            sender = adapter._conformance_thinker = SharedMemoryConnector({"stage_id": 0})
        return sender

    def arrive(self, scheduler: Any, request_id: str, final: bool) -> None:
        from vllm_omni.data_entry_keys import MetaStruct, OmniPayloadStruct

        adapter = transfer_adapter(scheduler)
        request = scheduler.requests.get(request_id)
        if request is None:
            return  # a chunk for a request the stage no longer has: nobody reads it
        if adapter is None:
            if final and _coordinator(scheduler) is not None:
                _report_payload_received(scheduler, request_id)
            return
        sender = self._thinker(adapter)
        sent = sender.config.setdefault("conformance_chunks_sent", {})
        index = sent.get(request_id, 0)
        sent[request_id] = index + 1
        payload = OmniPayloadStruct(meta=MetaStruct(finished=torch.tensor(final)))
        key = f"{request.external_req_id}_0_{index}"
        ok, _, _ = sender.put("0", "1", key, payload)
        if not ok:
            raise RuntimeError(f"shared memory refused the scripted chunk {key}")
        pump(adapter)

    def parked(self, scheduler: Any) -> dict[str, int]:
        # Waiting for a chunk, or for the whole payload: vllm-omni's added statuses. Between
        # steps such a request is back in the scheduler's queue (``restore_queues``); during one
        # it sits in the adapter's (or the coordinator's) lists.
        adapter = transfer_adapter(scheduler)
        held = {
            rid: 0
            for rid, request in scheduler.requests.items()
            if getattr(request.status, "name", "") in ("WAITING_FOR_CHUNK", "WAITING_FOR_INPUT")
        }
        for name in _PARKED_QUEUES:
            for request in getattr(adapter, name, ()) if adapter is not None else ():
                held[request.request_id] = held.get(request.request_id, 0) + 1
        coordinator = _coordinator(scheduler)
        for request in getattr(coordinator, "_waiting_for_input", ()):
            held[request.request_id] = held.get(request.request_id, 0) + 1
        return held

    def held_for(self, scheduler: Any, request_id: str) -> list[str]:
        adapter = transfer_adapter(scheduler)
        if adapter is None:
            coordinator = _coordinator(scheduler)
            return [
                name
                for name in _COORDINATOR_RECORDS
                if any(
                    getattr(item, "request_id", item) == request_id
                    for item in getattr(coordinator, name, ())
                )
            ]
        found = [
            n
            for n in _PARKED_QUEUES
            if any(r.request_id == request_id for r in getattr(adapter, n, ()))
        ]
        found += [n for n in _RECEIVER_RECORDS if request_id in getattr(adapter, n, ())]
        return found


def _coordinator(scheduler: Any) -> Any:
    """The scheduler's ``OmniSchedulingCoordinator`` (a full-payload stage's), if any."""
    return getattr(scheduler, "input_coordinator", None)


def _report_payload_received(scheduler: Any, request_id: str) -> None:
    """What the stage's runner sends once a request's whole payload has arrived: an
    ``OmniConnectorOutput`` with the request in ``stage_recv_req_ids``, through the scheduler's
    inbox for runner events (0.30) or as the runner output it captures (0.28)."""
    from vllm_omni.outputs import OmniConnectorOutput

    enqueue = getattr(scheduler, "enqueue_omni_connector_output", None)
    if enqueue is not None:
        enqueue(OmniConnectorOutput(stage_recv_req_ids={request_id}))
        return
    # 0.28 keeps the last runner output's connector output (one slot, read at the next
    # schedule): a runner reports everything received between two steps in one output, so a
    # second arrival joins the first instead of replacing it.
    pending = getattr(scheduler, "_latest_omni_connector_output", None)
    if pending is not None:
        pending.stage_recv_req_ids.add(request_id)
        return
    output = OmniConnectorOutput(stage_recv_req_ids={request_id})
    scheduler._capture_omni_connector_output(SimpleNamespace(omni_connector_output=output))


def unique_external_id(request_id: str, scheduler: Any) -> str:
    """The external id a streaming or receiving stage's request gets: connector keys live in the
    machine's shared memory, so each scheduler's keys must not meet another's (a parallel
    worker's, or an earlier session's unread chunk for the same request id)."""
    import os

    return f"{request_id}.{os.getpid()}.{id(scheduler):x}"


def harness_id(external_id: str) -> str:
    """The harness's request id inside ``unique_external_id``'s (its ids hold no dot)."""
    return external_id.split(".", 1)[0]
