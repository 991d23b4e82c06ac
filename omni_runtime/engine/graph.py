"""The pipeline's stage graph, read from a JSON file: which stages exist, what runs them, and
which connector carries each edge.

This module owns parsing and validating the file; nothing else in the runtime reads it, and
only the orchestrator holds the parsed graph (C-21). The embedded default lives at
``omni_runtime/configs/default_pipeline.json``. A graph is a chain: each stage names at most one
downstream stage, AR stages (run by vLLM's ``EngineCore``) come first and a ``code2wav`` stage,
if any, is last.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any, Literal

StageKind = Literal["ar", "code2wav"]
ConnectorKind = Literal["inprocess", "pipe"]
CONNECTOR_KINDS: tuple[str, ...] = ("inprocess", "pipe")

_AR_KEYS = {
    "id",
    "kind",
    "model",
    "downstream",
    "chunk_processor",
    "include_hidden",
    "downstream_needs_full_prefix",
    "prompt_embeds_dim",
    "start_token_ids",
    "stop_token_ids",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "num_blocks",
    "ray_resources",
}
_C2W_KEYS = {"id", "kind", "model"}

# The JSON type of every stage field, checked before a spec is built, so a wrong type is one
# line naming the field rather than an error from deep inside vLLM's config validation.
# ("int" excludes booleans; "int?" and "str?" also accept null; "pos" is an int above zero.)
_FIELD_TYPES: dict[str, str] = {
    "id": "str",
    "kind": "str",
    "model": "str",
    "downstream": "list[str]",
    "chunk_processor": "str?",
    "include_hidden": "bool",
    "downstream_needs_full_prefix": "bool",
    "prompt_embeds_dim": "pos?",
    "start_token_ids": "list[int]",
    "stop_token_ids": "list[int]",
    "max_model_len": "pos",
    "max_num_seqs": "pos",
    "max_num_batched_tokens": "pos",
    "block_size": "pos",
    "num_blocks": "pos?",
    "ray_resources": "ray",
}
# Model names the runtime builds itself (``omni_runtime.models.model_dir``); any other value of
# a stage's ``model`` must be a model folder.
BUILTIN_MODELS = ("thinker", "talker", "code2wav")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type_problem(value: Any, expected: str) -> str | None:
    """Why ``value`` is not of the JSON type ``expected`` (``_FIELD_TYPES``), or None."""
    if expected.endswith("?"):
        if value is None:
            return None
        expected = expected[:-1]
    ok = {
        "str": lambda v: isinstance(v, str) and bool(v),
        "bool": lambda v: isinstance(v, bool),
        "pos": lambda v: _is_int(v) and v > 0,
        "list[str]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
        "list[int]": lambda v: isinstance(v, list) and all(_is_int(x) and x >= 0 for x in v),
        "ray": lambda v: RayResources.problem(v) is None,
    }[expected](value)
    if ok:
        return None
    wanted = {
        "str": "a non-empty string",
        "bool": "true or false",
        "pos": "an integer above 0",
        "list[str]": "a list of strings",
        "list[int]": "a list of token ids (integers >= 0)",
        "ray": RayResources.problem(value) or "",
    }[expected]
    return f"expected {wanted}, got {json.dumps(value, default=repr)[:60]}"


class PipelineConfigError(ValueError):
    """A pipeline file that cannot describe a runnable graph; the message names the field."""


@dataclass(frozen=True)
class RayResources:
    """What a stage's Ray actor reserves (``--backend ray``): Ray's own actor resource options.

    ``resources`` are custom resources by name, which is how a stage is pinned to a machine: start
    that machine's Ray node with ``--resources='{"talker_host": 1}'`` and ask for
    ``{"talker_host": 1}`` here. Frozen and hashable, like the spec that holds it.
    """

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory: int | None = None
    resources: tuple[tuple[str, float], ...] = ()

    _KEYS = ("num_cpus", "num_gpus", "memory", "resources")

    @classmethod
    def problem(cls, value: Any) -> str | None:
        """Why ``value`` (parsed JSON) cannot be a stage's ``ray_resources``, or None."""
        if not isinstance(value, Mapping):
            return "expected an object with num_cpus, num_gpus, memory, resources"
        unknown = sorted(set(value) - set(cls._KEYS))
        if unknown:
            return f"unknown keys {unknown} (known {list(cls._KEYS)})"

        def amount(v: Any) -> bool:
            return isinstance(v, int | float) and not isinstance(v, bool) and v >= 0

        for key in ("num_cpus", "num_gpus", "memory"):
            if key in value and not amount(value[key]):
                return f"{key}: expected a number >= 0, got {json.dumps(value[key], default=repr)}"
        custom = value.get("resources", {})
        if not isinstance(custom, Mapping) or not all(
            isinstance(k, str) and k and amount(v) for k, v in custom.items()
        ):
            return "resources: expected an object of resource name to amount >= 0"
        return None

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> RayResources:
        return cls(
            num_cpus=float(value.get("num_cpus", 1.0)),
            num_gpus=float(value.get("num_gpus", 0.0)),
            memory=int(value["memory"]) if value.get("memory") is not None else None,
            resources=tuple(sorted((k, float(v)) for k, v in value.get("resources", {}).items())),
        )

    def actor_options(self) -> dict[str, Any]:
        """Keyword arguments for Ray's ``ActorClass.options``."""
        out: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory is not None:
            out["memory"] = self.memory
        if self.resources:
            out["resources"] = dict(self.resources)
        return out


@dataclass(frozen=True)
class ARStageSpec:
    """An autoregressive stage: one vLLM ``EngineCore`` with our scheduler and worker."""

    id: str
    model: str
    downstream: tuple[str, ...] = ()
    chunk_processor: str | None = None
    include_hidden: bool = True
    downstream_needs_full_prefix: bool = False
    prompt_embeds_dim: int | None = None
    # Token ids whose embeddings follow the upstream rows in this stage's prompt embeds.
    start_token_ids: tuple[int, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    max_model_len: int = 512
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 1024
    block_size: int = 16
    num_blocks: int | None = None
    # Where ``--backend ray`` places the stage's actor; other backends ignore it.
    ray_resources: RayResources = RayResources()
    kind: StageKind = "ar"


@dataclass(frozen=True)
class Code2WavStageSpec:
    """The codec decoder: not an LM, run as a plain object by the orchestrator."""

    id: str
    model: str
    kind: StageKind = "code2wav"


StageSpec = ARStageSpec | Code2WavStageSpec


@dataclass(frozen=True)
class PipelineConfig:
    name: str
    stages: tuple[StageSpec, ...]
    connectors: Mapping[str, ConnectorKind] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    source: str = "<memory>"

    @property
    def stage_ids(self) -> tuple[str, ...]:
        return tuple(s.id for s in self.stages)

    def stage(self, stage_id: str) -> StageSpec:
        for s in self.stages:
            if s.id == stage_id:
                return s
        raise KeyError(stage_id)

    @property
    def ar_stages(self) -> tuple[ARStageSpec, ...]:
        return tuple(s for s in self.stages if isinstance(s, ARStageSpec))

    @property
    def code2wav(self) -> Code2WavStageSpec | None:
        last = self.stages[-1]
        return last if isinstance(last, Code2WavStageSpec) else None

    def downstream_of(self, stage_id: str) -> str | None:
        spec = self.stage(stage_id)
        if isinstance(spec, ARStageSpec) and spec.downstream:
            return spec.downstream[0]
        return None

    def connector_for(self, src: str, dst: str) -> ConnectorKind:
        return self.connectors.get(f"{src}->{dst}", "inprocess")

    def with_connectors(self, kind: ConnectorKind) -> PipelineConfig:
        """Every edge carried by ``kind`` connectors."""
        if kind not in CONNECTOR_KINDS:
            raise PipelineConfigError(f"connector: unknown kind {kind!r}; known {CONNECTOR_KINDS}")
        edges = {f"{s.id}->{s.downstream[0]}": kind for s in self.ar_stages if s.downstream}
        return replace(self, connectors=edges)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "<memory>") -> PipelineConfig:
        def fail(where: str, problem: str) -> PipelineConfigError:
            return PipelineConfigError(f"{source}: {where}: {problem}")

        raw_stages = data.get("stages")
        if not isinstance(raw_stages, list) or not raw_stages:
            raise fail("stages", "expected a non-empty list")
        stages: list[StageSpec] = []
        for i, raw in enumerate(raw_stages):
            where = f"stages[{i}]"
            if not isinstance(raw, Mapping):
                raise fail(where, "expected an object")
            kind = raw.get("kind", "ar")
            if "id" not in raw or "model" not in raw:
                raise fail(where, "needs 'id' and 'model'")
            keys = _AR_KEYS if kind == "ar" else _C2W_KEYS if kind == "code2wav" else None
            if keys is None:
                raise fail(f"{where}.kind", f"expected 'ar' or 'code2wav', got {kind!r}")
            unknown = set(raw) - keys
            if unknown:
                raise fail(where, f"unknown keys {sorted(unknown)}")
            for key, value in raw.items():
                problem = _type_problem(value, _FIELD_TYPES[key])
                if problem:
                    raise fail(f"{where}.{key}", problem)
            model = raw["model"]
            if model not in BUILTIN_MODELS and not Path(model).is_dir():
                raise fail(
                    f"{where}.model",
                    f"no model folder {model!r} (a folder, or one of {list(BUILTIN_MODELS)})",
                )
            kw = dict(raw)
            for key in ("downstream", "start_token_ids", "stop_token_ids"):
                if key in kw:
                    kw[key] = tuple(kw[key])
            if "ray_resources" in kw:
                kw["ray_resources"] = RayResources.from_json(kw["ray_resources"])
            stages.append(ARStageSpec(**kw) if kind == "ar" else Code2WavStageSpec(**kw))

        ids = [s.id for s in stages]
        if len(set(ids)) != len(ids):
            raise fail("stages", f"duplicate stage ids {ids}")
        for i, s in enumerate(stages):
            where = f"stages[{i}] ({s.id})"
            if isinstance(s, Code2WavStageSpec):
                if i != len(stages) - 1:
                    raise fail(where, "a code2wav stage must be the last stage")
                continue
            if i == 0 and s.prompt_embeds_dim is not None:
                raise fail(where, "the first stage takes token prompts, not prompt_embeds_dim")
            if len(s.downstream) > 1:
                raise fail(f"{where}.downstream", "at most one downstream stage (a chain)")
            expected = ids[i + 1] if i + 1 < len(ids) else None
            got = s.downstream[0] if s.downstream else None
            if got != expected:
                raise fail(
                    f"{where}.downstream", f"expected {expected!r} (the next stage), got {got!r}"
                )
            if i > 0 and s.prompt_embeds_dim is None:
                raise fail(where, "a stage fed by an upstream stage needs prompt_embeds_dim")
            if s.downstream and s.chunk_processor is None:
                raise fail(where, "a stage with a downstream needs a chunk_processor")
            if s.chunk_processor is not None:
                # Resolved now, not when the stage's engine starts: a mistyped path is a
                # mistake in this file, and says so before any stage runs.
                from omni_runtime.sched.transfer import resolve_processor

                try:
                    resolve_processor(s.chunk_processor, f"{source}: {where}.chunk_processor")
                except (TypeError, ValueError) as exc:
                    raise PipelineConfigError(str(exc)) from None

        connectors: dict[str, ConnectorKind] = {}
        for edge, kind in dict(data.get("connectors") or {}).items():
            if kind not in CONNECTOR_KINDS:
                raise fail(
                    f"connectors[{edge!r}]", f"expected one of {CONNECTOR_KINDS}, got {kind!r}"
                )
            src, _, dst = edge.partition("->")
            if src not in ids or dst not in ids:
                raise fail(f"connectors[{edge!r}]", "names an unknown stage")
            connectors[edge] = kind
        unknown_top = set(data) - {"name", "description", "stages", "connectors", "defaults"}
        if unknown_top:
            raise fail("top level", f"unknown keys {sorted(unknown_top)}")
        return cls(
            name=str(data.get("name", "pipeline")),
            stages=tuple(stages),
            connectors=connectors,
            defaults=dict(data.get("defaults") or {}),
            source=source,
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PipelineConfig:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except OSError as exc:
            raise PipelineConfigError(f"{p}: cannot read: {exc}") from exc
        except json.JSONDecodeError as exc:
            raise PipelineConfigError(f"{p}: not valid JSON: {exc}") from exc
        if not isinstance(data, Mapping):
            raise PipelineConfigError(f"{p}: expected a JSON object")
        return cls.from_dict(data, source=str(p))


def default_pipeline_path() -> Path:
    return Path(str(resources.files("omni_runtime").joinpath("configs/default_pipeline.json")))


def load_pipeline_config(path: str | os.PathLike[str] | None = None) -> PipelineConfig:
    """The graph in ``path``, or the embedded default when ``path`` is None."""
    return PipelineConfig.load(path if path is not None else default_pipeline_path())
