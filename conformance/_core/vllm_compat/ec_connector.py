"""What the harness reads of vLLM's encoder-cache (EC) connectors, as plain values.

An ``ec_transfer_config`` gives the scheduler an EC connector: it builds the step's
``SchedulerOutput.ec_connector_metadata``, receives a worker's ``ECConnectorOutput`` through
``update_connector_output`` and puts what ``request_finished`` returns on a finished request's
output (``ec_transfer_params``). Whether the instance is encoder-only (it stops a request once its
prompt is consumed, and its runner samples nothing) is keyed by release here.
"""

from __future__ import annotations

from typing import Any

from conformance._core.vllm_compat.stats import plain
from conformance._core.vllm_compat.versions import ByRelease, Change

# The ``VllmConfig`` property saying the instance runs the encoder only (``Scheduler``'s stop
# without sampling reads the same property under the same name).
# "" where the release has no encoder-only instance at all.
_ENCODER_ONLY_FLAG: ByRelease[str] = ByRelease(
    "encoder-only flag",
    "",
    [
        Change(
            "0.28.0",
            "is_encoder_only",
            "VllmConfig.is_encoder_only added: an EC producer-only instance stops a request once "
            "its prompt is consumed, without sampling",
        ),
        Change(
            "0.29.0",
            "is_mm_encoder_only",
            "is_encoder_only became is_mm_encoder_only: an EC producer-only instance is "
            "encoder-only only with a multimodal model (a text model's is refused)",
        ),
    ],
)


def encoder_only_flag() -> str:
    """The name of the encoder-only property, on ``VllmConfig`` and on the ``Scheduler``
    ("" before 0.28, which has none)."""
    return _ENCODER_ONLY_FLAG.value()


def encoder_only(vllm_config: Any) -> bool:
    """Whether ``vllm_config`` is an encoder-only instance (0.28: any EC producer-only one;
    never before 0.28)."""
    flag = encoder_only_flag()
    return bool(flag) and bool(getattr(vllm_config, flag))


def ec_metadata(so: Any) -> Any:
    """The step's EC connector metadata as plain values (None when the step carries none)."""
    meta = getattr(so, "ec_connector_metadata", None)
    if meta is None:
        return None
    return {"kind": type(meta).__name__, "fields": plain(meta)}


def ec_transfer_params(out: Any) -> Any:
    """A request output's ``ec_transfer_params`` as plain values (None when unset)."""
    params = getattr(out, "ec_transfer_params", None)
    return None if params is None else plain(params)


def empty_ec_output() -> Any:
    """The ``ECConnectorOutput`` a runner returns for a step in which its EC connector finished
    no transfer (``get_finished`` of a connector with nothing in flight: no ids)."""
    from vllm.v1.outputs import ECConnectorOutput

    return ECConnectorOutput()
