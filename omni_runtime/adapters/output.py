"""The output adapter: runner tensors leave a stage only as typed, per-request payloads (C-11).

Scheduler side: ``payloads_by_request`` unpacks the payload list an ``OmniModelRunnerOutput``
carries, aligned with the runner's ``req_ids`` (C-51), into a mapping by request id.
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm.v1.outputs import ModelRunnerOutput

from omni_runtime.payload import StagePayload

_EMPTY: Mapping[str, StagePayload] = {}


def payloads_by_request(output: ModelRunnerOutput) -> Mapping[str, StagePayload]:
    payloads = getattr(output, "omni_payloads", None)
    if not payloads:
        return _EMPTY
    if len(payloads) != len(output.req_ids):
        raise ValueError(
            f"omni_payloads has {len(payloads)} slots for {len(output.req_ids)} requests (C-51)"
        )
    return {rid: p for rid, p in zip(output.req_ids, payloads, strict=True) if p is not None}
