"""Encoder-cache (EC) connectors as scheduler axes: the ``ECTransferConfig`` a ``HarnessConfig``
selects, and what a runner of that instance reports.

``HarnessConfig.ec_connector`` names a connector registered with vLLM's ``ECConnectorFactory``
(vLLM's ``ECExampleConnector``); ``ec_transfer_kw`` turns it into the ``VllmConfig`` argument, so
each scheduler builds its own connector. The example connector keeps encoder outputs in a folder:
each configuration gets a fresh one of its own, removed with the configuration, so nothing one
side (or an earlier run) stored can make the other side hit. With a multimodal model a consumer
looks up each image it schedules there; the extra-config key ``stored`` (image names,
``conformance._core.multimodal.IMAGES``) writes those images' encoder outputs into the folder
first, as a producer instance would have, so the consumer loads them instead of encoding.

``runner_report`` says what a runner of the instance returns besides tokens: an encoder-only
instance (vLLM 0.28's EC producer) samples nothing and reports no EC output; a runner with an EC
consumer reports its connector's (empty) ``ECConnectorOutput`` with every step that ran the model.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from conformance._core import vllm_compat as vc


class ECConnectorFields(Protocol):
    """The ``HarnessConfig`` fields read here (``config`` imports this module, not the reverse)."""

    @property
    def ec_connector(self) -> str: ...
    @property
    def ec_role(self) -> str: ...
    @property
    def ec_connector_extra(self) -> Mapping[str, Any]: ...


EXAMPLE = "ECExampleConnector"
# Fixed, so nothing a connector derives from it differs between the two sides.
ENGINE_ID = "omni-conformance-ec"
# Connectors that keep what they transfer in a folder, and the extra-config key naming it.
_STORAGE_KEY: dict[str, str] = {EXAMPLE: "shared_storage_path"}


def ec_transfer_kw(cfg: ECConnectorFields) -> dict[str, Any]:
    """``VllmConfig`` arguments for ``cfg``'s EC connector (none when it names none). A folder
    this makes is removed when the returned ``ECTransferConfig`` is collected (or at exit)."""
    if not cfg.ec_connector:
        return {}
    from vllm.config import ECTransferConfig

    extra = dict(cfg.ec_connector_extra)
    stored = extra.pop("stored", ())
    folder = None
    key = _STORAGE_KEY.get(cfg.ec_connector)
    if key is not None and key not in extra:
        folder = extra[key] = tempfile.mkdtemp(prefix="omni-conformance-ec-")
        _store(folder, stored)
    config = ECTransferConfig(
        ec_connector=cfg.ec_connector,
        ec_role=cfg.ec_role,  # type: ignore[arg-type]  # checked by ECTransferConfig
        ec_connector_extra_config=extra,
        engine_id=ENGINE_ID,
    )
    if folder is not None:
        weakref.finalize(config, shutil.rmtree, folder, ignore_errors=True)
    return {"ec_transfer_config": config}


def _store(folder: str, images: Any) -> None:
    """The encoder outputs of ``images`` in the example connector's layout
    (``<folder>/<identifier>/encoder_cache.safetensors``, one embedding row per placeholder)."""
    if not images:
        return
    import os

    import safetensors.torch
    import torch

    from conformance._core.multimodal import IMAGES

    for name in images:
        identifier, size = IMAGES[name]
        path = os.path.join(folder, identifier)
        os.makedirs(path, exist_ok=True)
        tensors = {"ec_cache": torch.zeros(size, HIDDEN)}
        safetensors.torch.save_file(tensors, os.path.join(path, "encoder_cache.safetensors"))


# The bundled multimodal model's embedding width (its text layers' ``hidden_size``).
HIDDEN = 64


def encoder_only_kw(cfg: Any) -> dict[str, Any]:
    """``ModelConfig``'s arguments for an EC producer-only instance of a multimodal model: from
    0.29 such an instance runs the encoder only when the model says so (``mm_encoder_only``, as
    a user's ``--mm-encoder-only`` does); 0.28 makes every EC producer-only instance one."""
    producer_only = cfg.ec_connector and cfg.ec_role == "ec_producer"
    if producer_only and cfg.multimodal and vc.encoder_only_flag() == "is_mm_encoder_only":
        return {"mm_encoder_only": True}
    return {}


@dataclass(frozen=True)
class RunnerReport:
    """What a runner of one instance returns besides its tokens."""

    # The runner samples nothing (an encoder-only instance publishes embeddings instead).
    samples: bool = True
    # The runner attaches its EC connector's ``ECConnectorOutput`` to a step that ran the model.
    ec_output: bool = False
    # The runner pools (a pooling model's): a request's pooled output, once its prompt is
    # computed, ends it (``pooler_output``).
    pools: bool = False

    def ec_connector_output(self, so: Any) -> Any:
        """The step's ``ECConnectorOutput`` (None when the runner attaches none)."""
        if not self.ec_output or not so.total_num_scheduled_tokens:
            return None
        return vc.empty_ec_output()


def runner_report(vllm_config: Any) -> RunnerReport:
    """What a runner of ``vllm_config``'s instance reports. A pooling model's runner pools instead
    of sampling. An EC producer-only runner returns
    before the forward pass with no EC output; any other runner with an EC connector goes through
    its connector with every step (as one of a multimodal model does) and reports its output."""
    if vllm_config.model_config.runner_type == "pooling":
        return RunnerReport(samples=False, pools=True)
    ec = vllm_config.ec_transfer_config
    if ec is None or not ec.is_ec_transfer_instance:
        return RunnerReport()
    if ec.is_ec_producer and not ec.is_ec_consumer:
        return RunnerReport(samples=not vc.encoder_only(vllm_config))
    return RunnerReport(ec_output=True)
