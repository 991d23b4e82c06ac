"""The omni stage configurations the gate runs this runtime with: the stage dictionaries
(``talker_stage``, ``thinker_stage``), the named features built from them (``TOKEN_UPDATES``,
``WORKER_FEATURES``), and the constants the other modules of this subject read (the stage names,
the codec vocabulary and chunk size the streamer promises, the processors' dotted paths).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conformance.api import (
    Feature,
)

# The runtime's package (this subject lives in a subpackage of it).
PACKAGE = Path(__file__).resolve().parent.parent
STAGES = ("thinker", "talker", "code2wav")
# Codec ids the talker streams to code2wav; larger ids are the talker's control tokens.
CODEC_VOCAB = 256
# Codec ids per streamed chunk: the streamer's default, which the talker stage uses. Stated
# here, not read from the class, so a changed default is a difference the gate reports.
CODEC_CHUNK = 8
CODEC_STREAMER = "omni_runtime.sched.processors.CodecTokenStreamer"
HIDDEN_FORWARDER = "omni_runtime.sched.processors.HiddenRowsForwarder"


def talker_stage(**over: Any) -> dict[str, Any]:
    """Token-only talker stage streaming codec ids to code2wav on every sampled step."""
    return {
        "stage_id": "talker",
        "stages": list(STAGES),
        "downstream": ["code2wav"],
        "chunk_processor": CODEC_STREAMER,
        "omni_pooler_payload_include_hidden": False,
        **over,
    }


def thinker_stage(
    *,
    include_hidden: bool,
    full_prefix: bool | None = None,
    materialization: str = "inline",
    **over: Any,
) -> dict[str, Any]:
    """Thinker stage delivering hidden rows (or, token-only, the prefill conditioning)."""
    return {
        "stage_id": "thinker",
        "stages": list(STAGES),
        "downstream": ["talker"],
        "chunk_processor": HIDDEN_FORWARDER,
        "omni_pooler_payload_include_hidden": include_hidden,
        "downstream_needs_full_prefix": include_hidden if full_prefix is None else full_prefix,
        "materialization": materialization,
        **over,
    }


def _feature(
    name: str,
    stage: dict[str, Any],
    finals: tuple[str | None, ...],
    worker: bool,
    edges: tuple[int, ...] = (),
):
    return name, {
        "additional_config": {"omni_stage": stage},
        "final_stages": list(finals),
        "use_worker": worker,
        "token_edges": list(edges),
    }


# The codec streamer keeps ids in [0, CODEC_VOCAB) as audio and drops the rest: the harness
# samples both ends of that range and the first id past it.
TOKEN_UPDATES = _feature(
    "token-updates",
    talker_stage(),
    (None, "talker", "code2wav"),
    False,
    (0, CODEC_VOCAB - 1, CODEC_VOCAB),
)
WORKER_FEATURES = dict(
    [
        _feature(
            "hidden-inline",
            thinker_stage(include_hidden=True, materialization="inline"),
            (None, "thinker", "talker"),
            True,
        ),
        _feature(
            "hidden-background",
            thinker_stage(include_hidden=True, materialization="background"),
            (None, "thinker", "talker"),
            True,
        ),
        _feature(
            "token-only-background",
            thinker_stage(include_hidden=False, materialization="background"),
            (None, "thinker", "code2wav"),
            True,
        ),
    ]
)


def stage_of(feature: Feature) -> dict[str, Any]:
    return dict(feature.additional_config.get("omni_stage") or {})


# ``additional_config`` key naming the generated model a worker feature runs (default: the
# thinker), and the one whose config turns on its payload postprocess.
MODEL_KEY = "omni_test_model"
POSTPROCESS_MODEL = "thinker-post"
