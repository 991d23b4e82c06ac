"""AR-INV-003 (C-20..C-22): workers execute the work they are given, and nothing else.

* C-20 — every ``ModelRunnerOutput`` covers exactly the scheduled requests, in order
  (``CheckingExecutor`` in every lock-step session, and here on the subject's real runners);
* C-21 — no ``send`` from worker code (``RecordingSink``), and the subject's import-linter
  contracts hold;
* C-22 — runners whose stage configs differ only in the graph that follows
  (``RunnerProbes.graphs``) give identical tokens and payloads.

Clauses and mutants: docs/contracts.md; the method: docs/design.md, "How the suite checks".
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given

from conformance._core.capabilities import CheckNotRun, NotApplicable
from conformance._core.needs import require, require_worker
from invariants.audits import CheckingExecutor
from invariants.machines import suite_settings, worker_harness_config
from invariants.runners import RunnerExec, drive_runners, same_view
from invariants.strategies import Job, jobs

pytestmark = [pytest.mark.invariants]


def check_graph_independence(workload: list[Job], subject: Any, *, include_hidden: bool) -> int:
    """Run ``workload``; raise AssertionError on a C-20/C-22 violation. Returns steps run."""
    probes = require(subject, "runner_probes", "runner probes")
    cfgs = [
        worker_harness_config(
            subject,
            probes.payload_feature(
                include_hidden=include_hidden, full_prefix=include_hidden, graph=g
            ),
            mode="sync",
            prefix=True,
        )
        for g in probes.graphs
    ]
    runners = [subject.make_worker(c) for c in cfgs]
    execs = [CheckingExecutor(RunnerExec(r), probes.payloads) for r in runners]

    def on_step(step, sched, so, outs) -> None:
        for e in execs:
            assert not e.problems, e.problems[0]
        ref = outs[0]
        pa = probes.payloads(ref) or [None] * len(ref.req_ids)
        for name, out in zip(probes.graphs[1:], outs[1:], strict=True):
            assert out.sampled_token_ids == ref.sampled_token_ids, (
                f"C-22: step {step}: tokens differ with graph {name}: "
                f"{out.sampled_token_ids} vs {ref.sampled_token_ids}"
            )
            pb = probes.payloads(out) or [None] * len(out.req_ids)
            for rid, a, b in zip(ref.req_ids, pa, pb, strict=True):
                assert same_view(a, b), (
                    f"C-22: step {step}: {rid}'s payload differs with graph {name}"
                )

    try:
        return drive_runners(workload, cfgs[0], execs, on_step)
    finally:
        for r in runners:
            probes.shutdown(r)


@pytest.mark.clauses("C-20", "C-22")
@pytest.mark.parametrize("include_hidden", [True, False], ids=["hidden", "token-only"])
def test_results_independent_of_stage_graph(conformance_subject, include_hidden):
    require_worker(conformance_subject)
    require(conformance_subject, "runner_probes", "runner probes")
    total = [0]

    @suite_settings(15)
    @given(jobs)
    def prop(workload: list[Job]) -> None:
        total[0] += check_graph_independence(
            workload, conformance_subject, include_hidden=include_hidden
        )

    prop()
    assert total[0] > 0


# ---- C-21: static ------------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def import_linter_config(source: Path, tmp_path: Path) -> Path:
    """The subject's contracts, runnable: forbidding a subpackage of an external package
    (``vllm.v1.engine.core``) needs ``include_external_packages``, which import-linter accepts
    only for a top-level package."""
    import tomllib

    section = dict(tomllib.loads(source.read_text())["tool"]["importlinter"])
    contracts = section.pop("contracts")
    # Such a package becomes a root of the graph. vLLM imports its own engine internally
    # (``vllm/__init__`` imports ``vllm.engine``), so for those modules only direct imports can
    # be forbidden: each contract is split into an internal part (direct and indirect imports
    # forbidden, as written) and an external part (direct imports only).
    own = tuple(section["root_packages"])
    roots = list(own)
    split = []
    for c in contracts:
        forbidden = list(c.get("forbidden_modules", ()))
        internal = [m for m in forbidden if m.split(".")[0] in own]
        external = [m for m in forbidden if m.split(".")[0] not in own]
        if internal:
            split.append({**c, "forbidden_modules": internal})
        if external:
            roots += [m.split(".")[0] for m in external if m.split(".")[0] not in roots]
            split.append(
                {
                    **c,
                    "name": c["name"] + " (external, direct imports)",
                    "forbidden_modules": external,
                    "allow_indirect_imports": True,
                }
            )
    section["root_packages"] = roots
    lines = ["[tool.importlinter]"] + [f"{k} = {_toml_value(v)}" for k, v in section.items()]
    for c in split:
        lines += ["", "[[tool.importlinter.contracts]]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in c.items()]
    path = tmp_path / "importlinter.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_import_linter(config: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """import-linter through the interpreter running the suite (``python -m``), so the check
    runs wherever the suite runs, activated environment or not."""
    code = (
        "import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True))"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(config)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.clauses("C-21")
def test_import_contracts_hold(conformance_subject, tmp_path):
    layout = require(conformance_subject, "source_layout", "source layout")
    if layout.import_contracts is None:
        raise NotApplicable(f"subject {conformance_subject.name!r} ships no import contracts")
    if importlib.util.find_spec("importlinter") is None:
        raise CheckNotRun(f"import-linter is not installed for {sys.executable}")
    if not Path(layout.import_contracts).is_file():
        raise CheckNotRun(f"the subject's import contracts {layout.import_contracts} are missing")
    config = import_linter_config(layout.import_contracts, tmp_path)
    # From a neutral folder: import-linter puts its working directory first on sys.path, and the
    # contracts' own folder may hold modules that shadow the standard library (``platform.py``).
    proc = run_import_linter(config, tmp_path)
    assert proc.returncode == 0, (
        f"C-21: import-linter contracts broken:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"
    )
    # Every contract ran: a config import-linter read as empty must not pass.
    kept = config.read_text().count("[[tool.importlinter.contracts]]")
    assert kept and f"{kept} kept, 0 broken" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.clauses("C-21")
def test_worker_code_is_what_the_sink_watches(conformance_subject):
    """The run-time C-21 check watches folders that exist (else it is blind)."""
    layout = require(conformance_subject, "source_layout", "source layout")
    if not layout.worker_roots:
        raise NotApplicable(f"subject {conformance_subject.name!r} declares no worker code")
    for folder in layout.worker_roots:
        assert Path(folder).is_dir(), f"{folder} does not exist: the C-21 stack check is blind"
