"""What a run executed of the subject's own package, by area: the "subject" section of
``omni-conformance reach``'s report.

The areas are the subject's own (its optional ``reach_areas()`` hook, a ``SubjectAreas``) or,
without the hook, one per first-level module or subpackage of the top-level package its
scheduler classes come from (``derive``). A subject whose schedulers are vLLM's has no package
of its own: its section is not applicable, with the reason. ``plan`` resolves the areas to the
installed files (a file two areas name is the first's; a path the release lacks is listed as
missing); the gate's run measures them together with vLLM's targets, and ``section`` turns the
combined coverage data into per-area and per-file figures and the largest functions no process
reached.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance._core.capabilities import SubjectAreas
from conformance.release.reach import Figures

# How many never-reached functions an area lists (the largest first).
UNREACHED_SHOWN = 10
MEASURED, NOT_APPLICABLE = "measured", "not_applicable"


@dataclass(frozen=True)
class Plan:
    """The subject's areas resolved to files under ``root`` (or why there is nothing to
    measure: ``reason``)."""

    package: str = ""
    root: Path | None = None
    declared: bool = False
    paths: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    files: Mapping[str, tuple[Path, ...]] = field(default_factory=dict)
    missing: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    reason: str | None = None

    def all_files(self) -> list[Path]:
        return [p for files in self.files.values() for p in files]


def _python_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def scheduler_module(subject: Any) -> str:
    """The module the subject's synchronous scheduler class comes from."""
    spec = getattr(subject, "sync_scheduler", None)
    if spec is None:
        from conformance._core.config import HarnessConfig

        spec = subject.scheduler_class(HarnessConfig())
    if isinstance(spec, str):
        return spec.partition(":")[0] if ":" in spec else spec.rpartition(".")[0]
    return str(spec.__module__)


def package_root(package: str) -> Path | None:
    """The folder of an importable package (found without importing it), or None."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def derive(package: str, root: Path) -> SubjectAreas:
    """One area per first-level module or subpackage of ``root`` (folders holding no module,
    such as data folders, are left out), named as the module or subpackage."""
    areas: dict[str, tuple[str, ...]] = {}
    for entry in sorted(root.iterdir()):
        if entry.is_dir() and entry.name != "__pycache__" and _python_files(entry):
            areas[entry.name] = (f"{entry.name}/",)
        elif entry.is_file() and entry.suffix == ".py":
            areas[entry.stem] = (entry.name,)
    return SubjectAreas(package=package, areas=areas)


def plan(subject: Any) -> Plan:
    """The subject's areas as installed here, or a ``Plan`` whose ``reason`` says why its own
    package is not measured."""
    hook = getattr(subject, "reach_areas", None)
    declared = hook() if callable(hook) else None
    if declared is not None and not isinstance(declared, SubjectAreas):
        raise TypeError(
            f"subject {getattr(subject, 'name', subject)!r}: reach_areas() returned "
            f"{type(declared).__name__}, not conformance.api.SubjectAreas"
        )
    if declared is None:
        module = scheduler_module(subject)
        package = module.split(".")[0]
        if package == "vllm":
            return Plan(
                reason=f"the subject's scheduler is vLLM's own ({module}): it has no package "
                "beyond vLLM, whose scheduler code the gate's figures cover"
            )
    else:
        package = declared.package
    root = package_root(package)
    if root is None:
        return Plan(package=package, reason=f"package {package!r} is not importable here")
    areas = declared if declared is not None else derive(package, root)
    return resolve(areas, root, declared=declared is not None)


def resolve(areas: SubjectAreas, root: Path, declared: bool = True) -> Plan:
    """Each area's files under ``root`` (folders expanded; a file an earlier area holds is
    not counted again) and the paths the installed package lacks."""
    claimed: set[Path] = set()
    files: dict[str, tuple[Path, ...]] = {}
    missing: dict[str, tuple[str, ...]] = {}
    for area, paths in areas.areas.items():
        found: list[Path] = []
        lacking: list[str] = []
        for rel in paths:
            path = root / rel
            if rel.endswith("/") and path.is_dir():
                found += _python_files(path)
            elif not rel.endswith("/") and path.is_file():
                found.append(path)
            else:
                lacking.append(rel)
        own = [p for p in dict.fromkeys(p.resolve() for p in found) if p not in claimed]
        claimed.update(own)
        files[area] = tuple(own)
        missing[area] = tuple(lacking)
    return Plan(
        package=areas.package,
        root=root,
        declared=declared,
        paths={a: tuple(p) for a, p in areas.areas.items()},
        files=files,
        missing=missing,
    )


def _add(into: dict[str, int], figures: Mapping[str, int]) -> None:
    for key, value in figures.items():
        into[key] = into.get(key, 0) + int(value)


def _zero() -> dict[str, int]:
    return {"lines": 0, "statements": 0, "branches": 0, "branch_total": 0}


def section(
    planned: Plan, entries: Mapping[str, Mapping[str, Any]], side: str = "gate"
) -> dict[str, Any]:
    """The report's "subject" section from coverage.py's JSON entries keyed by resolved path
    (``conformance.release.reach.combined``). A file with no entry (coverage.py could not read
    it) is listed under ``unmeasured``, never counted as covered or missed."""
    if planned.reason is not None or planned.root is None:
        return {"status": NOT_APPLICABLE, "reason": planned.reason or "no package"}
    areas: dict[str, Any] = {}
    totals = _zero()
    for area, paths in planned.paths.items():
        area_total = _zero()
        files: dict[str, dict[str, int]] = {}
        unreached: list[dict[str, Any]] = []
        unmeasured: list[str] = []
        for path in planned.files.get(area, ()):
            rel = path.relative_to(planned.root).as_posix()
            entry = entries.get(str(path))
            if entry is None:
                unmeasured.append(rel)
                continue
            files[rel] = Figures.of(entry["summary"]).to_dict()
            _add(area_total, files[rel])
            for name, func in entry.get("functions", {}).items():
                figures = Figures.of(func["summary"]).to_dict()
                if name and figures["statements"] and not figures["lines"]:
                    unreached.append(
                        {"file": rel, "function": name, "statements": figures["statements"]}
                    )
        unreached.sort(key=lambda u: (-u["statements"], u["file"], u["function"]))
        areas[area] = {
            "paths": list(paths),
            "missing": list(planned.missing.get(area, ())),
            "unmeasured": unmeasured,
            "totals": area_total,
            "files": files,
            "unreached": unreached[:UNREACHED_SHOWN],
            "unreached_count": len(unreached),
        }
        _add(totals, area_total)
    return {
        "status": MEASURED,
        "side": side,
        "package": planned.package,
        "declared": planned.declared,
        "areas": areas,
        "totals": totals,
    }
