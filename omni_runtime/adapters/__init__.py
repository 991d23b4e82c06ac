"""Adapters: the only code that turns stage data into vLLM objects and runner tensors into payloads.

``input``  — stage inputs -> upstream ``Request`` + the one declared omni slot (C-10, C-13).
``output`` — runner tensors -> per-request ``StagePayload`` and back out of runner outputs (C-11).
"""

from omni_runtime.adapters.input import (
    DECLARED_REQUEST_ATTRIBUTES,
    InputAdapter,
    OmniRequest,
    OmniRequestState,
    RequestRejected,
    StageInput,
    omni_state_of,
)

__all__ = [
    "DECLARED_REQUEST_ATTRIBUTES",
    "InputAdapter",
    "OmniRequest",
    "OmniRequestState",
    "RequestRejected",
    "StageInput",
    "omni_state_of",
]
