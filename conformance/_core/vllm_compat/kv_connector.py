"""What the harness reads of vLLM's shipped KV connectors' step metadata, and writes back.

The harness runs no worker, so the worker half of a connector is stood in for
(``conformance._core.kv_connectors.WorkerStandIn``): it reads which transfers a step's
``kv_connector_metadata`` starts and reports them finished as a worker would. The offloading
connector's metadata (``OffloadingConnectorMetadata``: load and store jobs by job id, the jobs
to flush) and its worker report (``OffloadingWorkerMetadata.completed_jobs``) are read and built
here, so a release that reshapes them is a change in this module only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OffloadJobs:
    """One step's offloading jobs: loads (job id -> (request id, synchronous?)), stores, and
    jobs the worker must finish before the step's forward pass."""

    loads: dict[int, tuple[str, bool]]
    stores: frozenset[int]
    flush: frozenset[int]


def offload_jobs(meta: Any) -> OffloadJobs | None:
    """``meta``'s jobs when it is the offloading connector's step metadata (None otherwise)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingConnectorMetadata,
        )
    except ImportError:  # a release without the offloading connector
        return None
    if not isinstance(meta, OffloadingConnectorMetadata):
        return None
    return OffloadJobs(
        loads={jid: (str(job.req_id), bool(job.sync)) for jid, job in meta.load_jobs.items()},
        stores=frozenset(meta.store_jobs),
        flush=frozenset(meta.jobs_to_flush or ()),
    )


def offload_worker_meta(completed: set[int]) -> Any:
    """The report of one worker that finished the jobs ``completed`` (None: none finished)."""
    if not completed:
        return None
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )

    return OffloadingWorkerMetadata(completed_jobs=dict.fromkeys(sorted(completed), 1))


def hisparse_worker_meta(meta: Any) -> Any | None:
    """What a worker reports to HiSparse's connector after a step whose metadata is ``meta``
    (``HiSparseConnectorMetadata``): every page transfer it was told to run, enqueued and
    completed on its one rank, and every host block copy done. None for another connector's
    metadata, or when the step moved nothing. Without these reports spills never finish:
    device pages stay pinned and host pages are never published."""
    command = getattr(meta, "command", None)
    copies = getattr(meta, "host_block_copies", None)
    if copies is None or not hasattr(meta, "row_mirrors"):
        return None
    from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector import (  # type: ignore[import-not-found]
        HiSparseConnectorWorkerMetadata,
    )

    ids = [t.transfer_id for t in command.page_transfers] if command is not None else []
    if not ids and not copies:
        return None
    return HiSparseConnectorWorkerMetadata(
        enqueued_transfer_counts={i: 1 for i in ids},
        completed_transfer_counts={i: 1 for i in ids},
        completed_host_copy_dst_ids=tuple(c.dst_block_id for c in copies),
    )
