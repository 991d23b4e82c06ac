"""A workload per entry of ``omni_runtime.differences`` that makes its difference happen (C-03),
and the deliberately faulty chunk processor one of them loads by dotted path.
"""

from __future__ import annotations

from typing import Any

from conformance.api import (
    AddRequest,
    DifferenceWitness,
    Feature,
    Step,
)
from omni_runtime.conformance_subject.stages import TOKEN_UPDATES, talker_stage


class FailMarkedRequests:
    """A chunk processor whose send path breaks for requests whose id contains ``fail``: the
    fault that makes OMNI-ERR-001 happen in its witness (C-03), loaded by dotted path from the
    stage config like any processor, so the unmodified runtime takes its own fault path."""

    requires_token_updates = True

    def __call__(
        self, request_id: str, payload: Any, is_final: bool, new_token_ids: Any = None
    ) -> Any:
        if "fail" in request_id and new_token_ids:
            raise RuntimeError(f"{request_id}: injected processor fault")
        return new_token_ids


def difference_witnesses() -> tuple[DifferenceWitness, ...]:
    """One workload per entry of ``omni_runtime.differences`` that makes it happen (C-03)."""
    token_updates = Feature.from_config(*TOKEN_UPDATES)
    send_fault = Feature(
        "send-fault",
        {"omni_stage": talker_stage(chunk_processor=f"{__name__}.FailMarkedRequests")},
    )
    steps = tuple(Step() for _ in range(12))
    return (
        # A request with a downstream consumer: its outputs carry chunk references and the EOF.
        DifferenceWitness(
            "OMNI-OUT-001",
            token_updates,
            (AddRequest("w-out", tuple(range(10, 30)), max_tokens=4), *steps[:6]),
        ),
        # The send path raises for one request: it alone is failed, its neighbour completes.
        DifferenceWitness(
            "OMNI-ERR-001",
            send_fault,
            (
                AddRequest("ok-1", tuple(range(10, 30)), max_tokens=6),
                AddRequest("fail-1", tuple(range(40, 60)), max_tokens=6),
                *steps,
            ),
        ),
    )
