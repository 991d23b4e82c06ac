"""A small step loop for scheduler unit tests: the scheduler's own classes, a pure token rule,
and the talker stage those tests run.

Tokens are a pure function of (request id, position), so two schedulers given the same requests
produce the same streams whatever their batching; partial prefill chunks sample nothing, as a real
runner does. Payloads, when asked for, are real ``StagePayload`` objects whose hidden rows encode
their token positions, so tests can see exactly which positions crossed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput

from omni_runtime.config import OmniStageConfig
from omni_runtime.conformance_subject import STAGES, talker_stage
from omni_runtime.payload import OmniModelRunnerOutput, StagePayload

__all__ = ["STAGES", "TALKER", "FailMarkedRequests", "run_to_completion", "step", "token_of"]

# The subject's talker stage without its chunk processor (payloads go downstream as they are):
# the stage the scheduler and input-adapter tests install processors into themselves.
TALKER = OmniStageConfig.from_dict(
    talker_stage(chunk_processor=None, omni_pooler_payload_include_hidden=True)
)


def token_of(request_id: str, position: int, vocab: int = 500) -> int:
    digest = hashlib.sha256(f"{request_id}:{position}".encode()).digest()
    return 3 + int.from_bytes(digest[:4], "little") % (vocab - 3)


def runner_output(
    scheduler,
    so: SchedulerOutput,
    *,
    payload: Callable[[str, int, int], StagePayload | None] | None = None,
    token: Callable[[str, int], int] = token_of,
) -> ModelRunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    sampled: list[list[int]] = []
    payloads: list[StagePayload | None] = []
    for rid in req_ids:
        req = scheduler.requests[rid]
        n = so.num_scheduled_tokens[rid]
        end = req.num_computed_tokens  # already advanced by schedule()
        start = end - n
        sampled.append([] if req.is_prefill_chunk else [token(rid, end)])
        payloads.append(payload(rid, start, n) if payload is not None else None)
    cls = OmniModelRunnerOutput if payload is not None else ModelRunnerOutput
    kwargs = {"omni_payloads": payloads} if payload is not None else {}
    return cls(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        **kwargs,
    )


def hidden_payload(rid: str, start: int, n: int) -> StagePayload:
    rows = torch.arange(start, start + n, dtype=torch.float32).unsqueeze(1).repeat(1, 4)
    return StagePayload(request_id=rid, start=start, num_tokens=n, hidden=rows)


def step(scheduler, **kw):
    so = scheduler.schedule()
    out = runner_output(scheduler, so, **kw)
    return so, scheduler.update_from_output(so, out)


def run_to_completion(scheduler, max_steps: int = 500, **kw) -> list:
    results = []
    for _ in range(max_steps):
        if not scheduler.has_requests():
            break
        results.append(step(scheduler, **kw))
    return results


class FailMarkedRequests:
    """A chunk processor whose send path breaks for requests whose id contains ``fail``.

    Loaded by dotted path (``tests.sched_steps.FailMarkedRequests``) from a stage config, the way
    a real processor is, to drive the C-61 fault path through the unmodified runtime.
    """

    requires_token_updates = True

    def __call__(self, request_id, payload, is_final, new_token_ids=None):
        if "fail" in request_id and new_token_ids:
            raise RuntimeError(f"{request_id}: injected processor fault")
        return new_token_ids
