"""Stage configuration: which stage a vLLM engine serves and what its downstream needs.

A stage's configuration travels inside ``VllmConfig.additional_config["omni_stage"]`` so that it
reaches every vLLM component (scheduler, worker) through the config object vLLM already passes
around, with no side channel. A ``VllmConfig`` without that key is a plain vLLM engine: every
omni feature is off and the omni classes behave exactly like upstream.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

ADDITIONAL_CONFIG_KEY = "omni_stage"

Materialization = Literal["inline", "background"]


@dataclass(frozen=True)
class OmniStageConfig:
    """What one stage is, what follows it, and how its payloads are built.

    ``stages`` is the whole pipeline in order; a request's final stage must be one of them and not
    before this stage. ``chunk_processor`` is the dotted path of a callable (see
    ``omni_runtime.sched.transfer``) or None for "send the payload as it is".
    """

    stage_id: str
    stages: tuple[str, ...]
    downstream: tuple[str, ...] = ()
    chunk_processor: str | None = None
    omni_pooler_payload_include_hidden: bool = True
    materialization: Materialization = "inline"
    # Downstream needs hidden rows for every prompt position, including prefix-cache hits (C-55).
    downstream_needs_full_prefix: bool = False
    # Extra model outputs (beyond hidden rows) the downstream consumes, by name.
    multimodal_outputs: tuple[str, ...] = ()
    prompt_embeds_dim: int | None = None
    # How many times the worker re-runs a step that raised before it pins the fault on single
    # requests by splitting the batch (``omni_runtime.worker.recovery``); 0 splits at once.
    step_retries: int = 2
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.stage_id not in self.stages:
            raise ValueError(
                f"omni_stage.stage_id: {self.stage_id!r} is not one of stages {list(self.stages)}"
            )
        for d in self.downstream:
            if d not in self.stages:
                raise ValueError(f"omni_stage.downstream: unknown stage {d!r}")
        if isinstance(self.step_retries, bool) or not isinstance(self.step_retries, int):
            raise ValueError(
                f"omni_stage.step_retries: expected an integer, got {self.step_retries!r}"
            )
        if self.step_retries < 0:
            raise ValueError(f"omni_stage.step_retries: must be >= 0, got {self.step_retries}")
        if self.materialization not in ("inline", "background"):
            raise ValueError(
                "omni_stage.materialization: expected 'inline' or 'background', "
                f"got {self.materialization!r}"
            )

    @property
    def has_downstream(self) -> bool:
        return bool(self.downstream)

    def index_of(self, stage_id: str) -> int:
        return self.stages.index(stage_id)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stages"] = list(self.stages)
        d["downstream"] = list(self.downstream)
        d["multimodal_outputs"] = list(self.multimodal_outputs)
        d["extra"] = dict(self.extra)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OmniStageConfig:
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"omni_stage: unknown keys {sorted(unknown)}")
        kw: dict[str, Any] = dict(data)
        for key in ("stages", "downstream", "multimodal_outputs"):
            if key in kw and kw[key] is not None:
                kw[key] = tuple(kw[key])
        return cls(**kw)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> OmniStageConfig | None:
        additional = getattr(vllm_config, "additional_config", None)
        if not isinstance(additional, Mapping):
            return None
        raw = additional.get(ADDITIONAL_CONFIG_KEY)
        if raw is None:
            return None
        if isinstance(raw, OmniStageConfig):
            return raw
        return cls.from_dict(raw)


def stage_additional_config(stage: OmniStageConfig) -> dict[str, Any]:
    """The ``additional_config`` entry that switches a vLLM engine into this stage."""
    return {ADDITIONAL_CONFIG_KEY: stage.to_dict()}


def single_stage(stage_id: str = "stage0", stages: Sequence[str] | None = None) -> OmniStageConfig:
    return OmniStageConfig(stage_id=stage_id, stages=tuple(stages or (stage_id,)))
