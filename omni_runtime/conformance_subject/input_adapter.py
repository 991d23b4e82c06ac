"""The talker stage's ``InputAdapter`` as the suite probes it for malformed stage inputs (C-13,
C-60): the input's shapes, a live scheduler, and requests built from stage-input fields.
"""

from __future__ import annotations

from typing import Any

from conformance.api import (
    TIGHT,
    BaseSubject,
    StageInputSpec,
)
from omni_runtime.conformance_subject.stages import STAGES, talker_stage


class OmniInputAdapterProbe:
    """The talker stage's ``InputAdapter`` over a live omni scheduler."""

    spec = StageInputSpec(
        "talker",
        STAGES,
        hidden_size=64,
        vocab_size=512,
        max_model_len=128,
        id_tensors=True,
        trace_headers=True,
        request_fields=True,
        names_types=True,
    )

    def __init__(self, subject: BaseSubject) -> None:
        from omni_runtime.adapters import RequestRejected

        self.subject = subject
        self.rejection = RequestRejected

    def scheduler(self) -> Any:
        cfg = TIGHT.with_(additional_config={"omni_stage": talker_stage()})
        return self.subject.build_scheduler(cfg)

    def build(self, scheduler: Any, request_id: str, sampling_params: Any, **fields: Any) -> Any:
        from omni_runtime.adapters import InputAdapter, StageInput
        from omni_runtime.config import OmniStageConfig

        stage = OmniStageConfig.from_vllm_config(scheduler.vllm_config)
        assert stage is not None, "the probe's scheduler is built with an omni stage"
        adapter = InputAdapter(
            stage,
            max_model_len=self.spec.max_model_len,
            vocab_size=self.spec.vocab_size,
            hidden_size=self.spec.hidden_size,
            live_ids=scheduler.requests,
        )
        return adapter.build(StageInput(request_id, sampling_params, **fields))

    def additional_information(self, request: Any) -> Any:
        from omni_runtime.adapters.input import omni_state_of

        state = omni_state_of(request)
        return {} if state is None else state.additional_information
