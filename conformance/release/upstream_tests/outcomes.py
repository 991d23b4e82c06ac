"""What a run of the release's tests found: outcomes read from pytest's JUnit XML (keyed by
node id), their counts, the comparison of the subject's run with the baseline's (``Verdict``),
and the ``--json`` document (a contract: the compatibility matrix reads it)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Outcome names, in the order the report counts them.
OUTCOMES = ("passed", "failed", "skipped", "errors")
_SEVERITY = {"passed": 0, "skipped": 1, "errors": 2, "failed": 3}


def module_paths(tree: Path) -> dict[str, str]:
    """Dotted module name (as JUnit's ``classname`` spells it) -> path relative to ``tree``."""
    out = {}
    for path in tree.rglob("*.py"):
        rel = path.relative_to(tree).as_posix()
        out[rel[: -len(".py")].replace("/", ".")] = rel
    return out


def nodeid_of(classname: str, name: str, modules: Mapping[str, str]) -> str:
    """pytest's node id from a JUnit testcase (pytest writes ``classname`` as the module's
    dotted path, then any classes; a collection error has an empty ``classname`` and the
    module's dotted path as ``name``)."""
    if not classname:
        return modules.get(name, name.replace(".", "/") + ".py")
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if module in modules:
            return "::".join([modules[module], *parts[cut:], name])
    return "::".join([classname.replace(".", "/") + ".py", name])


def parse_junit(xml_text: str, modules: Mapping[str, str]) -> dict[str, str]:
    """node id -> outcome (``passed``/``failed``/``skipped``/``errors``) from pytest's JUnit XML.

    A testcase with a ``failure`` failed; one with only an ``error`` (collection, setup or
    teardown) is an error; ``skipped`` (skips and xfails) is skipped; the rest passed.
    """
    root = ET.fromstring(xml_text)
    out: dict[str, str] = {}
    for case in root.iter("testcase"):
        nodeid = nodeid_of(case.get("classname", ""), case.get("name", ""), modules)
        tags = {child.tag for child in case}
        if "failure" in tags:
            outcome = "failed"
        elif "error" in tags:
            outcome = "errors"
        elif "skipped" in tags:
            outcome = "skipped"
        else:
            outcome = "passed"
        # A node reported twice (e.g. by two xdist workers) keeps its worst outcome.
        previous = out.get(nodeid)
        if previous is None or _SEVERITY[outcome] > _SEVERITY[previous]:
            out[nodeid] = outcome
    return out


def counts(outcomes: Mapping[str, str]) -> dict[str, int]:
    c = {o: 0 for o in OUTCOMES}
    for outcome in outcomes.values():
        c[outcome] += 1
    c["total"] = len(outcomes)
    return c


def not_passing(outcomes: Mapping[str, str]) -> list[str]:
    return sorted(n for n, o in outcomes.items() if o in ("failed", "errors"))


@dataclass
class Verdict:
    """The comparison of a subject's outcomes with the baseline's."""

    failing: list[str]
    baseline_failing: list[str]
    # Passed with upstream's classes, did not pass with the subject's (failed, error, skipped
    # or missing): the subject's own findings.
    regressions: list[str] = field(default_factory=list)


def compare(subject: Mapping[str, str], baseline: Mapping[str, str] | None) -> Verdict:
    failing = not_passing(subject)
    if baseline is None:
        return Verdict(failing, [], failing)
    baseline_failing = [n for n in failing if baseline.get(n) in ("failed", "errors")]
    regressions = sorted(
        n for n, o in baseline.items() if o == "passed" and subject.get(n) != "passed"
    )
    return Verdict(failing, baseline_failing, regressions)


def result_json(
    version: str,
    subject: str,
    outcomes: Mapping[str, str],
    verdict: Verdict,
    duration_s: float,
    tests_source: str,
) -> dict[str, Any]:
    """The ``--json`` document; its shape is a contract with the compatibility matrix."""
    c = counts(outcomes)
    return {
        "vllm": version,
        "subject": subject,
        "passed": c["passed"],
        "failed": c["failed"],
        "skipped": c["skipped"],
        "errors": c["errors"],
        "total": c["total"],
        "failing": list(verdict.failing),
        "baseline_failing": list(verdict.baseline_failing),
        "duration_s": round(float(duration_s), 3),
        "tests_source": tests_source,
    }
