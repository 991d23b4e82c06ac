"""The ``vllm-omni`` subject (``conformance.adapters.vllm_omni``).

The fast tests run without vllm-omni installed: registration, which vllm-omni release a vLLM
release needs, the one-line refusals, and the differences registry. The tests marked
``vllm_omni`` (opt in: ``pytest -m vllm_omni``) run in environments that hold vLLM, vllm-omni and
this harness: every folder named by ``OMNI_CONFORMANCE_VLLM_OMNI_ENVS`` (``os.pathsep``-separated;
an environment, or a folder of environments) and every environment under the matrix's
environment folder (``OMNI_CONFORMANCE_ENVS``) that has vllm-omni installed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conformance._core.capabilities import CAPABILITY_HOOKS
from conformance._core.differences import validate_entries
from conformance._core.subjects import SubjectUnsupported
from conformance.adapters import vllm_omni as adapter

PUBLISHED = [f"0.{m}.0" for m in range(14, 31, 2)]
ENVS_VAR = "OMNI_CONFORMANCE_VLLM_OMNI_ENVS"

# ---- registration and the release mapping -----------------------------------------------------


def test_subjects_lists_vllm_omni(capsys):
    from conformance import cli

    assert cli.main(["subjects"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("vllm-omni"))
    assert "conformance.adapters.vllm_omni:vllm_omni_subject" in line


def test_adapter_module_imports_neither_vllm_nor_vllm_omni():
    code = (
        "import sys, conformance.adapters.vllm_omni as m;"
        "assert callable(m.vllm_omni_subject.environment_requirements);"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in ('vllm', 'vllm_omni')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("vllm", [*PUBLISHED, "0.30.1", "0.28.0+cpu", "0.22.3rc1"])
def test_environment_requirements_name_the_release_of_the_same_minor(vllm):
    minor = ".".join(vllm.split(".")[:2])
    assert adapter.vllm_omni_subject.environment_requirements(vllm) == [f"vllm-omni=={minor}.0"]


@pytest.mark.parametrize("vllm", ["0.29.0", "0.31.0", "0.33.0", "0.12.0", "0.32.1", "1.30.0"])
def test_environment_requirements_refuse_minors_without_a_release(vllm):
    with pytest.raises(SubjectUnsupported) as info:
        adapter.vllm_omni_subject.environment_requirements(vllm)
    message = str(info.value)
    minor = ".".join(vllm.split(".")[:2])
    assert message.startswith(f"vllm-omni publishes no release for vLLM {minor} ")
    assert "\n" not in message


def test_matrix_plans_vllm_omni_cells_from_the_hook():
    from conformance.release.matrix import plan_cells

    cells = {c.vllm: c for c in plan_cells(["vllm-omni"], ["0.28.0", "0.29.0", "0.30.0"], {})}
    assert cells["0.28.0"].extras == ("vllm-omni==0.28.0",)
    assert cells["0.30.0"].extras == ("vllm-omni==0.30.0",)
    assert cells["0.28.0"].unsupported is None
    assert str(cells["0.29.0"].unsupported).startswith("vllm-omni publishes no release for vLLM")


# ---- the factory's refusals (no vllm-omni needed) ---------------------------------------------


def _fake_installed(monkeypatch, vllm: str | None, omni: str | None, importable: bool) -> None:
    versions = {"vllm": vllm, "vllm-omni": omni}
    monkeypatch.setattr(adapter, "_installed", versions.get)
    monkeypatch.setattr(adapter, "_importable", lambda package: importable)


def test_factory_without_vllm_omni_says_what_to_install(monkeypatch):
    _fake_installed(monkeypatch, "0.30.0", None, False)
    with pytest.raises(SubjectUnsupported) as info:
        adapter.vllm_omni_subject()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("vllm-omni is not installed: pip install 'vllm-omni==0.30.0'")


def test_factory_refuses_a_release_for_another_vllm_minor(monkeypatch):
    _fake_installed(monkeypatch, "0.30.0", "0.28.0", True)
    with pytest.raises(SubjectUnsupported) as info:
        adapter.vllm_omni_subject()
    message = str(info.value)
    assert "\n" not in message
    assert "vllm-omni 0.28.0 targets vLLM 0.28" in message
    assert "vLLM 0.30.0 is installed" in message and "vllm-omni==0.30.0" in message


def test_factory_refuses_a_vllm_minor_without_a_release(monkeypatch):
    _fake_installed(monkeypatch, "0.29.0", "0.28.0", True)
    with pytest.raises(SubjectUnsupported, match=r"^vllm-omni publishes no release for vLLM 0\.29"):
        adapter.vllm_omni_subject()


@pytest.mark.skipif(
    adapter._importable("vllm_omni"), reason="vllm-omni is installed in this environment"
)
def test_check_is_unsupported_in_one_line_without_vllm_omni(tmp_path):
    # A subprocess, as a user runs it: stderr is file descriptor 2, all of it.
    code = (
        "import sys; from conformance import cli; "
        f"sys.exit(cli.main(['check', '--subject', 'vllm-omni', '--report-dir', {str(tmp_path)!r}]))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert len(err) == 1, err
    assert err[0].startswith("omni-conformance: unsupported: subject 'vllm-omni' ")
    assert "vllm-omni" in err[0].partition("does not support this environment: ")[2]


# ---- the differences registry -----------------------------------------------------------------

THIS_FILE = Path(__file__).read_text()


def test_registry_entries_are_complete():
    assert validate_entries(adapter.DIFFERENCES) == []
    assert adapter.VllmOmniSubject("0.30.0").differences() == adapter.DIFFERENCES


@pytest.mark.parametrize("entry", adapter.DIFFERENCES, ids=lambda e: e.id)
def test_registry_entries_say_why_and_where_vllm_omni_documents_it(entry):
    assert len(entry.rationale.split()) >= 20
    assert entry.documented_at
    for ref in entry.documented_at:
        path, _, rest = ref.partition(" ")[0].partition(":")
        assert path.startswith("vllm_omni/") and path.endswith(".py"), ref
        assert rest or "(" in ref, f"{ref}: names no symbol and says nothing of where"
        assert "[" not in ref or re.search(r" \[from \d+\.\d+\]$", ref), ref
    # At least one place holds for every release the entry applies to.
    assert any("[from " not in ref for ref in entry.documented_at)
    for test in entry.tests:
        file, _, name = test.partition("::")
        assert file == "tests/test_vllm_omni_subject.py"
        assert f"def {name}(" in THIS_FILE, test


def _ctx(path: str, upstream, subject, rid: str = "r1", facts: dict | None = None) -> dict:
    return {
        "path": path,
        "upstream": upstream,
        "subject": subject,
        "request_id": rid,
        "subject_state": {rid: facts} if facts is not None else {},
    }


def test_output_envelope_entry_tolerates_only_the_subclass_and_its_count():
    ok = adapter._omni_output_envelope
    assert ok(_ctx("outputs.r1.__type__", None, "OmniEngineCoreOutput"))
    assert ok(_ctx("outputs.r1#2.__type__", None, "OmniEngineCoreOutput"))
    assert ok(_ctx("outputs.r1.num_generation_tokens", None, 3))
    assert not ok(_ctx("outputs.r1.__type__", None, "SomethingElse"))
    assert not ok(_ctx("outputs.r1.__type__", "OtherOutput", "OmniEngineCoreOutput"))
    assert not ok(_ctx("outputs.r1.num_generation_tokens", None, -1))
    assert not ok(_ctx("outputs.r1.num_generation_tokens", None, True))
    assert not ok(_ctx("outputs.r1.new_token_ids", None, (5,)))
    assert not ok(_ctx("outputs.r1.finish_reason", None, "abort"))


def test_abort_entry_tolerates_only_the_synthesized_output_of_an_unreported_finish():
    ok = adapter._synthesized_abort
    fact = {adapter.AWAITING_FINISH_REPORT: True}
    output = {
        "new_token_ids": (),
        "finish_reason": "abort",
        "stop_reason": None,
        "prefill_stats": None,
        "__type__": "OmniEngineCoreOutput",
    }
    assert ok(_ctx("outputs.r1", None, output, facts=fact))
    assert not ok(_ctx("outputs.r1", None, output))  # never finished outside a step
    assert not ok(_ctx("outputs.r1", None, {**output, "new_token_ids": (7,)}, facts=fact))
    assert not ok(_ctx("outputs.r1", None, {**output, "finish_reason": "stop"}, facts=fact))
    assert not ok(_ctx("outputs.r1", {"finish_reason": None}, output, facts=fact))
    assert not ok(_ctx("outputs.r1.finish_reason", "length", "abort", facts=fact))


# The capabilities the subject provides; its worker is GPU-only (no real-worker checks here).
PROVIDED = {
    "declared_attributes",
    "input_adapter",
    "source_layout",
    "difference_witnesses",
    "chunk_delivery",
    "receiving_stage",
}


def test_subject_provides_only_what_vllm_omni_has():
    subject = adapter.VllmOmniSubject("0.30.0")
    assert subject.name == "vllm-omni"
    assert not subject.has_worker()
    for hook in set(CAPABILITY_HOOKS) - PROVIDED:
        assert getattr(subject, hook)() is None, hook


def test_every_registry_entry_has_a_witness_in_each_mode():
    witnesses = adapter.VllmOmniSubject("0.30.0").difference_witnesses()
    got = sorted((w.entry, w.mode) for w in witnesses)
    ids = sorted(e.id for e in adapter.DIFFERENCES)
    assert got == sorted((i, m) for i in ids for m in ("sync", "async"))


# ---- in environments with vllm-omni (opt in: -m vllm_omni) ------------------------------------


def _has_vllm_omni(env: Path) -> bool:
    return (env / "bin" / "python").exists() and any(
        env.glob("lib/python*/site-packages/vllm_omni")
    )


def vllm_omni_envs() -> list[Path]:
    from conformance.release.envs import default_envs_dir

    roots = [Path(p) for p in os.environ.get(ENVS_VAR, "").split(os.pathsep) if p]
    roots.append(default_envs_dir())
    found: list[Path] = []
    for root in roots:
        for env in (root, *(sorted(root.iterdir()) if root.is_dir() else ())):
            if env.is_dir() and _has_vllm_omni(env) and env not in found:
                found.append(env)
    return found


def _env_or_skip() -> list[Path]:
    envs = vllm_omni_envs()
    if not envs:
        pytest.skip(
            f"no environment with vLLM + vllm-omni + this harness: name one (or a folder of "
            f"them) in {ENVS_VAR}"
        )
    return envs


def _run(env: Path, args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    environ = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONHASHSEED": "0",
        "VLLM_USE_V2_MODEL_RUNNER": "0",
        "VIRTUAL_ENV": str(env),
    }
    return subprocess.run(
        [str(env / "bin" / "python"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environ,
        cwd=str(env),
    )


def _omni_version(env: Path) -> tuple[int, int]:
    out = _run(
        env, ["-c", "from importlib.metadata import version; print(version('vllm-omni'))"], 60
    )
    major, minor = re.match(r"(\d+)\.(\d+)", out.stdout.strip()).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


# The longest shrunk trace the gate may report for vllm-omni (issue acceptance: at most 12 ops).
MAX_SHRUNK_OPS = 12


@pytest.mark.vllm_omni
def test_gate_on_vllm_omni(tmp_path):
    """The gate's verdict in each environment, and that every divergence it reports is real.

    vllm-omni up to 0.30 patches vLLM when its scheduler module is imported, so the gate runs
    upstream in its own process (the report says so). Each failing test's saved traces (its
    failure's, and a statistics difference it set aside) must be short, reproduce on replay
    (the same first difference or audit problem) and be clean against upstream (exit 3) in the
    same environment."""
    for env in _env_or_skip():
        out = tmp_path / env.name
        proc = _run(
            env,
            [
                "-m",
                "conformance.cli",
                "check",
                "--subject",
                "vllm-omni",
                "--report-dir",
                str(out / "report"),
                "--failures-dir",
                str(out / "failures"),
                "-q",
            ],
            3600,
        )
        tail = (proc.stdout + proc.stderr)[-3000:]
        assert proc.returncode in (0, 1), (env, proc.returncode, tail)
        report = json.loads((out / "report" / "compat-report.json").read_text())
        oracle = report["environment"]["oracle"]
        if _omni_version(env) <= (0, 30):
            assert oracle.startswith("separate process: loading subject 'vllm-omni'"), oracle
            assert "RequestStatus.WAITING_FOR_CHUNK added" in oracle, oracle
        assert report["summary"]["ran"] > 0, report["summary"]
        traces = findings(report)
        for trace in traces:
            ops = len(json.loads(Path(trace).read_text())["ops"])
            assert ops <= MAX_SHRUNK_OPS, (trace, ops)
        # Each subject in one process for all traces (``replay`` takes several).
        again = _run(env, ["-m", "conformance.cli", "replay", *traces], 3600)
        for trace, lines in replay_blocks(again.stdout).items():
            assert lines and not lines[0].startswith("does not reproduce"), (trace, lines)
            assert not any("DIFFERENT" in line for line in lines), (trace, lines)
        assert set(replay_blocks(again.stdout)) == set(traces), again.stdout[-2000:]
        clean = _run(
            env, ["-m", "conformance.cli", "replay", *traces, "--subject", "upstream"], 3600
        )
        assert clean.returncode == 3, clean.stdout[-2000:] + clean.stderr[-2000:]


# Tests whose failures are judgements of a probe's single input, not of a workload: they save
# no trace (docs/vllm-omni.md, "Stage inputs").
NO_TRACE_TESTS = ("test_malformed_inputs_rejected_at_adapter", "test_duplicate_live_id_rejected")


def findings(report: dict) -> list[str]:
    """Every trace a report's failures name (a statistics difference set aside included); a
    failure of a workload without one is itself an error of the gate."""
    traces: list[str] = []
    for failure in report["failures"]:
        test = failure["test"].rsplit("::", 1)[-1]
        for found in (failure, failure.get("set_aside") or {}):
            trace = found.get("trace")
            if trace and trace not in traces:
                traces.append(trace)
        if not failure["trace"]:
            assert test.startswith(NO_TRACE_TESTS), failure
    return traces


def replay_blocks(stdout: str) -> dict[str, list[str]]:
    """``replay TRACE...``'s output, per trace (the lines under its ``== TRACE`` line)."""
    blocks: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in stdout.splitlines():
        if line.startswith("== "):
            current = blocks.setdefault(line[3:], [])
        elif current is not None and not line.startswith("note: "):
            current.append(line)
    return blocks


# Runs one side (argv[1]: "upstream" or "vllm-omni") without the gate: a and b are prefilled,
# b is aborted, two steps follow; prints each output's class and fields as JSON. For vllm-omni
# it also checks that every place the registry cites exists in the installed package.
SIDE = textwrap.dedent(
    r"""
    import json, sys
    from pathlib import Path
    import vllm.v1.engine as engine
    from vllm.v1.request import RequestStatus
    original = engine.EngineCoreOutput  # before vllm_omni rebinds the name
    from conformance._core.config import HarnessConfig
    from conformance._core.driver import make_driver
    from conformance._core.tokens import DeterministicTokenSource
    from conformance._core.workload import AddRequest
    missing = []
    if sys.argv[1] == "vllm-omni":
        from conformance.adapters import vllm_omni as adapter
        subject = adapter.vllm_omni_subject()
        import vllm_omni
        import re
        from importlib.metadata import version
        root = Path(vllm_omni.__file__).parent.parent
        installed = tuple(int(x) for x in version("vllm-omni").split(".")[:2])
        for entry in adapter.DIFFERENCES:
            for ref in entry.documented_at:
                since = re.search(r"\[from (\d+)\.(\d+)\]$", ref)
                if since and installed < (int(since[1]), int(since[2])):
                    continue
                path, _, symbol = ref.partition(" ")[0].partition(":")
                source = root / path
                text = source.read_text() if source.exists() else ""
                names = [n for n in symbol.split(".") if n]
                if not text or not all(
                    f"class {n}" in text or f"def {n}(" in text for n in names
                ):
                    missing.append(ref)
    else:
        from conformance._core.subjects import UpstreamSubject
        subject = UpstreamSubject()
    cfg = HarnessConfig(async_scheduling=sys.argv[2] == "async")
    sched = subject.build_scheduler(cfg)
    driver = make_driver(sched, DeterministicTokenSource(vocab=512))
    for rid in ("a", "b"):
        op = AddRequest(rid, tuple(range(1, 21)), max_tokens=4)
        sched.add_request(subject.make_request(op, list(op.prompt), cfg, sched, 0.0))
    steps = []
    def step():
        obs = driver.step()
        outs = []
        for client in sorted(obs.outputs or {}):
            for out in obs.outputs[client].outputs:
                outs.append({
                    "id": out.request_id,
                    "upstream_class": type(out) is original,
                    "class": type(out).__name__,
                    "tokens": list(out.new_token_ids),
                    "finish": None if out.finish_reason is None else str(out.finish_reason),
                    "num_generation_tokens": getattr(out, "num_generation_tokens", None),
                })
        steps.append(outs)
    step(); step()
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    step(); step(); step()
    from vllm.v1.engine import EngineCoreOutput as current  # vllm-omni's class once patched
    count_field = "num_generation_tokens" in current.__struct_fields__
    print(json.dumps({"steps": steps, "missing": missing, "count_field": count_field}))
    """
)


def _side(env: Path, side: str, mode: str) -> dict:
    proc = _run(env, ["-c", SIDE, side, mode], 1800)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.vllm_omni
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_documented_differences_happen(mode):
    """Each registry entry describes something vllm-omni really does that upstream does not."""
    for env in _env_or_skip():
        up, vo = _side(env, "upstream", mode), _side(env, "vllm-omni", mode)
        assert vo["missing"] == [], f"registry cites places {env.name} does not have"
        up_outs = [o for s in up["steps"] for o in s]
        vo_outs = [o for s in vo["steps"] for o in s]
        # VLLM-OMNI-OUT-001: every vllm-omni output is the subclass and carries its count.
        assert up_outs and all(o["upstream_class"] for o in up_outs)
        assert vo_outs and all(o["class"] == "OmniEngineCoreOutput" for o in vo_outs)
        counted: dict[str, int] = {}
        for o in vo_outs:  # the count field exists from vllm-omni 0.30 on
            counted[o["id"]] = counted.get(o["id"], 0) + len(o["tokens"])
            if vo["count_field"] and o["finish"] != "abort":
                assert o["num_generation_tokens"] == counted[o["id"]], o
            elif not vo["count_field"]:
                assert o["num_generation_tokens"] is None, o
        # VLLM-OMNI-ABORT-001: the aborted b gets one ABORT output after the abort, upstream none.
        aborted = [o for s in vo["steps"][2:] for o in s if o["id"] == "b"]
        assert [(o["tokens"], o["finish"]) for o in aborted] == [([], "abort")]
        assert not [o for s in up["steps"][2:] for o in s if o["id"] == "b"]


TRACES = sorted((Path(__file__).parent / "data" / "vllm_omni").glob("*.json"))


@pytest.mark.vllm_omni
@pytest.mark.parametrize("trace", TRACES, ids=lambda p: p.stem)
def test_saved_traces_reproduce_against_a_pristine_oracle(trace):
    """Each saved divergence, in every environment: the gate's replay (upstream in its own
    process, since vllm-omni patches vLLM here) reproduces the recorded first difference, and
    the same trace is clean against upstream (exit 3)."""
    recorded = json.loads(trace.read_text())["meta"]["first_difference"]
    for env in _env_or_skip():
        again = _run(env, ["-m", "conformance.cli", "replay", str(trace)], 1800)
        out = again.stdout + again.stderr
        assert again.returncode == 1, out[-3000:]
        assert "runs in a separate process" in again.stdout, out[-3000:]
        headline = [line for line in again.stdout.splitlines() if "first difference" in line]
        assert headline, out[-3000:]
        assert f"step {recorded['step']} " in headline[-1], (env.name, headline[-1])
        assert f"{recorded['path']}:" in headline[-1], (env.name, headline[-1])
        clean = _run(
            env, ["-m", "conformance.cli", "replay", str(trace), "--subject", "upstream"], 1800
        )
        assert clean.returncode == 3, clean.stdout[-2000:] + clean.stderr[-2000:]


CONDITIONAL = sorted((Path(__file__).parent / "data" / "vllm_omni" / "conditional").glob("*.json"))


def _vllm_minor(env: Path) -> str:
    out = _run(env, ["-c", "from importlib.metadata import version; print(version('vllm'))"], 60)
    return ".".join(out.stdout.strip().split(".")[:2])


@pytest.mark.vllm_omni
@pytest.mark.parametrize("trace", CONDITIONAL, ids=lambda p: p.stem)
def test_release_specific_traces_reproduce_where_recorded(trace):
    """The behaviours vLLM's own tests found on one vllm-omni release only (its statistics
    throttle, a grammar error or an encoder stop 0.28 never finishes, metrics 0.30 never
    records, ...): each trace names the releases it reproduces on (``meta.reproduces_on``);
    there it replays with its recorded first difference and is clean against upstream."""
    meta = json.loads(trace.read_text())["meta"]
    envs = [env for env in _env_or_skip() if _vllm_minor(env) in meta["reproduces_on"]]
    if not envs:
        pytest.skip(f"no vllm-omni environment for {meta['reproduces_on']}")
    recorded = meta["first_difference"]
    for env in envs:
        again = _run(env, ["-m", "conformance.cli", "replay", str(trace)], 1800)
        headline = [line for line in again.stdout.splitlines() if "first difference" in line]
        assert again.returncode == 1 and headline, (again.stdout + again.stderr)[-3000:]
        assert f"step {recorded['step']} " in headline[-1], (env.name, headline[-1])
        assert f"{recorded['path']}:" in headline[-1], (env.name, headline[-1])
        clean = _run(
            env, ["-m", "conformance.cli", "replay", str(trace), "--subject", "upstream"], 1800
        )
        assert clean.returncode == 3, clean.stdout[-2000:] + clean.stderr[-2000:]


# In an environment: the declared attributes against live objects and vllm-omni's source, and a
# planted wrong declaration (nothing declared) failing C-12 under the isolated oracle.
AUDIT = textwrap.dedent(
    """
    import json, pathlib, sys
    from conformance._core.capabilities import DeclaredAttributes
    from conformance._core.machine import PREFIXES, TIGHT
    from conformance._core.oracle_process import ProcessSide
    from conformance._core.subjects import load_subject
    from conformance._core.workload import Abort, AddRequest, Step
    from invariants.machines import AuditedLockstep

    subject = load_subject("vllm-omni")  # before anything imports vllm-omni: the guard sees it
    import vllm_omni

    class Undeclared(type(subject)):
        def declared_attributes(self):
            return DeclaredAttributes()

    def problems(s, mode):
        cfg = TIGHT.with_(enable_prefix_caching=True, async_scheduling=mode == "async")
        session = AuditedLockstep(cfg, s, prefixes=PREFIXES)
        assert isinstance(session.up, ProcessSide)
        try:
            ops = [AddRequest("r1", (11, 12, 13), max_tokens=4),
                   AddRequest("r2", tuple(range(20, 40)), max_tokens=6), Step(), Step(),
                   Abort(("r2",)), Step(), Step()]
            for op in ops:
                session.apply(op)
            return list(session.problems)
        finally:
            session.shutdown()

    declared = subject.declared_attributes()
    if declared is None:  # a release whose source the adapter's declarations were not read from
        print(json.dumps({"read": False}))
        sys.exit(0)
    wrong = Undeclared(subject.omni_version)
    root = pathlib.Path(vllm_omni.__file__).parent
    source = "".join(p.read_text() for p in root.rglob("*.py"))
    unread = [n for n in [*declared.request, *declared.scheduler] if n not in source]
    out = {m: {"right": problems(subject, m), "wrong": problems(wrong, m)}
           for m in ("sync", "async")}
    print(json.dumps({"read": True, "runs": out, "unread": unread}))
    """
)


@pytest.mark.vllm_omni
def test_declared_attributes_hold_and_a_wrong_declaration_fails():
    for env in _env_or_skip():
        proc = _run(env, ["-c", AUDIT], 1800)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        if not got["read"]:
            assert _omni_version(env)[1] not in (28, 30), env.name
            continue
        assert got["unread"] == [], (env.name, got["unread"])
        for mode, runs in got["runs"].items():
            assert runs["right"] == [], (env.name, mode, runs["right"])
            wrong = runs["wrong"]
            assert any(p.startswith("C-12: r1: attributes added") for p in wrong), wrong
            assert any(p.startswith("C-12: scheduler attributes") for p in wrong), wrong


RECEIVING = textwrap.dedent(
    """
    import json
    from conformance._core.subjects import load_subject
    from conformance._core.workload import Abort, AddRequest, ChunkArrives, Step
    from invariants.test_receiving_stages import run_program

    subject = load_subject("vllm-omni")  # before anything imports vllm-omni: the guard sees it

    class ForgetsParked(type(subject)):
        # Planted: a chunk adapter that never lets go of a request's receiving side (its
        # finish_requests and cleanup_receiver do nothing).
        def build_scheduler(self, cfg):
            scheduler = super().build_scheduler(cfg)
            receiver = scheduler.chunk_transfer_adapter
            if receiver is not None:
                receiver.finish_requests = lambda *a, **k: []
                receiver.cleanup_receiver = lambda *a, **k: None
            return scheduler

    class RestoresTwice(type(subject)):
        # Planted: parked requests go back to their queue twice after a schedule.
        def build_scheduler(self, cfg):
            scheduler = super().build_scheduler(cfg)
            receiver = scheduler.chunk_transfer_adapter
            if receiver is not None:
                restore = receiver.restore_queues

                def twice(waiting, running, *rest, **named):
                    parked = list(receiver.waiting_for_chunk_waiting_requests)
                    restore(waiting, running, *rest, **named)
                    for request in parked:
                        waiting.add_request(request)

                receiver.restore_queues = twice
            return scheduler

    class KeepsBlocks(type(subject)):
        # Planted: a finished request's blocks are never given back.
        def build_scheduler(self, cfg):
            scheduler = super().build_scheduler(cfg)
            scheduler.kv_cache_manager.free = lambda request: None
            return scheduler

    class PreemptsKeepingTokens(type(subject)):
        # Planted: a preempted request keeps a computed token.
        def build_scheduler(self, cfg):
            scheduler = super().build_scheduler(cfg)
            preempt = scheduler._preempt_request

            def keeps(request, *a, **k):
                out = preempt(request, *a, **k)
                request.num_computed_tokens = 1
                return out

            scheduler._preempt_request = keeps
            return scheduler

    class CoordinatorKeeps(type(subject)):
        # Planted: the full-payload coordinator never lets go of a request.
        def build_scheduler(self, cfg):
            scheduler = super().build_scheduler(cfg)
            coordinator = getattr(scheduler, "input_coordinator", None)
            if coordinator is not None:
                coordinator.free_finished_request = lambda request_id: None
            return scheduler

    full = subject.receiving_stage().FULL_PAYLOAD
    # Four requests of 50 tokens growing to 80 in 14 blocks of 16: preemptions.
    pressure = [AddRequest(f"r{i}", tuple(range(10 + i, 60 + i)), max_tokens=30) for i in range(4)]
    pressure += [op for _ in range(30) for op in (*(ChunkArrives(f"r{i}") for i in range(4)), Step())]
    program = [AddRequest("r0", (100, 101, 102), max_tokens=3), Step(),
               AddRequest("r1", (7, 8), max_tokens=2), ChunkArrives("r1"), Step(), Abort(("r0",))]
    version = subject.omni_version
    out = {m: {"right": run_program(subject, m, program)[0],
               "planted": run_program(ForgetsParked(version), m, program)[0],
               "twice": run_program(RestoresTwice(version), m, program)[0],
               "blocks": run_program(KeepsBlocks(version), m, program)[0],
               "pressure": run_program(subject, m, pressure)[0],
               "preempted": run_program(PreemptsKeepingTokens(version), m, pressure)[0],
               "full_right": run_program(subject, m, program, feature=full)[0],
               "full_pressure": run_program(subject, m, pressure, feature=full)[0],
               "full_planted": run_program(CoordinatorKeeps(version), m, program, feature=full)[0]}
           for m in ("sync", "async")}
    print(json.dumps(out))
    """
)


@pytest.mark.vllm_omni
def test_a_receiving_stage_that_keeps_an_aborted_request_fails_c47():
    """vllm-omni's talker, parked on chunks or on a whole payload, passes C-47; planted faults
    fail it: an adapter that keeps an aborted request's receiving side, one that restores parked
    requests to their queue twice, a scheduler that never gives a finished request's blocks
    back, one whose preempted requests keep a computed token, and a full-payload coordinator
    that keeps an aborted request."""
    for env in _env_or_skip():
        proc = _run(env, ["-c", RECEIVING], 900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        for mode, runs in got.items():
            assert runs["right"] == [], (env.name, mode, runs["right"])
            planted = runs["planted"]
            assert planted and planted[0].startswith("C-47: r0 was aborted but is still held"), (
                env.name,
                mode,
                planted,
            )
            twice = runs["twice"]
            assert twice and "is kept 2 times in the scheduler's queues" in twice[0], twice
            blocks = runs["blocks"]
            assert blocks and "blocks still held after every request ended" in blocks[0], blocks
            assert runs["pressure"] == [], (env.name, mode, runs["pressure"])
            preempted = runs["preempted"]
            assert preempted and "is PREEMPTED with" in preempted[0], (env.name, mode, preempted)
            # The same talker fed whole payloads (``WAITING_FOR_INPUT``), and its planted fault.
            assert runs["full_right"] == [] and runs["full_pressure"] == [], (env.name, runs)
            kept = runs["full_planted"]
            assert kept and kept[0].startswith("C-47: r0 was aborted but is still held ("), kept


CHUNK_TRACES = sorted((Path(__file__).parent / "data" / "vllm_omni" / "chunk").glob("*.json"))


@pytest.mark.vllm_omni
@pytest.mark.parametrize("trace", CHUNK_TRACES, ids=lambda p: p.stem)
def test_chunk_path_traces_reproduce_where_recorded(trace):
    """What the chunk properties found on vllm-omni's chunk path (C-45: rows handed downstream
    twice after a recompute): the trace replays with its recorded problem on the releases it
    names, and upstream, which has no chunk path, cannot show it."""
    meta = json.loads(trace.read_text())["meta"]
    envs = [env for env in _env_or_skip() if _vllm_minor(env) in meta["reproduces_on"]]
    if not envs:
        pytest.skip(f"no vllm-omni environment for {meta['reproduces_on']}")
    for env in envs:
        again = _run(env, ["-m", "conformance.cli", "replay", str(trace)], 900)
        assert again.returncode == 1, (again.stdout + again.stderr)[-3000:]
        assert meta["problem"] in again.stdout, (env.name, again.stdout[-2000:])
        clean = _run(
            env, ["-m", "conformance.cli", "replay", str(trace), "--subject", "upstream"], 900
        )
        assert clean.returncode == 3, clean.stdout[-2000:] + clean.stderr[-2000:]
