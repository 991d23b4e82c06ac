"""What a check needs of a subject, asked through the typed ``Subject`` protocol: a capability
hook's value or ``NotApplicable`` naming what is missing (``require``), a real worker
(``require_worker``), the features to run with (``features_of``), and whether a failure's cause
names what the subject's fault containment promises (``cause_naming_problem``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, overload

from conformance._core.capabilities import (
    CAPABILITY_HOOKS,
    OFF,
    ChunkDelivery,
    DeclaredAttributes,
    DifferenceWitness,
    FaultContainment,
    Feature,
    InputAdapterProbe,
    ModelReference,
    NotApplicable,
    ProcessBoundary,
    ReceivingStage,
    RunnerProbes,
    SourceLayout,
)
from conformance._core.subjects import Subject


def features_of(subject: Subject, *, worker: bool | None = None) -> list[Feature]:
    """``off`` followed by the subject's declared features (only worker ones, or only
    token-source ones, when ``worker`` says so); worker features need ``has_worker()``."""
    found = [OFF] + [Feature.from_config(n, c) for n, c in subject.feature_configs().items()]
    if not subject.has_worker():
        found = [f for f in found if not f.use_worker]
    if worker is not None:
        found = [f for f in found if f.use_worker == worker]
    return found


def cause_naming_problem(
    subject: Subject, additional_config: Mapping[str, Any], cause: str, fault: BaseException
) -> str | None:
    """What a failure cause leaves out of what the subject's ``FaultContainment.stage_name``
    promises (the stage, the fault's type); None when it keeps the promise or makes none."""
    containment = subject.fault_containment()
    stage_name = getattr(containment, "stage_name", None)
    stage = stage_name(additional_config) if stage_name is not None else None
    if not stage:
        return None
    missing = [
        what
        for what, text in (("the stage", stage), ("the fault's type", type(fault).__name__))
        if text not in cause
    ]
    if not missing:
        return None
    return f"it does not name {' or '.join(missing)} ({stage!r}, {type(fault).__name__})"


# ``require`` names hooks as strings so that a test's needs can be read from the suite's source
# (``tests/test_subject_truth.py``); the overloads give each hook its protocol's type.
@overload
def require(
    subject: Subject, hook: Literal["declared_attributes"], what: str
) -> DeclaredAttributes: ...
@overload
def require(subject: Subject, hook: Literal["chunk_delivery"], what: str) -> ChunkDelivery: ...
@overload
def require(subject: Subject, hook: Literal["source_layout"], what: str) -> SourceLayout: ...
@overload
def require(subject: Subject, hook: Literal["input_adapter"], what: str) -> InputAdapterProbe: ...
@overload
def require(subject: Subject, hook: Literal["runner_probes"], what: str) -> RunnerProbes: ...
@overload
def require(subject: Subject, hook: Literal["model_reference"], what: str) -> ModelReference: ...
@overload
def require(
    subject: Subject, hook: Literal["difference_witnesses"], what: str
) -> Sequence[DifferenceWitness]: ...
@overload
def require(
    subject: Subject, hook: Literal["fault_containment"], what: str
) -> FaultContainment: ...
@overload
def require(subject: Subject, hook: Literal["process_boundary"], what: str) -> ProcessBoundary: ...
@overload
def require(subject: Subject, hook: Literal["receiving_stage"], what: str) -> ReceivingStage: ...
def require(subject: Subject, hook: str, what: str) -> object:
    """The subject's ``hook()`` result, or ``NotApplicable`` naming what is missing."""
    if hook not in CAPABILITY_HOOKS:
        raise ValueError(f"{hook!r} is not a capability hook; those are {CAPABILITY_HOOKS}")
    value = getattr(subject, hook)()
    if value is None:
        raise NotApplicable(f"subject {subject.name!r} provides no {what}")
    return value


def require_worker(subject: Subject) -> None:
    if not subject.has_worker():
        raise NotApplicable(f"subject {subject.name!r} provides no real worker")
