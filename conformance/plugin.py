"""The pytest plugin (entry point ``pytest11: omni_conformance``): the ``invariants`` and
``clauses(...)`` markers, the ``--conformance-*`` options behind ``omni-conformance check``'s
options of the same last word, the hypothesis profiles (``ci``, ``dev``, ``thorough``), the
fixtures a property uses (``conformance_subject``, ``conformance``, ``paired_schedulers``,
``paired_drivers``), and the run's ``ConformanceSession``, which collects each test's result
(from xdist workers through ``user_properties``) and writes the upstream-compat report on the
controller. A skipped test is recorded as *not applicable* with its reason. Options, profiles and
the report's fields: docs/adopting-the-gate.md and docs/design.md.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, Phase, settings

from conformance._core import hypothesis_compat

if TYPE_CHECKING:  # the plugin loads in every pytest run here: keep vLLM and torch out of it
    from vllm.v1.core.sched.scheduler import Scheduler

    from conformance._core.compare import FieldDifference
    from conformance._core.config import HarnessConfig
    from conformance._core.driver import AsyncDriver, SyncDriver
    from conformance._core.lockstep import Lockstep
    from conformance._core.subjects import Subject

# User-facing defaults of the options (the same variables ``omni-conformance check`` reads).
PROFILE_ENV = "OMNI_CONFORMANCE_PROFILE"
SUBJECT_ENV = "OMNI_CONFORMANCE_SUBJECT"
FAILURES_ENV = "OMNI_CONFORMANCE_FAILURES"
# A sharded run (``check --ray``) sets these in each shard's pytest: the seed of the shard's
# hypothesis search and the folder of the example database the shard reads and writes.
SHARD_SEED_ENV = "OMNI_CONFORMANCE_SHARD_SEED"
EXAMPLE_DB_ENV = "OMNI_CONFORMANCE_EXAMPLE_DB"
DEFAULT_SUBJECT = "omni"
DEFAULT_PROFILE = "ci"
DEFAULT_FAILURES_DIR = "conformance-failures"
PROFILES = ("ci", "dev", "thorough", "smoke", "deep")
SESSION_PLUGIN = "omni_conformance_session"
_PROP = "omni_conformance"
_CLAUSES_PROP = "omni_conformance_clauses"
_CAUSE_PROP = "omni_conformance_cause"

CI_EXAMPLES = 20
_COMMON: dict[str, Any] = {
    "deadline": None,
    "print_blob": True,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}
# ci: no hypothesis shrink phase. Shrinking a 50-step program can take minutes against a broken
# subject; the harness's own bounded shrinker (``conformance._core.lockstep.Shrinker``, 60 s by default)
# shrinks the saved trace instead — under every profile, once per failing test, after hypothesis
# has settled on its example. No example database either: replaying examples a developer's
# earlier runs saved would change what a derandomized run executes, and the gate must compare the
# same steps on every machine.
settings.register_profile(
    "ci",
    max_examples=CI_EXAMPLES,
    derandomize=True,
    database=None,
    stateful_step_count=50,
    phases=(Phase.explicit, Phase.generate),
    **_COMMON,
)
settings.register_profile("dev", max_examples=CI_EXAMPLES, stateful_step_count=50, **_COMMON)
# smoke: ci with a fifth of its examples, for checking the gate's own plumbing (a subject loads,
# the report says what ran) where the depth of the search is not the point.
settings.register_profile(
    "smoke",
    max_examples=CI_EXAMPLES // 5,
    derandomize=True,
    database=None,
    stateful_step_count=50,
    phases=(Phase.explicit, Phase.generate),
    **_COMMON,
)
settings.register_profile(
    "thorough", max_examples=CI_EXAMPLES * 10, stateful_step_count=100, **_COMMON
)
DEEP_EXAMPLES = CI_EXAMPLES * 10
# The pull-request sized profiles: a test crossed with the subject's features is spread over them
# instead (each cell runs under one feature, the features taking turns), which keeps `check`
# within its few minutes as axes are added; the deeper profiles keep the whole cross.
SPREAD_PROFILES = frozenset({"ci", "smoke"})


# deep: the nightly search, one seed per shard of ``check --ray`` (each test runs under several
# seeds, ``--seeds-per-test``). Each shard is thorough's depth, randomized by its seed, and
# replays what the shard's example database holds first; no hypothesis shrink phase (the
# harness's bounded shrinker shrinks the saved trace where the shard ran, as under ci).
settings.register_profile(
    "deep",
    max_examples=DEEP_EXAMPLES,
    derandomize=False,
    database=None,
    stateful_step_count=100,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    **_COMMON,
)


def suite_database() -> Any:
    """The database a property of the suite uses: a shard's (``$OMNI_CONFORMANCE_EXAMPLE_DB``,
    set by ``check --ray`` for a seeded shard), else none."""
    current = settings.default
    return current.database if current is not None and os.environ.get(EXAMPLE_DB_ENV) else None


def example_db_key(nodeid: str) -> str:
    """A test's folder in a sharded run's example database: one per test, so tests whose state
    machines hypothesis keys alike (machines built by one factory) never replay each other's."""
    import hashlib

    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid)[-80:]
    return f"{slug}-{hashlib.sha256(nodeid.encode()).hexdigest()[:12]}"


def _load_shard_settings(profile: str, nodeid: str | None = None) -> None:
    """A seeded shard of ``check --ray``: its seed drives the search (set once, at configure),
    and each test's own folder of the shard's example database (under
    ``$OMNI_CONFORMANCE_EXAMPLE_DB``) replaces the profile's database while it runs."""
    if _shard_seed() is None:
        return
    if nodeid is None:
        hypothesis_compat.seed_search(int(_shard_seed() or 0))
        return
    folder = os.environ.get(EXAMPLE_DB_ENV)
    if folder and not settings.get_profile(profile).derandomize:
        from hypothesis.database import DirectoryBasedExampleDatabase

        name = f"{profile}-shard"
        db = DirectoryBasedExampleDatabase(os.path.join(folder, example_db_key(nodeid)))
        settings.register_profile(name, parent=settings.get_profile(profile), database=db)
        settings.load_profile(name)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.config.getoption("hypothesis_profile", None) is None:
        _load_shard_settings(profile_name(item.config), item.nodeid)


def _shard_seed() -> int | None:
    value = os.environ.get(SHARD_SEED_ENV, "")
    return int(value) if value.strip() else None


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("omni-conformance", "differential conformance against upstream vLLM")
    subject = os.environ.get(SUBJECT_ENV) or DEFAULT_SUBJECT
    group.addoption(
        "--conformance-subject",
        default=subject,
        metavar="NAME",
        help="subject runtime to check: a registered name (omni, upstream, entry points) or "
        f"module:attr (default: {subject}; from ${SUBJECT_ENV}, else {DEFAULT_SUBJECT})",
    )
    group.addoption(
        "--conformance-report-dir",
        default=None,
        metavar="DIR",
        help="write the upstream-compat report (JSON, Markdown, JUnit XML) into DIR "
        "(default: no report)",
    )
    failures = os.environ.get(FAILURES_ENV) or DEFAULT_FAILURES_DIR
    group.addoption(
        "--conformance-failures-dir",
        default=failures,
        metavar="DIR",
        help="folder for shrunk failure traces that omni-conformance replay re-runs "
        f"(default: {failures}; from ${FAILURES_ENV}, else ./{DEFAULT_FAILURES_DIR})",
    )
    group.addoption(
        "--conformance-oracle",
        default="auto",
        choices=("auto", "process"),
        help="where upstream vLLM runs: auto (in this process, or in its own process when "
        "loading the subject patched vLLM) or process (always its own process) (default: auto)",
    )
    profile = os.environ.get(PROFILE_ENV) or DEFAULT_PROFILE
    group.addoption(
        "--conformance-profile",
        default=profile,
        choices=PROFILES,
        help="hypothesis profile: ci (derandomized, bounded), dev, thorough (10x ci "
        "examples), smoke (a fifth of ci's, for the gate's plumbing) or deep (thorough's depth "
        "per seed, for check --ray's nightly search); --hypothesis-profile wins when given (default: {profile}; from "
        f"${PROFILE_ENV}, else {DEFAULT_PROFILE})",
    )


def profile_name(config: pytest.Config) -> str:
    """The hypothesis profile the run loads (an explicit ``--hypothesis-profile`` wins)."""
    explicit = config.getoption("hypothesis_profile", None)
    return str(explicit or config.getoption("conformance_profile", None) or DEFAULT_PROFILE)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "invariants: the property-based invariant suite (the CI gate)"
    )
    config.addinivalue_line(
        "markers",
        "clauses(*ids): contract clauses (C-xx, defined in conformance/_core/clauses.py) a test "
        "covers, for the compat report",
    )
    if config.getoption("hypothesis_profile", None) is None:
        settings.load_profile(profile_name(config))
        _load_shard_settings(profile_name(config))
    # Before any test draws: the same profile must generate the same examples however the
    # suite is run (see ``freeze_local_constants``).
    hypothesis_compat.freeze_local_constants()
    if not config.pluginmanager.has_plugin(SESSION_PLUGIN):
        config.pluginmanager.register(ConformanceSession(config), SESSION_PLUGIN)


def pytest_unconfigure(config: pytest.Config) -> None:
    session = config.pluginmanager.get_plugin(SESSION_PLUGIN)
    if session is not None:
        config.pluginmanager.unregister(session, SESSION_PLUGIN)


def conformance_session(config: pytest.Config) -> ConformanceSession:
    """This run's ``ConformanceSession`` (registered by ``pytest_configure``)."""
    session = config.pluginmanager.get_plugin(SESSION_PLUGIN)
    assert isinstance(session, ConformanceSession), "the omni-conformance plugin is not configured"
    return session


# ---- per-test recording -------------------------------------------------------------------


class ConformanceRecorder:
    """What one test compared: sessions it ran, examples, and the failure it found."""

    def __init__(
        self,
        subject_spec: str,
        subject: Subject,
        *,
        profile: str | None = None,
        test: str | None = None,
        failures_dir: str | None = None,
    ) -> None:
        self.subject_spec = subject_spec
        self.subject = subject
        self.profile = profile
        self.test = test
        # Where failure traces go (``--conformance-failures-dir``); None: ``failures_dir()``.
        self.failures_dir = failures_dir
        self._pending: tuple[Lockstep, str] | None = None
        self.sessions: list[Lockstep] = []
        self.examples = 0
        self.steps_compared = 0
        self.tolerated: dict[str, int] = {}
        self.exercised: dict[str, int] = {}
        self.first_difference: dict[str, Any] | None = None
        self.trace: str | None = None
        # A difference in a section the run set aside after it first differed (statistics), as
        # {"first_difference", "trace"}: reported beside the failure, or as it.
        self.set_aside: dict[str, Any] | None = None

    def lockstep(self, config: HarnessConfig | None = None, **kw: Any) -> Lockstep:
        from conformance._core.config import HarnessConfig
        from conformance._core.lockstep import Lockstep

        session = Lockstep(config or HarnessConfig(), self.subject, **kw)
        self.sessions.append(session)
        self.examples += 1
        return session

    def _fold(self) -> None:
        for s in self.sessions:
            self.steps_compared += s.steps_compared
            for k, v in s.tolerated.items():
                self.tolerated[k] = self.tolerated.get(k, 0) + v
            for k, v in s.stats.items():
                self.exercised[k] = self.exercised.get(k, 0) + v
        self.sessions = []

    def fail(self, session: Lockstep, name: str) -> None:
        """Save the failing trace and raise the first difference as the test failure.

        The trace is written as found, right away; the harness's bounded shrinker then runs once,
        when the test ends (``finish``), on the last failure recorded — under a profile with a
        shrink phase that is the example hypothesis shrank to, so every profile saves a shrunk
        trace and no failing example hypothesis tries on its way is shrunk twice.
        """
        from conformance._core.lockstep import SubjectBroken

        diff = self._record(session, name, do_shrink=False)
        self._pending = (session, name)
        raise SubjectBroken(diff)

    def finish(self) -> None:
        """Shrink the last recorded failure (bounded; see ``conformance._core.lockstep.Shrinker``)."""
        if self._pending is None:
            return
        session, name = self._pending
        self._pending = None
        self._record(session, name, do_shrink=True)

    def _record(self, session: Lockstep, name: str, *, do_shrink: bool) -> FieldDifference:
        from conformance._core.replay import record_failure

        path, diff = record_failure(
            session,
            subject_spec=self.subject_spec,
            name=name,
            registry=session.registry,
            folder=self.failures_dir,
            do_shrink=do_shrink,
            profile=self.profile,
            test=self.test,
        )
        self.first_difference = diff.to_dict()
        self.trace = str(path)
        return diff

    def check(self, session: Lockstep, name: str) -> None:
        if session.failure is not None:
            self.fail(session, name)

    def properties(self) -> dict[str, Any]:
        from conformance._core.pristine import oracle_placement

        self._fold()
        return {
            "oracle": oracle_placement().report_value(),
            "examples": self.examples,
            "steps_compared": self.steps_compared,
            "tolerated": dict(self.tolerated),
            "exercised": dict(self.exercised),
            "first_difference": self.first_difference,
            "trace": self.trace,
            "set_aside": self.set_aside,
        }


class SubjectLoadError(Exception):
    """The subject named by ``--conformance-subject`` cannot be loaded (unknown name, import
    error, a factory that raised). Raised by the ``conformance_subject`` fixture; the report
    records every test it stops as an error with this one-line message."""

    def __init__(self, spec: str, cause: BaseException) -> None:
        detail = " ".join(str(cause).split()) or "no message"
        super().__init__(f"cannot load subject {spec!r}: {type(cause).__name__}: {detail}")
        self.spec = spec


@pytest.fixture(scope="session")
def conformance_subject_spec(request: pytest.FixtureRequest) -> str:
    return str(request.config.getoption("conformance_subject"))


@pytest.fixture(scope="session")
def conformance_subject(request: pytest.FixtureRequest, conformance_subject_spec: str) -> Subject:
    """The subject, loaded under the pristine guard (one that patches vLLM loads, and the oracle
    then runs in its own process); one that cannot be loaded raises ``SubjectLoadError``."""
    from conformance._core.pristine import isolate_oracle
    from conformance._core.subjects import load_subject

    if request.config.getoption("conformance_oracle") == "process":
        isolate_oracle("requested by --conformance-oracle process")
    try:
        return load_subject(conformance_subject_spec)
    except (LookupError, ImportError, AttributeError, TypeError, SyntaxError) as exc:
        raise SubjectLoadError(conformance_subject_spec, exc) from exc


@pytest.fixture
def conformance(
    request: pytest.FixtureRequest, conformance_subject_spec: str, conformance_subject: Subject
) -> Iterator[ConformanceRecorder]:
    rec = ConformanceRecorder(
        conformance_subject_spec,
        conformance_subject,
        profile=profile_name(request.config),
        test=request.node.nodeid,
        failures_dir=str(request.config.getoption("conformance_failures_dir")),
    )
    try:
        yield rec
    finally:
        try:
            rec.finish()
        finally:
            request.node.user_properties.append((_PROP, rec.properties()))


@pytest.fixture
def paired_schedulers(
    conformance_subject: Subject,
) -> Callable[..., tuple[Scheduler, Scheduler]]:
    """``make(cfg) -> (upstream scheduler, subject scheduler)``, built from the same config."""
    from conformance._core.subjects import UpstreamSubject

    def make(cfg: HarnessConfig | None = None) -> tuple[Scheduler, Scheduler]:
        from conformance._core.config import HarnessConfig

        cfg = cfg or HarnessConfig()
        return UpstreamSubject().build_scheduler(cfg), conformance_subject.build_scheduler(cfg)

    return make


@pytest.fixture
def paired_drivers(
    paired_schedulers: Callable[..., tuple[Scheduler, Scheduler]],
) -> Callable[..., tuple[SyncDriver | AsyncDriver, SyncDriver | AsyncDriver]]:
    """``make(cfg) -> (upstream driver, subject driver)``, each with its own token source."""
    from conformance._core.driver import make_driver
    from conformance._core.tokens import DeterministicTokenSource

    def make(
        cfg: HarnessConfig | None = None,
    ) -> tuple[SyncDriver | AsyncDriver, SyncDriver | AsyncDriver]:
        up, sub = paired_schedulers(cfg)
        return (
            make_driver(up, DeterministicTokenSource()),
            make_driver(sub, DeterministicTokenSource()),
        )

    return make


# ---- collecting results -------------------------------------------------------------------


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from conformance._core.clauses import unknown

    problems: list[str] = []
    for item in items:
        ids: list[str] = []
        for mark in item.iter_markers("clauses"):
            ids.extend(str(a) for a in mark.args)
        if bad := unknown(ids):
            problems.append(f"{item.nodeid}: {', '.join(bad)}")
        if ids or item.get_closest_marker("invariants") is not None:
            item.user_properties.append((_CLAUSES_PROP, sorted(set(ids))))
    if problems:
        shown = "\n  ".join(problems[:20]) + ("\n  ..." if len(problems) > 20 else "")
        raise pytest.UsageError(
            "clauses(...) markers name clause ids that conformance/_core/clauses.py does not define "
            f"(see docs/contracts.md):\n  {shown}"
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failure the harness raised is recognised here, by its type, where the exception still
    exists (on the xdist worker); its one-line cause travels in ``user_properties``."""
    report: pytest.TestReport = yield
    excinfo = call.excinfo
    if excinfo is None or not report.failed:
        return report
    error = excinfo.value
    # Only a run that imported the harness can have raised its difference: no vLLM import here.
    lockstep = sys.modules.get("conformance._core.lockstep")
    if isinstance(error, SubjectLoadError):
        report.user_properties.append((_CAUSE_PROP, str(error)))
    elif lockstep is not None and isinstance(error, lockstep.SubjectBroken):
        report.user_properties.append((_CAUSE_PROP, error.difference.headline()))
    return report


# Lines hypothesis adds to a failure that say nothing about its cause.
_BOILERPLATE = (
    "Falsifying example",
    "Falsifying explicit example",
    "You can reproduce",
    "You can add @seed",
    "@reproduce_failure",
    "Trying example",
    "state = ",
    "state.",
    "Draw ",
    "Explanation:",
    "The test sometimes passed",
    "Unreliable test timings",
    "Hypothesis found",
    "+ Exception Group",
    "Traceback",
)


def _meaningful(lines: Iterable[str]) -> list[str]:
    out = []
    for line in lines:
        text = line.strip()
        if text and not text.startswith(_BOILERPLATE) and not text.startswith(("|", "+-")):
            out.append(text)
    return out


def _bare_type(line: str) -> bool:
    """``AssertionError`` alone: an exception type with no message."""
    return re.fullmatch(r"[A-Za-z_][\w.]*", line) is not None


def _first_line(report: pytest.TestReport, first_difference: dict[str, Any] | None = None) -> str:
    """A failure's one-line cause.

    The first difference (``step N (op) field: upstream=... subject=...``) when the harness found
    one; else the exception's type and message — never hypothesis's boilerplate ("Falsifying
    example ...") and never a bare exception type when the report holds its message.
    """
    from conformance._core.report import difference_headline

    if first_difference:
        return difference_headline(first_difference)
    crash = getattr(report.longrepr, "reprcrash", None)
    crash_msg = str(crash.message) if crash is not None else ""
    text = str(report.longrepr) if report.longrepr is not None else ""
    e_lines = _meaningful(ln[1:] for ln in text.splitlines() if ln.startswith("E "))
    for line in _meaningful(crash_msg.splitlines()) + e_lines:
        if "first difference at " in line:
            return "first difference at " + line.split("first difference at ", 1)[1][:300]
    candidates = _meaningful(crash_msg.splitlines())
    head = candidates[0] if candidates else ""
    if not head or _bare_type(head):
        more = [ln for ln in e_lines if not _bare_type(ln) and ln != head]
        if more:
            detail = more[0]
            head = f"{head}: {detail}" if head and not detail.startswith(head) else detail
    if head.startswith("assert "):  # pytest's rewritten assert: the type is AssertionError
        head = "AssertionError: " + head
    if head:
        return head[:300]
    lines = _meaningful(text.splitlines())
    return lines[-1][:300] if lines else report.outcome


def _skip_reason(report: pytest.TestReport) -> str:
    """pytest's reason for a skip (``longrepr`` is ``(file, line, "Skipped: reason")``)."""
    wasxfail = getattr(report, "wasxfail", None)
    if wasxfail is not None:
        return f"expected failure: {wasxfail}" if wasxfail else "expected failure"
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        reason = str(longrepr[2])
    else:
        reason = str(longrepr or "")
    reason = reason.removeprefix("Skipped: ").strip()
    return " ".join(reason.split()) or "skipped"


# A suite test that could not run a promised check fails with this prefix
# (``conformance._core.capabilities.CheckNotRun``); the report gives it its own outcome.
NOT_RUN_PREFIX = "not run here: "


def _not_run_reason(report: pytest.TestReport) -> str | None:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = str(crash.message) if crash is not None else str(report.longrepr or "")
    for line in text.splitlines():
        line = line.strip().removeprefix("Failed: ")
        if line.startswith(NOT_RUN_PREFIX):
            return line[len(NOT_RUN_PREFIX) :]
    return None


class ConformanceSession:
    """One pytest run's results and report: a plugin object registered with pytest's plugin
    manager (``SESSION_PLUGIN``), whose hooks record each test and, on the controller, write
    the report."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.tests: dict[str, dict[str, Any]] = {}
        self.report: dict[str, Any] | None = None
        self.paths: dict[str, Any] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        props: dict[str, Any] = dict(report.user_properties)
        if _CLAUSES_PROP not in props and report.nodeid not in self.tests:
            return
        # "pending" until the test's call reports: a run interrupted between a test's setup and
        # the end of its call must not count that test as passed.
        entry = self.tests.setdefault(
            report.nodeid,
            {"outcome": "pending", "clauses": [], "duration": 0.0, "message": None, "reason": None},
        )
        if _CLAUSES_PROP in props:
            entry["clauses"] = props[_CLAUSES_PROP]
        if _PROP in props:
            entry.update(props[_PROP])
        entry["duration"] += float(report.duration or 0.0)
        not_run = _not_run_reason(report) if report.failed and report.when == "call" else None
        if not_run is not None:
            entry["outcome"] = "not_run"
            entry["reason"] = not_run
        elif report.failed:
            entry["outcome"] = "failed" if report.when == "call" else "error"
            cause = props.get(_CAUSE_PROP)
            entry["message"] = (
                entry["message"]
                or (str(cause)[:300] if cause else None)
                or _first_line(report, entry.get("first_difference"))
            )
        elif report.skipped and report.when != "teardown" and entry["outcome"] == "pending":
            entry["outcome"] = "not_applicable"
            entry["reason"] = _skip_reason(report)
        elif report.when == "call" and entry["outcome"] == "pending":
            entry["outcome"] = "passed"
        if entry["outcome"] in ("failed", "error") and entry.get("first_difference"):
            # The recorder's properties arrive with the teardown report, after the (shrunk) trace
            # was saved: its first difference is the cause to lead with.
            from conformance._core.report import difference_headline

            entry["message"] = difference_headline(entry["first_difference"])

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        config = self.config
        if hasattr(config, "workerinput"):
            return
        out_dir = config.getoption("conformance_report_dir")
        if not out_dir:
            return
        from conformance._core.report import ReportBuilder, TestRecord, write_report
        from conformance._core.vllm_compat import environment_versions

        profile = profile_name(config)
        seed = config.getoption("hypothesis_seed", None)
        if seed is None:
            seed = _shard_seed()
        if seed is None:
            seed = 0 if settings.get_profile(profile).derandomize else "random"
        environment = environment_versions()
        environment["hypothesis_local_constants"] = (
            "off" if hypothesis_compat.local_constants_frozen() else "on"
        )
        # Where each worker ran upstream (its recorder says): separate once any did.
        placements = sorted({str(t["oracle"]) for t in self.tests.values() if t.get("oracle")})
        isolated = [p for p in placements if p != "in-process"]
        environment["oracle"] = (isolated or placements or ["in-process"])[0]
        builder = ReportBuilder(
            subject=str(config.getoption("conformance_subject")),
            profile=profile,
            seed=seed,
            environment=environment,
        )
        for nodeid, data in self.tests.items():
            if data["outcome"] == "pending":
                data = {
                    **data,
                    "outcome": "not_run",
                    "reason": "the run was interrupted before this test finished",
                }
            builder.add(TestRecord.from_dict({"nodeid": nodeid, **data}))
        self.report = builder.build()
        self.paths = write_report(self.report, out_dir)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.report is None:
            return
        from conformance._core.report import counts_line

        rep = self.report
        tr = terminalreporter
        tr.section(f"omni-conformance: subject {rep['subject']} — {rep['status'].upper()}")
        tr.write_line(counts_line(rep["summary"]))
        tr.write_line(f"{'invariant':<12} {'status':<14} {'examples':>8} {'steps':>8}  tolerated")
        for inv in rep["invariants"]:
            tol = ", ".join(f"{k}x{v}" for k, v in sorted(inv["tolerated"].items())) or "-"
            tr.write_line(
                f"{inv['id']:<12} {inv['status']:<14} {inv['examples']:>8} "
                f"{inv['steps_compared']:>8}  {tol}"
            )
        for f in rep["failures"]:
            tr.write_line(f"VIOLATION {f['test']}: {f['message']}")
        for n in rep["not_applicable"]:
            tr.write_line(f"not applicable {n['test']}: {n['reason']}")
        tr.write_line(f"report: {self.paths.get('json')}")


def covers(node: pytest.Item, clauses: set[str] | list[str]) -> None:
    """Credit ``clauses`` to the running test on top of its ``clauses`` marker: for a test whose
    checks depend on what the subject declared, the clauses it really checked."""
    props = node.user_properties
    for i, (key, value) in enumerate(props):
        if key == _CLAUSES_PROP:
            props[i] = (key, sorted({*value, *clauses}))  # type: ignore[misc]
            return
    props.append((_CLAUSES_PROP, sorted(set(clauses))))
