"""Unit tests of the harness's own parts: workload traces, the token source, observation,
comparison and registry tolerance, subjects, the compat report and environment checks.

Each test names what would go wrong without the property it checks: a trace that does not
round-trip cannot be replayed; a token source that samples on a partial prefill chunk or keeps
state after ``finished_req_ids`` is not a faithful worker; a comparison that does not attribute a
tolerated difference to its entry cannot be audited; a report that drifts from its schema breaks
every CI consumer.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest

from conformance._core import vllm_compat
from conformance._core.compare import compare, iter_differences
from conformance._core.config import HarnessConfig
from conformance._core.differences import Registry, validate_entries
from conformance._core.lockstep import Lockstep, run_trace, shrink
from conformance._core.machine import PREFIXES, TIGHT
from conformance._core.observe import observe_schedule
from conformance._core.report import ReportBuilder, TestRecord, render_junit, validate, write_report
from conformance._core.scenarios import run_canonical
from conformance._core.subjects import (
    BaseSubject,
    UpstreamSubject,
    available_subjects,
    load_subject,
)
from conformance._core.tokens import DeterministicTokenSource
from conformance._core.workload import (
    Abort,
    AddRequest,
    DeliverChunks,
    ResetPrefixCache,
    Step,
    Trace,
)
from conformance.cli import main
from omni_runtime.conformance_subject import OmniSubject

pytestmark = pytest.mark.clauses("C-01", "C-03")


# ---- workload ----------------------------------------------------------------------------


def test_trace_round_trips_through_json(tmp_path):
    trace = Trace(
        config=HarnessConfig(
            num_blocks=9,
            async_scheduling=True,
            additional_config={"omni_stage": {"stage_id": "a", "stages": ["a"]}},
        ),
        prefixes={"p": (1, 2, 3)},
        ops=[
            AddRequest(
                "r0",
                (7, 8),
                prefix="p",
                max_tokens=3,
                stop_token_ids=(5,),
                ignore_eos=False,
                final_stage="a",
            ),
            Step(),
            Abort(("r0", "zz")),
            ResetPrefixCache(reset_running_requests=True),
            ResetPrefixCache(reset_connector=True),
            DeliverChunks(),
        ],
        meta={"note": "x"},
    )
    path = trace.save(tmp_path / "t.json")
    back = Trace.load(path)
    assert back.ops == trace.ops and back.config == trace.config
    assert back.prefixes == trace.prefixes and back.meta == trace.meta
    assert back.prompt_of(back.ops[0]) == [1, 2, 3, 7, 8]
    with pytest.raises(ValueError, match="unknown op"):
        Trace.from_dict({**trace.to_dict(), "ops": [{"op": "explode"}]})
    with pytest.raises(ValueError, match="format"):
        Trace.from_dict({**trace.to_dict(), "format": "other"})


class _OneClientRequests(BaseSubject):
    """A subject hook that drops the request's client: every request as client 0."""

    name = "one-client-requests"

    def make_request(self, op, prompt, cfg, scheduler, arrival):
        return super().make_request(replace(op, client_index=0), prompt, cfg, scheduler, arrival)


class _OutputsUnderOneClient(BaseSubject):
    """Upstream's scheduler with the runtime mutant's flaw: a step's outputs all come back in
    one client's container."""

    name = "outputs-under-one-client"

    @property
    def sync_scheduler(self):  # type: ignore[override]
        from vllm.v1.core.sched.scheduler import Scheduler

        from tests.mutants.runtime_mutants import OutputsUnderOneClient

        return type("OneClientScheduler", (OutputsUnderOneClient, Scheduler), {})


def _two_client_trace() -> Trace:
    return Trace(
        config=HarnessConfig(num_blocks=12, max_num_batched_tokens=32),
        ops=[
            AddRequest("a", tuple(range(10, 30)), max_tokens=3),
            AddRequest("b", tuple(range(40, 55)), max_tokens=2, client_index=1),
            *[Step()] * 4,
        ],
    )


def test_a_second_client_is_written_replayed_and_compared(tmp_path):
    """A request of client 1 round-trips (client 0 is not written, so old traces read the
    same), each step's outputs name their client, and a subject whose hook loses the client is
    caught there; a subject whose engine serves one client gets its requests from client 0."""
    trace = _two_client_trace()
    back = Trace.load(trace.save(tmp_path / "t.json"))
    assert back.ops == trace.ops
    written = json.loads((tmp_path / "t.json").read_text())["ops"]
    assert "client_index" not in written[0] and written[1]["client_index"] == 1
    assert "client=1" in trace.ops[1].describe()

    assert run_trace(trace, UpstreamSubject()).failure is None
    # A hook that loses the client is named as such, at the request it built.
    failure = run_trace(trace, _OneClientRequests()).failure
    assert failure is not None and failure.path == "exception", failure
    assert "ClientNotCarried" in failure.subject and "op.client_index" in failure.subject
    # A scheduler that hands the outputs back under another client shows in the outputs.
    failure = run_trace(trace, _OutputsUnderOneClient()).failure
    assert failure is not None and failure.path == "outputs.b.client", failure

    single = _OneClientRequests()
    single.single_engine_client = True  # type: ignore[attr-defined]
    result = run_trace(trace, single)
    assert result.failure is None
    assert [getattr(op, "client_index", 0) for op in result.trace.ops] == [0] * 6


def test_a_plain_request_is_written_replayed_and_served_as_upstream(tmp_path):
    """A request from a client that knows nothing of the runtime (``plain``) round-trips (unset
    is not written), reaches the omni stage without a slot, and sends nothing downstream while
    its neighbour with a slot streams (C-42)."""
    from omni_runtime.adapters import omni_state_of
    from omni_runtime.conformance_subject import TOKEN_UPDATES

    cfg = HarnessConfig(
        num_blocks=12,
        max_num_batched_tokens=32,
        additional_config=dict(TOKEN_UPDATES[1]["additional_config"]),
    )
    adds = [
        AddRequest("omni", tuple(range(10, 30)), max_tokens=3),
        AddRequest("plain", tuple(range(40, 55)), max_tokens=3, plain=True),
    ]
    trace = Trace(config=cfg, ops=[*adds, *[Step()] * 5, DeliverChunks()])
    back = Trace.load(trace.save(tmp_path / "t.json"))
    assert back.ops == trace.ops
    written = json.loads((tmp_path / "t.json").read_text())["ops"]
    assert "plain" not in written[0] and written[1]["plain"] is True
    assert trace.ops[1].describe().endswith(" plain")

    session = Lockstep(cfg, OmniSubject())
    for op in adds:
        session.apply(op)
    held = session.sub.scheduler.requests
    assert omni_state_of(held["omni"]) is not None and omni_state_of(held["plain"]) is None
    for op in trace.ops[len(adds) :]:
        session.apply(op)
    assert session.failure is None, session.failure
    assert {c.request_id for c in session.sub.chunks} == {"omni"}


# ---- token source ------------------------------------------------------------------------


def _scheduler(cfg=None):
    return UpstreamSubject().build_scheduler(cfg or HarnessConfig(max_num_batched_tokens=16))


def _add(sched, rid, n, **kw):
    op = AddRequest(rid, tuple(range(10, 10 + n)), **kw)
    cfg = HarnessConfig()
    sched.add_request(UpstreamSubject().make_request(op, list(op.prompt), cfg, sched, 0.0))


def test_token_source_is_a_faithful_worker():
    sched = _scheduler()
    _add(sched, "a", 40)  # 3 chunks of 16 under a 16-token budget
    src, twin = DeterministicTokenSource(), DeterministicTokenSource()
    sampled = []
    for _ in range(4):
        so = sched.schedule()
        out = src.execute(so)
        assert out.req_ids == list(so.num_scheduled_tokens)  # exactly the scheduled ones (C-20)
        assert twin.execute(so).sampled_token_ids == out.sampled_token_ids  # pure function
        sampled.append(out.sampled_token_ids[0])
        sched.update_from_output(so, out)
    assert sampled[0] == [] and sampled[1] == []  # partial prefill chunks sample nothing
    assert len(sampled[2]) == 1 and len(sampled[3]) == 1
    from vllm.v1.request import RequestStatus

    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    src.execute(sched.schedule())  # finished_req_ids reach the worker in the next output
    assert src.live_ids() == set()


def test_stop_tokens_only_where_the_request_allows_them():
    src = DeterministicTokenSource()
    from conformance._core.tokens import _ReqView

    free = _ReqView(num_tokens=0, stop_ids=(), eos=None)
    stops = _ReqView(num_tokens=0, stop_ids=(5, 6), eos=None)
    plain = [src.choose(free, "r", p) for p in range(200)]
    assert not set(plain) & {0, 1, 2}
    chosen = [src.choose(stops, "r", p) for p in range(200)]
    assert 10 < sum(t in (5, 6) for t in chosen) < 60


def test_token_edges_are_sampled_and_replay_from_a_trace_config():
    from conformance._core.tokens import EDGE_PERIOD, _ReqView

    edges = (0, 255, 256)
    src = DeterministicTokenSource(edges=edges)
    view = _ReqView(num_tokens=0, stop_ids=(), eos=None)
    chosen = [src.choose(view, "r", p) for p in range(400)]
    # Each edge at about one position in 3 * EDGE_PERIOD; a uniform draw over 509 ids would
    # give 0 never and 255 or 256 about once in 400 positions.
    for edge in edges:
        assert 400 // (6 * EDGE_PERIOD) < chosen.count(edge) < 400 // EDGE_PERIOD
    # Stop ids keep their share and their positions: an edge never replaces a chosen stop.
    stops = _ReqView(num_tokens=0, stop_ids=(5, 6), eos=None)
    plain = DeterministicTokenSource()
    assert [src.choose(stops, "r", p) in (5, 6) for p in range(400)] == [
        plain.choose(stops, "r", p) in (5, 6) for p in range(400)
    ]
    # The edges are part of the configuration a trace records.
    cfg = HarnessConfig(token_edges=edges)
    assert HarnessConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_speculative_decoding_changes_steps_not_tokens():
    """Drafting and verifying must leave every request's tokens what one token a step gives
    (tokens are a function of position), while steps accept several and reject some."""
    from conformance._core.driver import SyncDriver

    def run(drafts: int) -> tuple[dict[str, list[int]], list[int]]:
        cfg = HarnessConfig(num_speculative_tokens=drafts)
        sched = UpstreamSubject().build_scheduler(cfg)
        for rid, n, stop in (("a", 20, ()), ("b", 33, (5, 6)), ("c", 5, ())):
            op = AddRequest(rid, tuple(range(10, 10 + n)), max_tokens=24, stop_token_ids=stop)
            sched.add_request(UpstreamSubject().make_request(op, list(op.prompt), cfg, sched, 0.0))
        driver = SyncDriver(sched, DeterministicTokenSource(num_drafts=drafts))
        tokens: dict[str, list[int]] = {}
        per_step: list[int] = []
        while sched.has_requests():
            for eco in (driver.step().outputs or {}).values():
                for out in eco.outputs:
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                    per_step.append(len(out.new_token_ids))
        return tokens, per_step

    plain, one_each = run(0)
    spec, several = run(3)
    assert spec == plain
    assert max(one_each) == 1 and max(several) == 4  # three drafts accepted, plus one sampled
    assert len(several) < len(one_each)
    # A replayed trace drafts as its run did.
    cfg = HarnessConfig(num_speculative_tokens=3)
    assert HarnessConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_schedule_snapshot_is_copied_right_away():
    sched = _scheduler(HarnessConfig())
    _add(sched, "a", 20)
    so = sched.schedule()
    snap = observe_schedule(so)
    so.scheduled_new_reqs[0].block_ids[0].append(999)  # later mutation of live lists
    so.num_scheduled_tokens["a"] = 0
    assert snap["num_scheduled_tokens"]["a"] == 20
    assert 999 not in snap["block_ids"]["a"][0]


# ---- comparison and registry -------------------------------------------------------------


class _Entry:
    def __init__(self, id, fields, ok):
        self.id, self.fields, self._ok = id, fields, ok
        self.condition, self.rationale = "cond", "why"
        self.tests, self.clauses = ("t",), ("C-02",)
        self.applies = lambda ctx: self._ok(ctx)


def test_compare_tolerates_only_through_matching_applicable_entries():
    up = {"outputs": {"r": {"x": 1, "y": None}}, "queues": {"waiting": ["a", "b"]}}
    sub = {"outputs": {"r": {"x": 1, "y": 5, "z": 2}}, "queues": {"waiting": ["a", "b"]}}
    reg = Registry(
        [
            _Entry("E-Y", ("outputs.*.y",), lambda c: c["upstream"] is None),
            _Entry("E-Z", ("outputs.*.z",), lambda c: False),
        ]
    )
    res = compare(up, sub, reg, {"step": 3, "op": "step"})
    assert res.tolerated == {"E-Y": 1}
    assert res.failure is not None and res.failure.path == "outputs.r.z"
    assert res.failure.not_applicable == ("E-Z",) and res.failure.request_id == "r"
    assert res.failure.step == 3
    assert compare(up, up, reg, {}).failure is None
    paths = [".".join(p) for p, *_ in iter_differences(up, sub)]
    assert paths == ["outputs.r.y", "outputs.r.z"]


def test_omni_registry_is_complete():  # C-03: fields, condition, rationale, tests, clauses
    assert validate_entries(OmniSubject().differences()) == []
    assert validate_entries([_Entry("X", (), lambda c: True)]) == ["X: fields is empty"]


# ---- subjects ----------------------------------------------------------------------------


class MiniRuntime(BaseSubject):
    """A stand-in for another runtime: the whole adoption is this class."""

    name = "mini"
    sync_scheduler = "vllm.v1.core.sched.scheduler.Scheduler"


mini_subject = MiniRuntime()


def test_subject_registry():
    assert {"omni", "upstream"} <= set(available_subjects())
    assert isinstance(load_subject("omni"), OmniSubject)
    assert isinstance(load_subject("upstream"), UpstreamSubject)
    # (pytest imports this file under another module name, so compare by class name.)
    assert (
        type(load_subject("tests.test_conformance_harness:mini_subject")).__name__ == "MiniRuntime"
    )
    assert load_subject("tests.test_conformance_harness:MiniRuntime").name == "mini"
    with pytest.raises(LookupError, match="unknown subject"):
        load_subject("nope")


def test_another_runtime_plugs_in_with_one_small_module():
    session = run_canonical(TIGHT, MiniRuntime())
    assert session.failure is None and session.steps_compared > 20


def test_worker_mode_with_a_worker_base_subclass():
    from conformance._core.token_worker import QUALNAME

    class WithWorker(UpstreamSubject):
        worker_cls = QUALNAME

    for mode in (False, True):
        cfg = TIGHT.with_(async_scheduling=mode)
        via_worker = Lockstep(cfg, WithWorker(), prefixes=PREFIXES, use_worker=True)
        session = run_canonical(cfg, WithWorker())  # token-source mode
        from conformance._core.scenarios import canonical_workload

        canonical_workload(via_worker)
        assert via_worker.failure is None
        assert via_worker.trace.ops == session.trace.ops  # the same tokens drive the same run


@pytest.mark.skipif(not OmniSubject().has_worker(), reason="omni_runtime.worker not available")
def test_omni_real_worker_in_lock_step():
    cfg = TIGHT.with_(max_num_seqs=4)
    session = Lockstep(cfg, OmniSubject(), prefixes=PREFIXES, use_worker=True)
    for i in range(3):
        session.apply(AddRequest(f"w{i}", tuple(range(20 + i, 40 + i)), prefix="sys", max_tokens=6))
    session.drain(60)
    assert session.failure is None, session.failure.headline()


# ---- shrinking ---------------------------------------------------------------------------


def test_shrink_keeps_the_failure_and_drops_the_rest():
    from tests.mutants import harness_mutants as M

    session = run_canonical(TIGHT, M.extra_output)
    assert session.failure is not None
    path = session.failure.path
    small = shrink(
        session.trace,
        lambda t: (
            (f := run_trace(t, M.extra_output).failure) is not None
            and f.path.split(".")[0] == path.split(".")[0]
        ),
    )
    assert len(small.ops) < len(session.trace.ops)
    assert run_trace(small, M.extra_output).failure is not None


# ---- report ------------------------------------------------------------------------------


def _report(outcome="passed"):
    b = ReportBuilder(
        subject="omni", profile="ci", seed=0, environment=vllm_compat.environment_versions()
    )
    b.add(
        TestRecord(
            "t::a",
            "passed",
            ["C-01", "C-05"],
            examples=3,
            steps_compared=40,
            tolerated={"OMNI-OUT-001": 2},
            exercised={"preemptions": 2},
        )
    )
    b.add(
        TestRecord(
            "t::b",
            outcome,
            ["C-04"],
            examples=1,
            steps_compared=5,
            message="first difference at step 2 ...",
            first_difference={
                "step": 2,
                "op": "abort",
                "path": "audit.leaked_omni_ids",
                "upstream": [],
                "subject": ["r1"],
            },
            trace="conformance-failures/x.json",
        )
    )
    return b.build()


def test_report_validates_and_renders(tmp_path):
    good, bad = _report(), _report("failed")
    validate(good)
    validate(bad)
    assert good["status"] == "pass" and bad["status"] == "fail"
    inv = {i["id"]: i for i in bad["invariants"]}
    assert inv["AR-INV-001"]["status"] == "fail"
    assert inv["AR-INV-001"]["examples"] == 4  # each test counted once, not once per clause
    assert inv["AR-INV-002"]["status"] == "not_run"
    clauses = {c["id"]: c for c in bad["clauses"]}
    assert clauses["C-05"]["tolerated"] == {"OMNI-OUT-001": 2}
    junit = ET.fromstring(render_junit(bad))
    suite = junit.find("testsuite")
    assert suite is not None and suite.get("failures") == "1"
    paths = write_report(bad, tmp_path)
    assert "❌" in paths["markdown"].read_text()
    import jsonschema

    broken = json.loads(paths["json"].read_text())
    broken["invariants"][0]["status"] = "maybe"
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)
    assert main(["report", str(paths["json"]), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "compat-report.junit.xml").exists()


# ---- environment -------------------------------------------------------------------------


@pytest.mark.parametrize("problem", ["missing", "0.27.1", "0.34.0"])
def test_wrong_environment_is_one_clear_line(monkeypatch, capsys, problem):
    from importlib import metadata

    real = metadata.version

    def fake(name):
        if name != "vllm":
            return real(name)
        if problem == "missing":
            raise metadata.PackageNotFoundError(name)
        return problem

    monkeypatch.setattr(metadata, "version", fake)
    monkeypatch.delenv(vllm_compat.ALLOW_UNTESTED_ENV, raising=False)
    assert main(["check"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    if problem == "missing":
        assert "not installed" in err
    else:
        # Names the installed release and every supported one, and how to run it anyway.
        assert problem in err and "--allow-untested-vllm" in err
        assert all(v in err for v in vllm_compat.SUPPORTED_VLLM)


def test_supported_releases_and_keyed_differences():
    from conformance._core.vllm_compat.versions import ByRelease, Change, supported_minor

    assert vllm_compat.SUPPORTED_VLLM == (
        "0.26.0",
        "0.28.0",
        "0.29.0",
        "0.30.0",
        "0.31.0",
        "0.32.0",
        "0.33.0",
    )
    assert supported_minor("0.30.1") and supported_minor("0.33.0+cpu")
    assert not supported_minor("0.27.9") and not supported_minor("0.34.0")
    queues = vllm_compat.ADMISSION_QUEUES
    assert [n for n, _ in queues.at("0.30.0")] == ["skipped_waiting"]
    assert [n for n, _ in queues.at("0.31.0")] == ["kv_holding_waiting", "deferred_waiting"]
    assert queues.at("0.99.0") == queues.at("0.33.0")  # an untested newer release: newest entry
    from conformance._core.vllm_compat.stale_output import STALE_FIELDS

    assert STALE_FIELDS.at("0.26.0") == ("async_tokens_to_discard",)
    assert STALE_FIELDS.at("0.28.0") == ("num_stale_output_tokens", "drop_stale_output")
    table = ByRelease("x", 1, [Change("0.32.0", 3, "c"), Change("0.29.0", 2, "b")])
    assert [table.at(v) for v in ("0.28.0", "0.29.0", "0.31.5", "0.33.0")] == [1, 2, 2, 3]
    assert table.describe() == ["x: 0.29.0: b", "x: 0.32.0: c"]


def test_untested_vllm_opt_in_marks_the_environment(monkeypatch):
    from importlib import metadata

    from conformance._core.vllm_compat import versions

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda n: "0.34.0" if n == "vllm" else real(n))
    monkeypatch.delenv(versions.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(versions.EnvironmentProblem):
        versions.check_vllm()
    assert versions.check_vllm(allow_untested=True) == "0.34.0"
    monkeypatch.setenv(versions.ALLOW_UNTESTED_ENV, "1")
    assert versions.check_vllm() == "0.34.0"
    assert versions.environment_versions()["vllm_support"] == "untested"


def test_unknown_subject_is_one_clear_line(capsys):
    assert main(["check", "--subject", "does-not-exist"]) == 2
    assert "unknown subject" in capsys.readouterr().err


def test_paired_fixtures(paired_schedulers, paired_drivers):
    up, sub = paired_schedulers(TIGHT)
    assert type(up).__name__ == "Scheduler" and type(sub).__name__ == "OmniARScheduler"
    d_up, d_sub = paired_drivers(TIGHT.with_(async_scheduling=True))
    assert d_up.mode == d_sub.mode == "async"
    assert type(d_sub.scheduler).__name__ == "OmniARAsyncScheduler"


def test_report_marks_an_untested_vllm():
    from conformance._core.report import render_markdown

    env = {"python": "3.11", "vllm": "0.34.0", "torch": "2.14.0", "vllm_support": "untested"}
    b = ReportBuilder(subject="upstream", profile="ci", seed=0, environment=env)
    b.add(TestRecord("t::a", "passed", clauses=["C-01"], examples=1, steps_compared=3))
    report = b.build()
    validate(report)
    assert "untested vLLM" in render_markdown(report)
    supported = b.build() | {"environment": {**env, "vllm_support": "supported"}}
    assert "untested vLLM" not in render_markdown(supported)
