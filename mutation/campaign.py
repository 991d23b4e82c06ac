"""The invariant suite's mutation score: a mutmut campaign over the runtime code the suite guards.

The suite's named mutants (``tests/mutants/``) are bugs its authors thought of. This campaign
measures it against bugs nobody picked: mutmut (PyPI, 3.8) rewrites the guarded code with
mechanical mutations (flipped conditions, changed constants, dropped arguments, swapped operands,
``None`` results) and runs ``pytest -m invariants`` against each one. The campaign owns:

* what is mutated (``TARGETS``): ``omni_runtime/sched/``, ``omni_runtime/adapters/``,
  ``payload.py``, ``worker/materialize.py`` and the runner's payload-building functions;
* how the suite runs per mutant (``pytest_args``): the ``ci`` hypothesis profile, stop at the
  first failure, no trace shrinking (a kill needs no shrunk trace), and without the two static
  source audits, which read the source text and see mutmut's trampolines instead of the runtime's
  code (no mutation operator adds an import or a payload construction, so they kill nothing),
  nor the end-to-end gate run that includes them (``LEFT_OUT``);
* the re-check (``recheck``): every survivor the ledger does not mark equivalent runs again under
  the ``thorough`` profile with hypothesis's seed pinned, against only the tests that execute its
  mutated statement under that profile (the reach run, ``load_reach``: the suite once under
  coverage.py, a context per test); a kill there counts as a kill;
* the triage ledger (``mutation/triage.toml``): survivors that are equivalent, each with the
  reason no behaviour changes. An entry names the function and the mutated line pair, not
  mutmut's positional number, so it survives unrelated edits; entries that match nothing are
  reported as stale;
* the score: killed / (mutants - equivalent - not run); a mutant no test reaches counts as not
  killed, one a stopped campaign never ran is reported and not scored.

mutmut writes its copy of the project into ``mutants/`` under its working directory, so the
campaign runs in a work folder (default ``./mutation-work``) holding a copy of the repository's
files, never in the checkout itself. A whole campaign outlasts a working session and the work
folder may not survive one, so its verdicts are also kept in the checkout
(``mutation/state/<slice>/``: mutmut's per-file results and test stats, the clock, the
re-checks), small enough to commit; ``resume`` and ``report`` rebuild a missing work folder from
them. Usage::

    python mutation/campaign.py run --rev HEAD   # the whole campaign over a commit, then the report
    python mutation/campaign.py run --slice ci   # payload.py only: the CI guard's slice
    python mutation/campaign.py resume           # go on with a stopped campaign
    python mutation/campaign.py resume --rev NEW # move it to a later commit: only mutants of
                                                 # functions that changed run again
    python mutation/campaign.py report --recheck none  # where it stands, running nothing
    python mutation/campaign.py report           # the report, re-checking survivors first

``run`` exits 0 when the score meets ``--min-score`` (default: none), 1 below it, 2 on bad input.
It is a benchmark, not a test: the README's test command runs only the ``ci`` slice
(``tests/test_mutation_slice.py``).
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import dataclasses
import difflib
import fcntl
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# The campaign's sibling modules, whether it runs as a script or is loaded by path (its tests).
if str(REPO / "mutation") not in sys.path:
    sys.path.insert(0, str(REPO / "mutation"))
import infection  # noqa: E402  (after the path it is found on)

LEDGER = REPO / "mutation" / "triage.toml"
STATE = REPO / "mutation" / "state"
DEFAULT_WORK = REPO / "mutation-work"
MUTMUT_VERSION = "3.8.1"

# Tests each mutant's run leaves out. First, those that read the runtime's source text (C-10/C-11
# payload construction sites, C-21 import contracts). Under mutmut the source holds trampolines and renamed functions, which these audits
# rightly flag; they guard layout, not behaviour, and no mutation operator changes layout.
LEFT_OUT = (
    "invariants/test_ar_inv_002_adapters.py::test_only_adapters_build_payloads",
    "invariants/test_ar_inv_003_workers.py::test_import_contracts_hold",
    # The whole gate against omni-process-stage, through the command in a subprocess: the same
    # properties the module runs in process, plus the two audits above (which then fail on the
    # trampolines, so every mutant would count as killed).
    "tests/test_process_stage_subject.py::test_gate_check_passes",
)

_RUNNER = "omni_runtime.worker.runner.xǁOmniARModelRunnerǁ"


@dataclasses.dataclass(frozen=True)
class Target:
    """One row of the report: a file and, optionally, which of its mutants are run."""

    path: str  # relative to the repository
    select: tuple[str, ...] = ()  # mutmut mutant-name globs; none: every mutant of the file
    label: str = ""  # the report's name for the row; none: the path below the package

    @property
    def name(self) -> str:
        return self.label or self.path.removeprefix("omni_runtime/")

    @property
    def mutants(self) -> tuple[str, ...]:
        return self.select or (self.path.removesuffix(".py").replace("/", ".") + ".*",)


TARGETS = (
    *(
        Target(f"omni_runtime/{rel}")
        for rel in (
            "sched/scheduler.py",
            "sched/transfer.py",
            "sched/processors.py",
            "sched/process_stage.py",
            "adapters/input.py",
            "adapters/output.py",
            "adapters/shm_wire.py",
            "payload.py",
            "worker/materialize.py",
        )
    ),
    # The runner's other phases (inputs, forward, sampling, recovery) belong to the model, not to
    # the payload path the suite's contracts guard; its payload-building functions are these.
    # (``persistent_buffers`` is left out: it tells the gate which buffers C-52 may scribble on,
    # so a mutant there weakens the gate's audit and changes nothing the runtime does.)
    Target(
        "omni_runtime/worker/runner.py",
        tuple(
            f"{_RUNNER}{name}__mutmut_*"
            for name in (
                "_finish_payloads",
                "_finish",
                "_sample_output",
                "sample_tokens",
                "_producers",
                "_recheck_conditioning",
                "collect_connector_output",
            )
        ),
        label="worker/runner.py (payload parts)",
    ),
)


@dataclasses.dataclass(frozen=True)
class Slice:
    """What one campaign mutates and which tests it runs. ``expected`` pins a sample: mutant name
    -> the mutated lines it must still be (mutmut numbers mutants by position, so an edit of the
    file renumbers them; the campaign then refuses instead of measuring other mutants)."""

    targets: tuple[Target, ...]
    tests: tuple[str, ...] = ("invariants",)
    expected: tuple[tuple[str, tuple[str, ...]], ...] = ()


_TRIM = "omni_runtime.payload.xǁStagePayloadǁtrimmed_before__mutmut_"
# The CI guard: six mutants of C-45's trimming that the chunk contracts kill, two of them only
# through the completeness check the campaign led to. A suite change that lets one survive fails
# the README's test command (tests/test_mutation_slice.py).
CI_SAMPLE = (
    (
        f"{_TRIM}10",
        (
            "-drop = min(max(0, position - self.start), self.num_tokens)",
            "+drop = min(max(1, position - self.start), self.num_tokens)",
        ),
    ),
    (
        f"{_TRIM}11",
        (
            "-drop = min(max(0, position - self.start), self.num_tokens)",
            "+drop = min(max(0, position + self.start), self.num_tokens)",
        ),
    ),
    (f"{_TRIM}12", ("-if drop == 0:", "+if drop != 0:")),
    (
        f"{_TRIM}14",
        ("-hidden = None if self.hidden is None else self.hidden[drop:]", "+hidden = None"),
    ),
    (f"{_TRIM}38", ("-self.start + drop,", "+self.start - drop,")),
    (f"{_TRIM}39", ("-self.num_tokens - drop,", "+self.num_tokens + drop,")),
)

# The invariant suite runs against one subject per run (the runtime's ``omni``); the properties
# in which the stage-process code takes part also run against ``omni-process-stage`` from this
# module, which is how the campaign reaches ``sched/process_stage.py`` and the shared-memory wire.
PROCESS_STAGE_TESTS = "tests/test_process_stage_subject.py"

SLICES = {
    "full": Slice(TARGETS, tests=("invariants", PROCESS_STAGE_TESTS)),
    "ci": Slice(
        (
            Target(
                "omni_runtime/payload.py",
                tuple(n for n, _ in CI_SAMPLE),
                label="payload.py (CI sample)",
            ),
        ),
        tests=("invariants/test_chunk_contracts.py",),
        expected=CI_SAMPLE,
    ),
}

# mutmut's result codes (its ``status_by_exit_code``), folded into the report's columns.
_STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped"}
_TIMEOUT = {-24, 24, 152, 255, 36}


def status_of(code: int | None) -> str:
    if code in _STATUS:
        return _STATUS[code]
    if code in _TIMEOUT:
        return "timeout"  # a mutant that hangs the suite is caught: mutmut counts it killed too
    return "not run" if code is None else "suspicious"


class CampaignError(Exception):
    """Bad input or a broken work folder: one line for the user."""


# ---- the work folder --------------------------------------------------------------------------


def pytest_args(profile: str) -> list[str]:
    args = [
        "-m",
        "invariants",
        "-p",
        "no:cacheprovider",
        "-x",
        "-q",
        "--conformance-profile",
        profile,
    ]
    for test in LEFT_OUT:
        args += ["--deselect", test]
    return args


def mutmut_config(targets: Sequence[Target], profile: str, tests: Sequence[str]) -> str:
    def toml_list(items: Iterable[str]) -> str:
        return "[" + ", ".join(json.dumps(i) for i in items) + "]"

    return "\n".join(
        [
            "",
            "[tool.mutmut]",
            'source_paths = ["omni_runtime"]',
            'also_copy = ["conformance", "invariants"]',
            f"only_mutate = {toml_list(sorted({t.path for t in targets}))}",
            f"pytest_add_cli_args_test_selection = {toml_list(tests)}",
            f"pytest_add_cli_args = {toml_list(pytest_args(profile))}",
            # torch is not fork-safe once used: fork each mutant from a server that only imported.
            'process_isolation = "forkserver"',
            'forkserver_warmup = "import"',
            # mutmut's timeout is wall-clock: (tests' time + constant) x multiplier x 2. On a loaded
            # 2-core machine the default constant (1 s) times out healthy runs; timeouts are
            # re-checked anyway (``recheck``).
            "timeout_constant = 5.0",
            'preload_modules_file = "warmup-modules.txt"',
            "",
        ]
    )


def repository_files() -> list[str]:
    """Tracked and untracked-but-not-ignored files: the campaign measures the working tree."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout.decode()
    return [f for f in out.split("\0") if f and (REPO / f).is_file()]


# What mutmut's fork server imports before it forks a worker per mutant. Without it every worker
# pays, in its first test, for what one process pays once: vLLM resolving the model class of the
# harness's config (a subprocess unless its on-disk cache is warm) and importing the suite.
WARMUP_MODULE = "campaign_warmup"
WARMUP_SOURCE = '''"""Generated by mutation/campaign.py: warms mutmut's fork server (see WARMUP_MODULE)."""
import os
import pathlib

import pytest

from conformance._core.config import HarnessConfig, build_vllm_config



def warm(tests: list[str]) -> None:
    build_vllm_config(HarnessConfig())
    cwd = os.getcwd()
    os.chdir(pathlib.Path(__file__).parent)  # where mutmut runs the tests
    try:
        pytest.main(["--rootdir=.", "--collect-only", "-qqq", "-p", "no:cacheprovider", *tests])
    finally:
        os.chdir(cwd)
'''


def copy_repository(work: Path, rev: str | None) -> None:
    """The working tree's files (tracked and not ignored), or those of commit ``rev``."""
    work.mkdir(parents=True)
    if rev is not None:
        archive = subprocess.run(
            ["git", "archive", "--format=tar", rev], cwd=REPO, capture_output=True
        )
        if archive.returncode != 0:
            raise CampaignError(f"--rev {rev}: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", str(work)], input=archive.stdout, check=True)
        return
    for rel in repository_files():
        dest = work / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dest)


def prepare(work: Path, chosen: Slice, profile: str, rev: str | None = None) -> None:
    """A fresh copy of the repository in ``work`` with the campaign's mutmut configuration."""
    where = work.resolve()
    # Inside the checkout only as ./mutation-work, which git ignores: any other folder there would
    # be copied into the next campaign's copy of the repository.
    if where == REPO or where in REPO.parents or (REPO in where.parents and where != DEFAULT_WORK):
        raise CampaignError(
            f"--work {work}: use a folder outside the repository or ./mutation-work"
        )
    if work.exists():
        shutil.rmtree(work)
    copy_repository(work, rev)
    with (work / "pyproject.toml").open("a") as f:
        f.write(mutmut_config(chosen.targets, profile, chosen.tests))
    (work / "mutants").mkdir()
    (work / "mutants" / f"{WARMUP_MODULE}.py").write_text(
        WARMUP_SOURCE + f"\n\nwarm({list(chosen.tests)!r})\n"
    )
    (work / "warmup-modules.txt").write_text(WARMUP_MODULE + "\n")


def git_head() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True)
    return out.stdout.decode().strip() or "?"


def campaign_env(work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        PYTHONHASHSEED="0",
        # A kill needs no shrunk trace; shrinking costs up to a minute per killed mutant.
        OMNI_CONFORMANCE_SHRINK_SECONDS="0",
        OMNI_CONFORMANCE_FAILURES=str(work / "failures"),
    )
    return env


def run_mutmut(
    work: Path,
    targets: Sequence[Target],
    children: int,
    names: Sequence[str] | None = None,
    profile: str | None = None,
) -> None:
    """mutmut over the targets' mutants, or over exactly ``names``; under ``profile`` instead of
    the campaign's when given."""
    wanted = list(names) if names is not None else [g for t in targets for g in t.mutants]
    cmd = [sys.executable, "-m", "mutmut", "run", "--max-children", str(children), *wanted]
    env = campaign_env(work)
    if profile is not None:
        # Not through mutmut's configuration: a change to its pytest arguments resets every
        # verdict. hypothesis's own option wins over the suite's ``--conformance-profile``.
        env["PYTEST_ADDOPTS"] = f"--hypothesis-profile {profile}"
    log = work / "mutmut.log"
    with log.open("ab" if names is not None else "wb") as out:
        proc = subprocess.run(cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = log.read_bytes()[-1500:].decode(errors="replace").replace("\r", "\n")
        raise CampaignError(f"mutmut exited {proc.returncode}; the end of {log}:\n{tail}")


def timed_mutmut(
    work: Path,
    chosen: Slice,
    children: int,
    meta: dict[str, object],
    meta_path: Path,
    state: Path | None = None,
) -> None:
    """Run (or go on with) mutmut, keeping ``meta["seconds"]`` current in ``meta_path``.

    A campaign outlasts a working session on 2 cores. mutmut keeps every verdict it reached in
    ``mutants/*.meta`` and runs only the mutants without one, so ``resume`` picks a stopped
    campaign up where it stopped; the clock is written every half minute, so the time the
    campaign took survives the stop as well (to within that)."""
    base = float(meta.get("seconds", 0.0))  # type: ignore[arg-type]
    started = time.monotonic()
    done = threading.Event()

    def write(complete: bool) -> None:
        meta["seconds"] = base + time.monotonic() - started
        meta["complete"] = complete
        meta_path.write_text(json.dumps(meta, indent=1))
        if state is not None:
            save_state(work, chosen, state)

    def heartbeat() -> None:
        while not done.wait(30.0):
            write(False)

    names = None
    if meta["seconds"]:
        # mutmut re-runs every mutant named on its command line, verdict or not: name only the
        # ones still without one (named by glob, the whole campaign would start over).
        try:
            names = [m.name for m in load_results(work, chosen.targets) if m.status == "not run"]
        except CampaignError:
            names = None  # stopped before mutmut had generated every mutant: run them all
        if names == []:
            write(True)
            return
    write(False)
    beat = threading.Thread(target=heartbeat, name="campaign-clock", daemon=True)
    beat.start()
    try:
        run_mutmut(work, chosen.targets, children, names)
    finally:
        done.set()
        beat.join()
    write(True)


def rerun(
    work: Path,
    chosen: Slice,
    meta: dict[str, object],
    meta_path: Path,
    children: int,
    only: str | None,
    profile: str,
) -> None:
    """Run every mutant not killed (and not in the ledger) again through mutmut, against the
    checkout's suite: mutmut forks each from a server that imported everything once, and runs
    its covering tests quickest first, several times faster than a re-check's fresh pytest per
    mutant. mutmut's first run on clean code guards the refreshed suite (a suite that fails
    there stops it). Its verdicts replace the earlier ones; the clock goes into
    ``meta["rerun_seconds"]``. ``profile``: the hypothesis profile (a survivor of the campaign's
    quick profile gets its second look under a stronger one)."""
    refresh_suite(work)
    meta["suite_refreshed_from"] = git_head()
    mutants = load_results(work, chosen.targets)
    wanted = [m for m in mutants if m.status in RECHECKED]
    changes = mutant_changes(work, [m.name for m in wanted])
    for m in wanted:
        m.change = changes.get(m.name, ())
    apply_ledger(mutants, load_ledger())
    decided = recheck_kills(work)  # a mutant a re-check killed needs no second verdict
    names = [
        m.name
        for m in wanted
        if not m.equivalent
        and m.key not in decided
        and (only is None or any(fnmatch.fnmatch(m.name, g) for g in only.split(",")))
    ]
    if not names:
        return
    started = time.monotonic()
    try:
        run_mutmut(work, chosen.targets, children, names, profile)
        meta["rerun_profile"] = profile
    finally:
        meta["rerun_seconds"] = float(meta.get("rerun_seconds", 0.0)) + time.monotonic() - started  # type: ignore[arg-type]
        meta_path.write_text(json.dumps(meta, indent=1))
        save_state(work, chosen, STATE)


# ---- the campaign's state in the checkout ------------------------------------------------------

# mutmut's own files that carry verdicts: per mutated file, the exit code of every mutant (keyed by
# name, with the hash of each function: mutmut keeps a verdict only while its function is
# unchanged); and which tests cover which function, with the tests' durations.
_STATS = "mutmut-stats.json"


def state_dir(root: Path, chosen: Slice) -> Path:
    name = next(k for k, v in SLICES.items() if v is chosen)
    return root / name


def update_json(path: Path, change: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Replace the JSON object in ``path`` (``{}`` when there is none) by ``change`` of it,
    under a lock beside the file and atomically: the campaign's state files are written by
    re-checks running side by side, and read by ``git add`` at any moment."""
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        new = change(json.loads(path.read_text()) if path.is_file() else {})
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(new, indent=1, sort_keys=True))
        tmp.replace(path)


def merge_verdicts(src: Path, dest: Path) -> None:
    """Bring the re-check verdicts kept in ``src`` into ``dest`` (both ``recheck-*.json``
    caches): ``src`` decides, but a kill either holds stands. Two work folders may keep one
    campaign's state side by side (a long ``thorough`` re-check in one, targeted re-checks in
    another); a plain copy from either would drop the other's kills."""
    theirs = json.loads(src.read_text())

    def merged(ours: dict[str, Any]) -> dict[str, Any]:
        kills = {k: v for k, v in ours.items() if v in ("killed", "timeout")}
        return {**ours, **theirs, **kills}

    update_json(dest, merged)


def merge_command(other: Path | None, root: Path, work: Path, chosen: Slice) -> int:
    """``merge --from STATE``: take in the re-check verdicts another state folder of this
    campaign kept, into this one (and into the work folder, when there is one). A targeted
    re-check against a refreshed suite runs in a work folder and state folder of its own
    (``--work``, ``--state``), because refreshing changes the campaign's record of its suite,
    which a long re-check in the main work folder still relies on; its kills come back here."""
    if other is None:
        print("mutation campaign: merge needs --from STATE", file=sys.stderr)
        return 2
    caches = sorted(state_dir(other, chosen).glob("recheck-*.json"))
    if not caches:
        print(f"mutation campaign: {state_dir(other, chosen)} keeps no verdicts", file=sys.stderr)
        return 2
    dests = [state_dir(root, chosen)] + ([work] if (work / "campaign.json").is_file() else [])
    for cache in caches:
        for dest in dests:
            dest.mkdir(parents=True, exist_ok=True)
            merge_verdicts(cache, dest / cache.name)
    print(f"merged {len(caches)} re-check caches from {other} into {', '.join(map(str, dests))}")
    return 0


def save_state(work: Path, chosen: Slice, root: Path) -> None:
    """Copy the campaign's verdicts from the work folder into ``<root>/<slice>/`` (re-check
    verdicts merged, ``merge_verdicts``)."""
    dest = state_dir(root, chosen)
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(work.glob("recheck-*.json")):
        merge_verdicts(f, dest / f.name)
    files = [(work / "campaign.json", dest / "campaign.json")]
    files += [(f, dest / f.name) for f in sorted(work.glob("reach-*.json"))]
    files += [(f, dest / f.name) for f in sorted(work.glob("parts-*.json"))]
    files += [(f, dest / f.name) for f in sorted(work.glob("infection-*.json"))]
    files.append((work / "mutants" / _STATS, dest / _STATS))
    files += [
        (work / "mutants" / f"{t.path}.meta", dest / "meta" / f"{t.path}.meta")
        for t in chosen.targets
    ]
    for src, to in files:
        if src.is_file():
            to.parent.mkdir(parents=True, exist_ok=True)
            tmp = to.with_name(to.name + ".tmp")
            shutil.copyfile(src, tmp)
            tmp.replace(to)  # a reader (git add) never sees half a file


# Generates the mutants (mutmut's first phase, without its test runs) in the work folder, so a
# restored campaign's results, report diffs and ``resume`` see the same mutants a run would.
_GENERATE = """
import os
from mutmut.__main__ import create_mutants, store_lines_covered_by_tests
from mutmut.mutation.trampoline import set_mutant_under_test
from mutmut.utils.file_utils import copy_also_copy_files, copy_src_dir, setup_source_paths
set_mutant_under_test("mutant_generation")
os.makedirs("mutants", exist_ok=True)
copy_src_dir()
copy_also_copy_files()
setup_source_paths()
store_lines_covered_by_tests()
create_mutants(2)
"""


def commit_of(meta: dict[str, object]) -> str | None:
    """The commit a campaign mutated, when it mutated one (not a working tree)."""
    rev = str(meta.get("commit") or meta.get("rev") or "")
    return rev if len(rev) == 40 and all(c in "0123456789abcdef" for c in rev) else None


def restore(work: Path, chosen: Slice, rev: str | None, root: Path) -> None:
    """Rebuild the work folder of the campaign kept in ``<root>/<slice>/``, over its own commit
    or over ``rev``. Over a later commit mutmut keeps the verdicts of functions whose source is
    unchanged; the mutants of changed functions have none and run on ``resume``."""
    src = state_dir(root, chosen)
    meta_file = src / "campaign.json"
    if not meta_file.is_file():
        raise CampaignError(f"{work}: no campaign to resume, and none kept in {src}; use 'run'")
    meta = json.loads(meta_file.read_text())
    commit = resolve(rev) if rev else commit_of(meta)
    if commit is None:
        raise CampaignError(
            f"{src}: the kept campaign mutated a working tree ({meta.get('rev')}), which cannot "
            "be rebuilt; pass --rev to move it to a commit"
        )
    profile = str(meta.get("profile", "ci"))
    prepare(work, chosen, profile, commit)
    kept = ("recheck", "reach", "parts", "infection")
    for f in [g for name in kept for g in src.glob(f"{name}-*.json")]:
        shutil.copyfile(f, work / f.name)
    if (src / _STATS).is_file():
        shutil.copyfile(src / _STATS, work / "mutants" / _STATS)
    for f in (src / "meta").rglob("*.meta"):
        to = work / "mutants" / f.relative_to(src / "meta")
        to.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, to)
    proc = subprocess.run(
        [sys.executable, "-c", _GENERATE], cwd=work, env=campaign_env(work), capture_output=True
    )
    if proc.returncode != 0:
        tail = proc.stderr.decode(errors="replace")[-800:]
        raise CampaignError(f"generating the mutants in {work} failed:\n{tail}")
    refreshed = meta.get("suite_refreshed_from")
    if refreshed and commit == commit_of(meta):
        # The kept verdicts and reach were decided against that suite, not the commit's own: a
        # reach measured over the commit's suite but labelled with the refresh would pair one
        # suite's lines with another's verdicts.
        refresh_suite(work, str(refreshed))
    elif refreshed:
        del meta["suite_refreshed_from"]  # moved to another commit: its own suite from now on
    if commit != commit_of(meta):
        meta.update(rev=commit, commit=commit, complete=False)
    (work / "campaign.json").write_text(json.dumps(meta, indent=1))


def resolve(rev: str) -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=REPO, capture_output=True
    )
    if out.returncode != 0:
        raise CampaignError(f"--rev {rev}: not a commit of this repository")
    return out.stdout.decode().strip()


# ---- results ----------------------------------------------------------------------------------


# Verdicts a re-check may overturn. "no tests" is mutmut's record of which tests called the
# function when the campaign began; tests added to the suite since may call it.
RECHECKED = ("survived", "timeout", "no tests")


@dataclasses.dataclass
class Mutant:
    name: str
    target: str
    status: str
    change: tuple[str, ...] = ()  # the mutated lines: "-old" / "+new", stripped
    equivalent: str | None = None  # the ledger's reason
    recheck: str | None = None  # "killed" / "survived" under the re-check profile

    @property
    def function(self) -> str:
        return self.name.rsplit("__mutmut_", 1)[0]

    @property
    def key(self) -> str:
        """The re-check caches' key: the name with the change, so an edit that makes the name
        mean another mutant does not inherit its verdict."""
        return f"{self.name} {' | '.join(self.change)}"

    @property
    def final(self) -> str:
        """The report's verdict: mutmut's, corrected by the ledger and the re-check."""
        if self.status not in RECHECKED:
            return self.status
        if self.recheck in ("killed", "timeout"):
            return "killed"  # a failing test, or a suite that hangs even with minutes to spare
        if self.status == "no tests" and self.recheck is None:
            return "no tests"  # and no test the suite gained since covers it either
        if self.recheck is None and self.status == "timeout":
            return "timeout"  # mutmut's wall-clock limit, not re-checked: no verdict yet
        return "equivalent" if self.equivalent else "survived"


def load_results(work: Path, targets: Sequence[Target]) -> list[Mutant]:
    mutants: list[Mutant] = []
    root = work / "mutants"
    for target in targets:
        meta = root / f"{target.path}.meta"
        if not meta.is_file():
            raise CampaignError(
                f"{meta}: no mutmut results for {target.name}; run the campaign first"
            )
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        for name, code in sorted(codes.items()):
            if any(fnmatch.fnmatch(name, g) for g in target.mutants):
                mutants.append(Mutant(name, target.name, status_of(code)))
    return mutants


# Prints ``mutmut show``'s diff for every mutant name read from stdin, in one process (one
# ``mutmut show`` per survivor costs an interpreter start each: minutes for a whole campaign).
_SHOW_MANY = """
import json, sys
from mutmut.mutation.diff_apply import get_diff_for_mutant
print(json.dumps({n: get_diff_for_mutant(n) for n in sys.stdin.read().split()}))
"""


def _changed_lines(diff: str) -> tuple[str, ...]:
    return tuple(
        line[0] + line[1:].strip()
        for line in diff.splitlines()
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    )


def mutant_changes(work: Path, names: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """The lines each mutation changed (its diff against the original, as ``mutmut show``)."""
    if not names:
        return {}
    proc = subprocess.run(
        [sys.executable, "-c", _SHOW_MANY],
        cwd=work,
        input="\n".join(names),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise CampaignError(f"reading the mutants' diffs in {work}: {proc.stderr.strip()[-500:]}")
    return {name: _changed_lines(diff) for name, diff in json.loads(proc.stdout).items()}


def mutant_change(work: Path, name: str) -> tuple[str, ...]:
    return mutant_changes(work, [name])[name]


def load_ledger(path: Path = LEDGER) -> list[dict[str, object]]:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise CampaignError(f"{path}: {exc}") from exc
    entries = data.get("equivalent", [])
    for i, entry in enumerate(entries):
        for key in ("function", "change", "reason"):
            if not entry.get(key):
                raise CampaignError(f"{path}: equivalent entry {i + 1} has no {key!r}")
    return list(entries)


def load_guards(mutants: Sequence[Mutant], path: Path = LEDGER) -> dict[str, str]:
    """The infection guards of the ledger's ``[[guard]]`` entries (``function``, ``change``,
    ``when``, ``reason``), by the key of the mutant each matches, as the equivalents match."""
    try:
        entries = tomllib.loads(path.read_text()).get("guard", [])
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise CampaignError(f"{path}: {exc}") from exc
    found: dict[str, str] = {}
    for i, entry in enumerate(entries):
        for key in ("function", "change", "when", "reason"):
            if not entry.get(key):
                raise CampaignError(f"{path}: guard entry {i + 1} has no {key!r}")
        try:
            compile(str(entry["when"]), str(path), "eval")
        except SyntaxError as exc:
            raise CampaignError(
                f"{path}: guard entry {i + 1}: 'when' is no expression: {exc}"
            ) from exc
        change = tuple(str(c) for c in entry["change"])
        for m in mutants:
            if m.function == entry["function"] and m.change == change:
                found[m.key] = str(entry["when"])
    return found


def apply_ledger(mutants: list[Mutant], ledger: list[dict[str, object]]) -> list[dict[str, object]]:
    """Mark ledger matches equivalent; return the entries that matched no mutant (stale)."""
    used: set[int] = set()
    for m in mutants:
        if not m.change:
            continue
        for i, entry in enumerate(ledger):
            change = tuple(str(c) for c in entry["change"])  # type: ignore[attr-defined]
            if entry["function"] == m.function and change == m.change:
                m.equivalent = str(entry["reason"])
                used.add(i)
    return [e for i, e in enumerate(ledger) if i not in used]


# What a re-check may take from the checkout instead of the campaign's copy: the suite and the
# harness (never the mutated runtime). The subject's conformance module is the runtime's own
# declaration to the gate (probes, capabilities), which suite changes extend.
SUITE_PATHS = (
    "invariants",
    "conformance",
    "omni_runtime/conformance_subject.py",
    # The bundled models the properties' workers run: not mutated, but what a property reaches
    # through them (a model hook such as ``omni_output_producers``) is part of the suite.
    "omni_runtime/models",
    PROCESS_STAGE_TESTS,
)


def refresh_suite(work: Path, rev: str | None = None) -> None:
    """Copy the checkout's suite and harness (or those of commit ``rev``) over the work folder's,
    so survivors are re-checked against the suite as it is now (the triage loop: add a property,
    re-check what survived), or as it was when the kept verdicts were decided (``restore``)."""
    source = REPO
    if rev is not None:
        source = work / "suite-of-refresh"
        shutil.rmtree(source, ignore_errors=True)
        source.mkdir(parents=True)
        archive = subprocess.run(
            ["git", "archive", "--format=tar", rev, *SUITE_PATHS], cwd=REPO, capture_output=True
        )
        if archive.returncode != 0:
            raise CampaignError(f"the suite of {rev}: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
    # Both copies: mutmut copies the work folder's ``conformance`` and ``invariants`` over its
    # own on every run (``rerun``), and the tests run from its own.
    for rel in SUITE_PATHS:
        for dest in (work / rel, work / "mutants" / rel):
            src = source / rel
            if src.is_dir():
                shutil.rmtree(dest, ignore_errors=True)
                shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(src, dest)
    if rev is not None:
        shutil.rmtree(source)


def clean_run(work: Path, profile: str, tests: tuple[str, ...] = ()) -> None:
    """Run the work folder's suite (or only ``tests``) with no mutant active, under ``profile``:
    a refreshed suite that fails on the unmutated runtime (a harness change the work folder's
    runtime copy lacks, say) would count every mutant it covers as killed."""
    # A targeted re-check trusts the failures of its own tests only, so only they must pass:
    # the rest of a refreshed suite may need runtime code the campaign's commit lacks.
    targets = list(tests) or ["invariants", PROCESS_STAGE_TESTS]
    # Pinned as every re-check is: the examples a kill was drawn from must pass here.
    cmd = [sys.executable, "-m", "pytest", *pytest_args(profile), *PINNED_SEED, *targets]
    with tempfile.TemporaryDirectory(dir=work) as examples:
        env = campaign_env(work) | {"MUTANT_UNDER_TEST": ""} | pinned_hypothesis(examples)
        proc = subprocess.run(cmd, cwd=work / "mutants", env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-15:])
        raise CampaignError(
            f"the suite fails with no mutant active (exit {proc.returncode}); re-checks against "
            f"it would count false kills:\n{tail}"
        )


def collect_tests(work: Path) -> set[str]:
    """The node ids of the invariant suite as it is in the work folder."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", *pytest_args("ci"), "invariants"],
        cwd=work / "mutants",
        env=campaign_env(work),
        capture_output=True,
        text=True,
    )
    return {line.strip() for line in proc.stdout.splitlines() if "::" in line}


def _merge_into(path: Path, cache: dict[str, str]) -> None:
    """Write ``cache`` into ``path`` together with what other re-checks wrote there since it was
    read (re-checks of disjoint globs may run side by side); ``cache`` takes those in too."""

    def merged(on_disk: dict[str, Any]) -> dict[str, Any]:
        cache.update({k: v for k, v in on_disk.items() if k not in cache})
        return cache

    update_json(path, merged)


def recheck_kills(work: Path, skip: Path | None = None) -> set[str]:
    """Keys of the mutants a re-check killed, under any profile (every profile is derandomized,
    so a covering test that failed on the mutant fails it under any of them): the caches in the
    work folder but ``skip``."""
    return {
        key
        for cache in work.glob("recheck-*.json")
        if cache != skip
        for key, verdict in json.loads(cache.read_text()).items()
        if verdict in ("killed", "timeout")
    }


def parts_path(work: Path, profile: str) -> Path:
    """Where a full re-check keeps, per survivor, the tests it already passed (``PART_SECONDS``)."""
    return work / f"parts-{profile}.json"


def _passed_against(kept: Mapping[str, Any], suite: str) -> dict[str, list[str]]:
    """A parts file's passed tests by survivor, when it was kept against ``suite``: parts
    passed against another suite count for nothing."""
    return dict(kept.get("passed", {})) if kept.get("suite") == suite else {}


def passed_parts(path: Path, suite: str) -> dict[str, list[str]]:
    """The tests each survivor (by key) passed in earlier parts of a re-check against ``suite``."""
    return _passed_against(json.loads(path.read_text()) if path.is_file() else {}, suite)


def record_part(path: Path, suite: str, key: str, tests: Sequence[str] | None) -> None:
    """Add ``tests`` to what the survivor ``key`` passed against ``suite`` (``None``: forget the
    survivor's parts, once its verdict is in the re-check's cache), atomically beside the other
    re-check running at the same time."""

    def added(kept: dict[str, Any]) -> dict[str, Any]:
        passed = _passed_against(kept, suite)
        if tests is None:
            passed.pop(key, None)
        else:
            passed[key] = sorted({*passed.get(key, ()), *tests})
        return {"suite": suite, "passed": passed}

    update_json(path, added)


def split_parts(tests: Sequence[str], durations: Mapping[str, float]) -> list[list[str]]:
    """``tests`` in order, cut into runs of at most ``PART_SECONDS`` of unmutated time."""
    parts: list[list[str]] = []
    total = PART_SECONDS
    for t in tests:
        took = durations.get(t, 0.0)
        if parts and total + took <= PART_SECONDS:
            parts[-1].append(t)
            total += took
        else:
            parts.append([t])
            total = took
    return parts


def run_tests(
    work: Path, mutant: str, profile: str, tests: Sequence[str], timeout: float
) -> int | None:
    """pytest's exit code for ``tests`` with ``mutant`` active in the work folder, under
    ``profile``; None when it outran ``timeout`` seconds of wall clock."""
    with tempfile.TemporaryDirectory(dir=work) as examples:
        env = campaign_env(work) | {"MUTANT_UNDER_TEST": mutant} | pinned_hypothesis(examples)
        cmd = [sys.executable, "-m", "pytest", *pytest_args(profile), *PINNED_SEED, *tests]
        try:
            return subprocess.run(
                cmd, cwd=work / "mutants", env=env, capture_output=True, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            return None


# ---- reach: which test executes which mutated statement ----------------------------------------

# Every re-check runs hypothesis with this seed and no example database. ``thorough`` is not
# derandomized, so without the pin a re-check would draw other examples on every run: its kills
# could not be replayed, and the reach run below could not say which tests a mutant's run meets.
PINNED_SEED = ("--hypothesis-seed", "0")
REACH_PLUGIN = REPO / "mutation" / "reach_plugin.py"
# What a re-check's pytest costs before its first test (imports, collection): part of the clean
# time its timeout is a multiple of.
STARTUP_SECONDS = 30.0
# A full re-check through the reach runs a survivor's tests in parts of at most this many seconds
# (of their unmutated time; a longer test is a part of its own) and keeps each part that passes.
# A survivor the lock-step machines reach costs up to two hours under ``thorough``, as long as a
# good share of a working session: run whole, one cut off with its session left nothing behind.
PART_SECONDS = 900.0


def pinned_hypothesis(examples: str) -> dict[str, str]:
    """The environment that points hypothesis's example database at ``examples``, an empty
    folder: examples an earlier mutant's failure saved would otherwise be replayed first."""
    return {"HYPOTHESIS_STORAGE_DIRECTORY": examples}


@dataclasses.dataclass
class Reach:
    """Which tests of the work folder's suite execute which line of its (unmutated) runtime copy
    under one profile and the pinned seed, and how long each test took there.

    A mutant's run draws the same examples as the unmutated run and executes the same code up to
    the first time it meets the mutated statement, so a test that never executed that statement
    cannot fail on the mutant: the re-check runs only the tests that did."""

    profile: str
    suite: str  # the work folder's suite: the campaign's commit, or where it was refreshed from
    seconds: float  # the reach run's wall clock
    tests: list[str]
    durations: dict[str, float]
    lines: dict[str, dict[int, list[int]]]  # file (relative to mutants/) -> line -> test indices
    # Tests that failed with no mutant active: a mutant's run of one would count a false kill, so
    # no re-check runs them (the report names them: each is a finding about the runtime or the
    # suite under this profile).
    failing: list[str] = dataclasses.field(default_factory=list)

    def tests_at(self, path: str, lines: Iterable[int]) -> set[str]:
        """Every test that executed one of ``lines``, those failing unmutated included."""
        at = self.lines.get(path, {})
        return {self.tests[i] for line in lines for i in at.get(line, ())}

    def to_json(self) -> str:
        return json.dumps(
            dataclasses.asdict(self)
            | {
                "lines": {
                    path: {str(line): ids for line, ids in by_line.items()}
                    for path, by_line in self.lines.items()
                }
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Reach:
        raw = json.loads(text)
        raw["lines"] = {
            path: {int(line): ids for line, ids in by_line.items()}
            for path, by_line in raw["lines"].items()
        }
        return cls(**raw)


def suite_of(meta: dict[str, object]) -> str:
    return str(meta.get("suite_refreshed_from") or meta.get("commit") or meta.get("rev"))


def reach_path(work: Path, profile: str) -> Path:
    return work / f"reach-{profile}.json"


def load_reach(work: Path, profile: str, meta: dict[str, object]) -> Reach:
    """The reach of the work folder's suite under ``profile``: the kept one when it was measured
    on this suite, else measured now (one run of the whole suite under coverage.py, with no
    mutant active: for ``thorough`` about as long as the suite's own run under it)."""
    path = reach_path(work, profile)
    if path.is_file():
        kept = Reach.from_json(path.read_text())
        if kept.suite == suite_of(meta):
            return kept
    reach = measure_reach(work, profile, suite_of(meta))
    path.write_text(reach.to_json())
    return reach


def measure_reach(work: Path, profile: str, suite: str) -> Reach:
    out = (work / "reach").resolve()
    shutil.rmtree(out, ignore_errors=True)
    (out / "data").mkdir(parents=True)
    rcfile = out / "coveragerc"
    # ``context`` expands the variable the plugin sets around each test, in the process that
    # reads the file: a stage process started during a test labels its lines with that test.
    rcfile.write_text(
        "\n".join(
            [
                "[run]",
                "include = omni_runtime/*",
                "concurrency = thread, multiprocessing",
                "context = ${OMNI_REACH_CONTEXT}",
                f"data_file = {out / 'data' / 'cov'}",
                "parallel = true",
                "sigterm = true",  # a stage process vLLM terminates still writes its lines
                "",
            ]
        )
    )
    print(f"measuring which test reaches which line under {profile} (one suite run)", flush=True)
    failing, seconds = observed_run(
        work,
        work / "mutants",
        REACH_PLUGIN,
        profile,
        ["invariants", PROCESS_STAGE_TESTS],
        {"OMNI_REACH_RCFILE": str(rcfile)},
        out / "examples",
        "reach",
    )
    reach = read_reach(out / "data", work / "mutants", profile, suite, seconds)
    reach.failing = failing
    return reach


def observed_run(
    work: Path,
    tree: Path,
    plugin: Path,
    profile: str,
    targets: Sequence[str],
    env: Mapping[str, str],
    examples: Path,
    what: str,
) -> tuple[list[str], float]:
    """One pytest in ``tree`` (the work folder's ``mutants/`` or a probed copy of it) over
    ``targets`` with no mutant active and ``plugin`` (copied into ``tree``) observing it:
    under ``profile`` and the pinned seed, two workers, every test run (no stop at the first
    failure). Returns the tests that failed and the wall clock; a run that broke (not a test
    failure) raises, naming ``what`` run it was."""
    shutil.copyfile(plugin, tree / plugin.name)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        plugin.stem,
        "-n",
        "2",
        *pytest_args(profile),
        *PINNED_SEED,
        "-rf",
        *targets,
    ]
    cmd.remove("-x")
    full_env = (
        campaign_env(work)
        | {"MUTANT_UNDER_TEST": ""}
        | dict(env)
        | pinned_hypothesis(str(examples))
    )
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=tree, env=full_env, capture_output=True, text=True)
    seconds = time.monotonic() - start
    failing = failed_tests(proc.stdout)
    if proc.returncode not in (0, 1) or (proc.returncode == 1 and not failing):
        tail = "\n".join(proc.stdout.splitlines()[-15:])
        raise CampaignError(
            f"the {what} run under {profile} broke (exit {proc.returncode}):\n{tail}"
        )
    return failing, seconds


def failed_tests(output: str) -> list[str]:
    """The node ids of pytest's ``-rf`` summary lines (``FAILED node - message``)."""
    return sorted(
        {
            line.removeprefix("FAILED ").split(" - ", 1)[0].strip()
            for line in output.splitlines()
            if line.startswith("FAILED ")
        }
    )


def read_reach(data: Path, root: Path, profile: str, suite: str, seconds: float) -> Reach:
    from coverage import CoverageData  # the test extra's; only the re-check needs it

    tests: list[str] = []
    index: dict[str, int] = {}
    lines: dict[str, dict[int, set[int]]] = {}
    for part in sorted(data.glob("cov.*")):
        if part.name.endswith(".json"):
            continue
        cov = CoverageData(str(part))
        cov.read()
        for path in cov.measured_files():
            rel = Path(path).resolve().relative_to(root.resolve()).as_posix()
            for line, contexts in cov.contexts_by_lineno(path).items():
                for context in contexts:
                    # "static|dynamic": the test process switches the dynamic part, a stage
                    # process it started carries the test in the static part.
                    test = next((c for c in reversed(context.split("|")) if c), "")
                    if not test:
                        continue  # imports and fixtures shared by every test
                    i = index.setdefault(test, len(tests))
                    if i == len(tests):
                        tests.append(test)
                    lines.setdefault(rel, {}).setdefault(line, set()).add(i)
    durations: dict[str, float] = {}
    for part in data.glob("cov.seconds.*.json"):
        durations.update(json.loads(part.read_text()))
    return Reach(
        profile,
        suite,
        seconds,
        tests,
        durations,
        {p: {n: sorted(ids) for n, ids in by.items()} for p, by in lines.items()},
    )


def _statements(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.stmt]:
    return [n for n in ast.walk(fn) if isinstance(n, ast.stmt) and n is not fn]


def _own_lines(stmt: ast.stmt) -> range:
    """The lines a statement's own code is on: a compound statement's header, a simple
    statement's every line (coverage.py may record any of them for a multi-line one)."""
    children = [
        n
        for field in ("body", "orelse", "finalbody", "handlers", "cases")
        for n in getattr(stmt, field, ())
        if isinstance(n, ast.AST) and hasattr(n, "lineno")
    ]
    end = min((n.lineno for n in children), default=(stmt.end_lineno or stmt.lineno) + 1)
    return range(stmt.lineno, max(end, stmt.lineno + 1))


def mutated_lines(source: str, mutant: str) -> tuple[int, ...] | None:
    """The lines (in ``source``, mutmut's copy of a file) of the statements of the unmutated
    function that mutant ``mutant`` (its mangled name, ``x…__mutmut_N``) changes; None when
    ``source`` holds no such mutant."""
    fns = infection.functions(ast.parse(source))
    base = mutant.rsplit("__mutmut_", 1)[0]
    orig, changed = fns.get(f"{base}__mutmut_orig"), fns.get(mutant)
    if orig is None or changed is None:
        return None
    text = source.splitlines()

    def body(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
        return text[fn.body[0].lineno - 1 : fn.end_lineno]

    first = orig.body[0].lineno
    before, after = body(orig), body(changed)
    differing: set[int] = set()
    for tag, i1, i2, _, _ in difflib.SequenceMatcher(
        a=before, b=after, autojunk=False
    ).get_opcodes():
        if tag != "equal":
            # A pure insertion has no line of its own before: the line it precedes stands in.
            differing.update(range(first + i1, first + max(i2, i1 + 1)))
    # A change outside the body's statements (a default in the signature, say) is met wherever
    # the function runs: then any of its lines stands for it.
    whole = tuple(range(orig.lineno, (orig.end_lineno or orig.lineno) + 1))
    if not differing:
        return whole
    found: set[int] = set()
    statements = _statements(orig)
    for line in differing:
        holding = [s for s in statements if s.lineno <= line <= (s.end_lineno or s.lineno)]
        if not holding:
            return whole
        innermost = max(holding, key=lambda s: s.lineno)
        found.update(_own_lines(innermost))
    return tuple(sorted(found))


# ---- infection: which reaching test makes a survivor's mutated code compute otherwise ---------

INFECTION_PLUGIN = REPO / "mutation" / "infection_plugin.py"


@dataclasses.dataclass
class Infection:
    """Per survivor, the tests of the work folder's suite in which its mutated code, probed in
    the unmutated run under one profile and the pinned seed, ever computed something other than
    the unmutated code (``mutation/infection.py``). A test outside that set executes the same
    code with the same state as the mutant's run would, so it passes with the mutant: the
    re-check runs only the others.

    ``mutants``: by mutant key, ``{"probe": kind or None, "infected": [tests], "passed":
    [tests]}``: the tests it was infected in, and those of its run that passed. A test named
    ``""`` is an infection outside any test (a stage process between tests), which narrows
    nothing; a test that did not pass in the mutant's run (or was not in it) is never left out.
    ``tests``: what each test did in the runs so far (``passed``, ``failed``, ``skipped``)."""

    profile: str
    suite: str
    seconds: float
    tests: dict[str, str]
    mutants: dict[str, dict[str, Any]]

    def narrow(self, key: str, reaching: Sequence[str]) -> list[str] | None:
        """The tests of ``reaching`` that ``key``'s mutant must still run, in their order; None
        when its infection was not measured (or could not be probed): then all of them."""
        record = self.mutants.get(key)
        if record is None or record.get("probe") is None:
            return None
        infected, passed = set(record["infected"]), set(record["passed"])
        if "" in infected:
            return None
        return [t for t in reaching if t in infected or t not in passed]


def infection_path(work: Path, profile: str) -> Path:
    return work / f"infection-{profile}.json"


def load_infection(work: Path, profile: str, suite: str) -> Infection | None:
    path = infection_path(work, profile)
    if not path.is_file():
        return None
    kept = Infection(**json.loads(path.read_text()))
    return kept if kept.suite == suite else None


@dataclasses.dataclass(frozen=True)
class ProbePlan:
    """What an infection run probes: ``reaching``, survivors by key with the tests that reach
    them; ``names``, every probed mutant's mangled name by key; ``controls``, kills probed as
    positive controls, with their reaching tests; ``guards``, the ledger's guards by key."""

    reaching: Mapping[str, list[str]]
    names: Mapping[str, str]
    controls: Mapping[str, list[str]] = dataclasses.field(default_factory=dict)
    guards: Mapping[str, str] = dataclasses.field(default_factory=dict)


def measure_infection(work: Path, profile: str, suite: str, request: ProbePlan) -> Infection:
    """One run, with no mutant active, of the tests that reach ``request``'s survivors, under
    ``profile``, in a copy of the work folder's tree whose unmutated functions carry the probes
    of those mutants and of its controls.

    ``controls``: mutants a re-check under ``profile`` killed, with the tests that reach them,
    probed in the same run as positive controls: a kill needs a test in which the mutated code
    computed otherwise, so each control whose reaching tests all ran must be infected in one.
    One that is not means the probes miss infections, and narrowing by them would drop tests
    that kill: the run is refused. A guard (``load_guards``) applies to a survivor, never to a
    control."""
    controls, names = request.controls, request.names
    guards = {
        k: v for k, v in request.guards.items() if k in request.reaching and k not in controls
    }
    plan = {**controls, **request.reaching}
    root = (work / "infection").resolve()
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(
        work / "mutants", root / "mutants", ignore=shutil.ignore_patterns("__pycache__")
    )
    probes: dict[str, str | None] = {}
    by_file: dict[str, list[str]] = {}
    mangled: dict[str, str] = {}  # key -> the mangled name, as probes record it
    for key in plan:
        module, mangled[key] = names[key].rsplit(".", 1)
        by_file.setdefault(module.replace(".", "/") + ".py", []).append(mangled[key])
    found: dict[str, infection.Probe | None] = {}
    by_name = {mangled[k]: when for k, when in guards.items()}
    for path, functions in by_file.items():
        target = root / "mutants" / path
        text, plans = infection.instrument_source(target.read_text(), functions, by_name)
        target.write_text(text)
        found.update(plans)
    for key in plan:
        probe = found.get(mangled[key])
        probes[key] = probe.kind if probe is not None else None
    hits = root / "hits"
    hits.mkdir()
    tests = sorted(
        {t for key, ts in plan.items() if key not in controls and probes[key] for t in ts}
    )
    seconds = 0.0
    if tests:
        probed = [key for key, kind in probes.items() if kind is not None]
        print(
            f"probing the infections of {sum(k not in controls for k in probed)} survivors and "
            f"{sum(k in controls for k in probed)} kills (controls) under {profile} "
            f"({len(tests)} tests, one run)",
            flush=True,
        )
        _, seconds = observed_run(
            work,
            root / "mutants",
            INFECTION_PLUGIN,
            profile,
            tests,
            {"OMNI_INFECTION_DIR": str(hits)},
            root / "examples",
            "infection",
        )
    ran: dict[str, str] = {}
    for f in sorted(hits.glob("ran.*.json")):
        for test, outcome in json.loads(f.read_text()).items():
            if ran.get(test) != "failed":
                ran[test] = outcome
    infected: dict[str, set[str]] = {}
    for f in sorted(hits.glob("hits.*.tsv")):
        for line in f.read_text().splitlines():
            name, _, test = line.partition("\t")
            infected.setdefault(name, set()).add(test)
    found_in = {key: sorted(infected.get(mangled[key], ())) for key in plan}
    for key, reaching in controls.items():
        if probes[key] and reaching and set(reaching) <= set(tests) and not found_in[key]:
            raise CampaignError(
                f"the infection probes missed {names[key]}: a re-check under {profile} killed "
                f"it, yet no probe ({probes[key]}) saw its code compute otherwise in any of the "
                f"{len(reaching)} tests that reach it; narrowing by them would drop killing tests"
            )
    return Infection(
        profile,
        suite,
        seconds,
        ran,
        {
            key: {
                "probe": probes[key],
                "infected": found_in[key],
                "passed": sorted(t for t in plan[key] if ran.get(t) == "passed"),
            }
            | ({"control": True} if key in controls else {})
            | ({"guard": guards[key]} if key in guards else {})
            for key in plan
        },
    )


def infection_for(work: Path, profile: str, suite: str, request: ProbePlan) -> Infection:
    """The kept infection of the work folder's suite under ``profile``, measured first for the
    survivors of ``request`` it lacks, or holds under another guard (one run for all of them,
    ``measure_infection``), and kept with the rest."""
    kept = load_infection(work, profile, suite)
    missing = {
        k: v
        for k, v in request.reaching.items()
        if kept is None
        or k not in kept.mutants
        or kept.mutants[k].get("guard") != request.guards.get(k)
    }
    if not missing:
        assert kept is not None
        return kept
    new = measure_infection(work, profile, suite, dataclasses.replace(request, reaching=missing))

    def merged(on_disk: dict[str, Any]) -> dict[str, Any]:
        if on_disk.get("suite") != suite:
            on_disk = {}
        tests = {**on_disk.get("tests", {}), **new.tests}
        return dataclasses.asdict(new) | {
            "seconds": float(on_disk.get("seconds", 0.0)) + new.seconds,
            "tests": tests,
            "mutants": {**on_disk.get("mutants", {}), **new.mutants},
        }

    update_json(infection_path(work, profile), merged)
    result = load_infection(work, profile, suite)
    assert result is not None
    return result


def recheck(
    work: Path,
    mutants: list[Mutant],
    profile: str,
    timeout: float,
    only: str | None = None,
    tests_only: Sequence[str] = (),
    reach: Reach | None = None,
    workers: int = 2,
    quick: float | None = None,
    keep: Callable[[], None] | None = None,
    infect: bool = False,
) -> None:
    """Run each survivor the ledger does not explain, each timeout, and each mutant no test
    called when the campaign recorded its coverage, again under ``profile``. Results are kept in
    the work folder (keyed by mutant and change), so ``report`` does not redo them.

    With ``reach`` (measured under ``profile``), a survivor runs the tests that executed its
    mutated statement, quickest first, and a run more than three times as long as those tests
    took unmutated counts as a timeout (a kill, as mutmut counts it); a survivor whose statement
    no test executed is ``unreached`` without a run. Without it, a survivor runs its covering
    tests (mutmut's, per function) with ``timeout`` seconds of wall clock. ``workers`` survivors
    run at a time.

    ``tests_only``: run just these tests (node ids or paths in the suite), the properties added
    for a class of survivors, instead of every covering test. Only kills are kept then: a
    mutant they do not kill has not met the rest of the suite, so it gets no verdict and a later
    full re-check still runs it.

    ``quick`` (seconds, with ``reach``): every survivor, whatever a cache says of its survival,
    runs just the tests that executed its statement and took at most ``quick`` seconds unmutated,
    quickest first; only kills are kept, as with ``tests_only``. A kept survival was decided
    against the suite of its day, and a property added since (often a quick one) may kill it:
    this finds those kills for the cost of the quick tests, where a full re-check of a survivor
    that the lock-step machines reach costs every one of them.

    ``infect`` (with ``reach``): before the full re-checks, one run of the suite probes where
    their mutated code would compute otherwise (``Infection``, kept per suite); each survivor
    then runs only the reaching tests it was infected in, and one infected in none is
    ``uninfected`` without a run.

    ``keep`` runs after every verdict: the campaign's state in the checkout is brought up to
    date then (``save_state``), so a re-check that outlasts its session loses at most the
    survivors still running."""
    if quick is not None and reach is None:
        raise CampaignError("a quick re-check needs the reach of its profile")
    stats = json.loads((work / "mutants" / "mutmut-stats.json").read_text())
    tests_by_function = stats["tests_by_mangled_function_name"]
    durations: dict[str, float] = stats["duration_by_test"]
    # Tests the campaign's stats do not know (added to the suite since, ``--refresh-suite``) may
    # cover any mutant: each re-check runs them too.
    new_tests = [] if reach else sorted(collect_tests(work) - set(stats["duration_by_test"]))
    cache_path = work / f"recheck-{profile}.json"
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    # A kill under another profile is a kill under this one too: a quick ``smoke`` pass first
    # spares the slow profile's run for every mutant it kills.
    killed_elsewhere = recheck_kills(work, skip=cache_path)
    sources: dict[str, str] = {}
    # (mutant, tests, timeout, run in parts): a full re-check of a survivor whose statement the
    # reach located runs in parts; every other job (targeted, quick, or over mutmut's covering
    # tests with the wall-clock timeout) runs whole.
    jobs: list[tuple[Mutant, list[str], float, bool]] = []
    parts_file = parts_path(work, profile)
    passed = passed_parts(parts_file, reach.suite) if reach is not None else {}
    keep_lock = threading.Lock()  # parts finish on the pool's threads
    full: dict[str, tuple[Mutant, list[str]]] = {}  # full re-checks through the reach

    def reached_by(m: Mutant, reach: Reach) -> tuple[set[str], list[str]] | None:
        """Every test that executed ``m``'s mutated statement, and those of them that pass
        unmutated, quickest first; None when the statement cannot be located."""
        module, function = m.name.rsplit(".", 1)
        path = module.replace(".", "/") + ".py"
        if path not in sources:
            sources[path] = (work / "mutants" / path).read_text()
        lines = mutated_lines(sources[path], function)
        if lines is None:
            return None
        found = reach.tests_at(path, lines)
        passing = found - set(reach.failing)
        return found, sorted(passing, key=lambda t: (reach.durations.get(t, 0.0), t))

    def limit(tests: list[str], reach: Reach) -> float:
        """Three times what ``tests`` took unmutated: longer is a timeout (a kill)."""
        return 3 * (sum(reach.durations.get(t, 0.0) for t in tests) + STARTUP_SECONDS)

    for m in mutants:
        if m.status not in RECHECKED or m.equivalent:
            continue
        if only is not None and not any(fnmatch.fnmatch(m.name, g) for g in only.split(",")):
            continue
        key = m.key
        if key not in cache and key in killed_elsewhere:
            m.recheck = "killed"
            continue
        if tests_only and cache.get(key) not in ("killed", "timeout"):
            # A survival the cache holds was against the suite of its day, without these tests.
            jobs.append((m, list(tests_only), timeout, False))
        elif quick is not None and reach is not None:
            undecided = cache.get(key) not in ("killed", "timeout") and key not in killed_elsewhere
            hit = reached_by(m, reach) if undecided else None
            fast = [t for t in (hit[1] if hit else []) if reach.durations.get(t, 0.0) <= quick]
            if fast:
                jobs.append((m, fast, limit(fast, reach), False))
        elif key not in cache:
            hit = reached_by(m, reach) if reach is not None else None
            if reach is not None and hit is not None:
                found, reaching = hit
                if not reaching and found:
                    pass  # only tests that fail unmutated reach it: no verdict to be had
                elif not reaching:
                    cache[key] = "unreached"  # no test executes the statement: nothing to run
                    _merge_into(cache_path, cache)
                else:
                    full[key] = (m, reaching)
            else:
                # The suite's newer tests first: they were added to kill survivors. Then the
                # covering tests quickest first (by the campaign's timings): the run stops at the
                # first failure, and a kill by a quick property should not wait behind every
                # lock-step machine the mutant also passes.
                covering = tests_by_function.get(m.function, ())
                tests = new_tests + sorted(covering, key=lambda t: (durations.get(t, 0.0), t))
                if tests:  # else still nothing calls it
                    jobs.append((m, tests, timeout, False))
        if key in cache:
            m.recheck = cache[key]

    probed = None
    if full and infect and reach is not None:
        # The kills this profile's re-checks made are the probes' positive controls.
        killed = {
            m.key: hit[1]
            for m in mutants
            if cache.get(m.key) in ("killed", "timeout") and (hit := reached_by(m, reach))
        }
        probed = infection_for(
            work,
            profile,
            reach.suite,
            ProbePlan(
                {key: reaching for key, (_, reaching) in full.items()},
                {m.key: m.name for m in mutants if m.key in full or m.key in killed},
                killed,
                load_guards(mutants),
            ),
        )
        if keep is not None:
            keep()  # the infection run cost about a suite run: kept before any re-check
    for key, (m, reaching) in full.items():
        assert reach is not None
        narrowed = probed.narrow(key, reaching) if probed is not None else None
        if narrowed == []:
            # No reaching test ever computed otherwise at the mutated code: nothing to run.
            cache[key] = m.recheck = "uninfected"
            _merge_into(cache_path, cache)
            continue
        # The parts an earlier run passed with this mutant active are not run again.
        passed_before = set(passed.get(key, ()))
        left = [t for t in (reaching if narrowed is None else narrowed) if t not in passed_before]
        jobs.append((m, left, limit(left, reach), True))

    # The pool's tasks: a whole job, or one part of a full re-check through the reach. Parts,
    # not survivors, share the workers: with one survivor left, both cores still work on it.
    tasks: list[tuple[Mutant, list[str], float, bool]] = []
    parts_left: dict[str, int] = {}
    # Cheapest first: a session that ends part-way has decided the most survivors.
    for m, tests, timeout, parted in sorted(jobs, key=lambda j: j[2]):
        if not parted or reach is None:
            tasks.append((m, tests, timeout, False))
            continue
        parts = split_parts(tests, reach.durations) or [[]]  # none left: survived already
        parts_left[m.key] = len(parts)
        tasks += [(m, part, limit(part, reach), True) for part in parts]
    failed_parts: set[str] = set()  # survivors a part killed: their other parts need not run
    skip = object()

    def run(task: tuple[Mutant, list[str], float, bool]) -> tuple[Mutant, Any]:
        m, tests, timeout, parted = task
        if not parted:
            return m, run_tests(work, m.name, profile, tests, timeout)
        if m.key in failed_parts:
            return m, skip
        code = run_tests(work, m.name, profile, tests, timeout) if tests else 0
        with keep_lock:
            if code != 0:
                failed_parts.add(m.key)
            elif tests and m.key not in failed_parts:
                assert reach is not None
                record_part(parts_file, reach.suite, m.key, tests)
                if keep is not None:
                    keep()
        return m, code

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        running = {pool.submit(run, task): task[3] for task in tasks}
        for done in concurrent.futures.as_completed(running):
            m, code = done.result()
            if code is skip:
                continue
            if running[done]:  # a part: the survivor is decided by a failing part, or by all
                if m.key in parts_left and code == 0:
                    parts_left[m.key] -= 1
                    if parts_left[m.key]:
                        continue
                if parts_left.pop(m.key, None) is None:
                    continue  # decided already
            verdict = (
                "timeout"
                if code is None
                else {0: "survived", 1: "killed"}.get(code, f"exit {code}")
            )
            print(f"re-check ({profile}) {m.name}: {verdict}", flush=True)
            if (tests_only or quick is not None) and verdict not in ("killed", "timeout"):
                continue  # these tests alone decide only kills
            cache[m.key] = m.recheck = verdict
            _merge_into(cache_path, cache)
            if reach is not None:
                record_part(parts_file, reach.suite, m.key, None)
            if keep is not None:
                with keep_lock:
                    keep()
    for m in mutants:  # earlier re-checks of mutants this one skipped still count
        key = m.key
        if m.recheck is None and key in cache:
            m.recheck = cache[key]
        if m.recheck in (None, "survived", "unreached", "uninfected") and key in killed_elsewhere:
            m.recheck = "killed"


def kept_verdicts(work: Path, mutants: list[Mutant]) -> None:
    """Give each mutant the verdict earlier re-checks kept, running nothing (``--recheck
    none``): a kill under any profile counts, else the survival or reach a cache recorded. The
    report then says where the campaign stands without starting hours of re-checks."""
    killed = recheck_kills(work)
    recorded: dict[str, str] = {}
    for cache in sorted(work.glob("recheck-*.json")):
        recorded.update(json.loads(cache.read_text()))
    for m in mutants:
        if m.status in RECHECKED:
            m.recheck = "killed" if m.key in killed else recorded.get(m.key)


# ---- the report -------------------------------------------------------------------------------

COLUMNS = (
    "mutants",
    "killed",
    "equivalent",
    "survived",
    "no tests",
    "timeout",
    "not run",
    "other",
)


def tally(mutants: Iterable[Mutant]) -> dict[str, int]:
    row = dict.fromkeys(COLUMNS, 0)
    for m in mutants:
        row["mutants"] += 1
        final = m.final
        row[final if final in row else "other"] += 1
    return row


def score(row: dict[str, int]) -> float:
    """Killed over the mutants that got a verdict, equivalents excluded (a campaign stopped
    early leaves mutants "not run": they are reported, not scored)."""
    countable = row["mutants"] - row["equivalent"] - row["not run"]
    return row["killed"] / countable if countable else 1.0


UNREACHED = "; no test executes the mutated statement under the re-check's profile"
UNINFECTED = (
    "; no test that executes it computes anything otherwise there under the re-check's profile"
)
NOTES = {"unreached": UNREACHED, "uninfected": UNINFECTED}


def render(
    mutants: list[Mutant],
    stale: list[dict[str, object]],
    meta: dict[str, object],
    left_out: Sequence[str] = (),
) -> str:
    """The report. ``left_out``: the tests the re-check's reach run saw fail with no mutant
    active, which no re-check runs (a refreshed harness the work folder's runtime does not
    match fails whole files this way, and narrows every re-check without it)."""
    labels = list(dict.fromkeys(m.target for m in mutants))
    lines = [
        "# Mutation score of the invariant suite",
        "",
        f"mutmut {meta.get('mutmut')} on {str(meta.get('rev', '?'))[:12]}, profile {meta.get('profile')} "
        f"(survivors re-checked under {meta.get('recheck')}"
        + (
            f", against the suite of {meta['suite_refreshed_from']}"
            if meta.get("suite_refreshed_from")
            else ""
        )
        + (
            f"; survivors run again under {meta['rerun_profile']} "
            f"({float(meta.get('rerun_seconds', 0.0)):.0f} s)"  # type: ignore[arg-type]
            if meta.get("rerun_profile")
            else ""
        )
        + f"), {meta.get('children')} workers, {meta.get('seconds', 0):.0f} s"
        + (
            " so far: stopped before the end (`resume` goes on)."
            if meta.get("complete") is False
            else "."
        ),
        "",
        "| module | " + " | ".join(COLUMNS) + " | score |",
        "|---|" + "---|" * (len(COLUMNS) + 1),
    ]
    for label in [*labels, "total"]:
        row = tally(m for m in mutants if label in ("total", m.target))
        cells = " | ".join(str(row[c]) for c in COLUMNS)
        lines.append(f"| {label} | {cells} | {score(row):.1%} |")
    left = [m for m in mutants if m.final in ("survived", "no tests", "timeout")]
    if left:
        lines += ["", "## Not killed", ""]
        lines += [
            f"- `{m.name}` ({m.final}{NOTES.get(m.recheck or '', '')}): `{' / '.join(m.change)}`"
            for m in left
        ]
    if left_out:
        lines += ["", "## Tests left out of the re-checks (they fail with no mutant active)", ""]
        lines += [f"- `{t}`" for t in left_out]
    if stale:
        lines += ["", "## Stale ledger entries (match no survivor)", ""]
        lines += [f"- `{e['function']}`: `{' / '.join(map(str, e['change']))}`" for e in stale]  # type: ignore[call-overload]
    return "\n".join(lines) + "\n"


def report(
    work: Path,
    chosen: Slice,
    meta: dict[str, object],
    recheck_profile: str | None,
    recheck_timeout: float,
    recheck_only: str | None = None,
    recheck_tests: Sequence[str] = (),
    recheck_quick: float | None = None,
    keep: Callable[[], None] | None = None,
    infect: bool = True,
) -> tuple[str, float]:
    mutants = load_results(work, chosen.targets)
    wanted = [m.name for m in mutants if m.status in RECHECKED]
    changes = mutant_changes(work, [*wanted, *(name for name, _ in chosen.expected)])
    for m in mutants:
        m.change = changes.get(m.name, ())
    for name, change in chosen.expected:
        found = changes[name]
        if found != change:
            raise CampaignError(
                f"sampled mutant {name} now changes {' / '.join(found) or 'nothing'}, not "
                f"{' / '.join(change)}: the file was edited; pick the sample again"
            )
    # Entries for modules this campaign did not mutate (a slice) are not stale, only not asked.
    modules = tuple(t.path.removesuffix(".py").replace("/", ".") + "." for t in chosen.targets)
    stale = [
        e for e in apply_ledger(mutants, load_ledger()) if str(e["function"]).startswith(modules)
    ]
    reach = None
    if recheck_profile:
        # A targeted re-check names its tests; a full one runs the tests that reach each survivor.
        reach = None if recheck_tests else load_reach(work, recheck_profile, meta)
        if keep is not None:
            keep()  # a reach measured now cost a whole suite run: kept before any re-check
        recheck(
            work,
            mutants,
            recheck_profile,
            recheck_timeout,
            recheck_only,
            recheck_tests,
            reach,
            quick=recheck_quick,
            keep=keep,
            infect=infect,
        )
    else:
        kept_verdicts(work, mutants)
    text = render(mutants, stale, meta, reach.failing if reach is not None else ())
    total = score(tally(mutants))
    (work / "score.md").write_text(text)
    (work / "score.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "score": total,
                "per_module": {
                    label: tally(m for m in mutants if m.target == label)
                    for label in dict.fromkeys(m.target for m in mutants)
                },
                "mutants": [dataclasses.asdict(m) | {"final": m.final} for m in mutants],
            },
            indent=1,
        )
    )
    return text, total


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mutation/campaign.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("command", choices=("run", "resume", "rerun", "report", "merge"))
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="work folder")
    parser.add_argument("--slice", choices=sorted(SLICES), default="full")
    parser.add_argument(
        "--rev", default=None, help="mutate this commit (default: the working tree)"
    )
    parser.add_argument(
        "--state",
        type=Path,
        default=STATE,
        help="where the campaign's verdicts are kept across work folders (default mutation/state)",
    )
    parser.add_argument("--children", type=int, default=2, help="mutmut workers (default 2)")
    # ``ci``, not ``smoke``: the first campaign ran ``smoke``, and survivors checked again under
    # ``ci`` died: its properties had drawn too few examples to meet the mutated case.
    parser.add_argument("--profile", default="ci", help="hypothesis profile per mutant")
    parser.add_argument(
        "--recheck", default="thorough", help="profile for survivors ('none': skip)"
    )
    parser.add_argument(
        "--recheck-timeout", type=float, default=1800.0, help="seconds per survivor"
    )
    parser.add_argument(
        "--recheck-only",
        default=None,
        metavar="GLOBS",
        help="re-check only mutants matching one of these comma-separated globs",
    )
    parser.add_argument(
        "--recheck-tests",
        default="",
        metavar="TESTS",
        help="re-check with only these comma-separated tests (the properties added for a class "
        "of survivors); only their kills are kept",
    )
    parser.add_argument(
        "--recheck-quick",
        type=float,
        default=None,
        metavar="SECONDS",
        help="re-check every survivor, kept survivals too, with only the tests that reach it and "
        "took at most SECONDS unmutated (the re-check profile's reach); only kills are kept",
    )
    parser.add_argument(
        "--refresh-suite",
        action="store_true",
        help="report: re-check against the checkout's suite and harness, not the campaign's copy",
    )
    parser.add_argument(
        "--no-infection",
        action="store_true",
        help="run each survivor's full re-check against every test that reaches it, without "
        "first probing in which of them its mutated code computes otherwise",
    )
    parser.add_argument("--min-score", type=float, default=None, help="exit 1 below this (0..1)")
    parser.add_argument(
        "--from",
        dest="merge_from",
        type=Path,
        default=None,
        metavar="STATE",
        help="merge: another state folder of this campaign whose re-check verdicts to take in",
    )
    args = parser.parse_args(argv)
    chosen = SLICES[args.slice]
    recheck_profile = None if args.recheck == "none" else args.recheck
    recheck_tests = tuple(t for t in args.recheck_tests.split(",") if t)
    if args.command == "merge":
        return merge_command(args.merge_from, args.state, args.work, chosen)
    try:
        meta_path = args.work / "campaign.json"
        if args.command == "run":
            commit = resolve(args.rev) if args.rev else None
            prepare(args.work, chosen, args.profile, commit)
            meta: dict[str, object] = {
                "mutmut": MUTMUT_VERSION,
                "slice": args.slice,
                "rev": commit or f"{git_head()} + working tree",
                "profile": args.profile,
                "recheck": args.recheck,
                "children": args.children,
                "seconds": 0.0,
                "complete": False,
            }
            timed_mutmut(args.work, chosen, args.children, meta, meta_path, args.state)
        elif args.command == "resume":
            if args.rev or not meta_path.is_file() or not (args.work / "mutants").is_dir():
                restore(args.work, chosen, args.rev, args.state)
            meta = json.loads(meta_path.read_text())
            chosen = SLICES[str(meta.get("slice"))]
            meta["children"] = args.children
            timed_mutmut(args.work, chosen, args.children, meta, meta_path, args.state)
        elif args.command == "rerun":
            if not meta_path.is_file():
                restore(args.work, chosen, None, args.state)
            meta = json.loads(meta_path.read_text())
            chosen = SLICES[str(meta.get("slice"))]
            rerun(
                args.work, chosen, meta, meta_path, args.children, args.recheck_only, args.profile
            )
            args.refresh_suite = False  # done by the rerun
        elif not meta_path.is_file():
            restore(args.work, chosen, None, args.state)
        else:
            # The work folder was made earlier: verdicts kept since by another work folder of
            # the same campaign count here too.
            for kept in sorted(state_dir(args.state, chosen).glob("recheck-*.json")):
                merge_verdicts(kept, args.work / kept.name)
        meta = json.loads(meta_path.read_text())
        if meta.get("slice") != args.slice:
            chosen = SLICES[str(meta.get("slice"))]
        if args.refresh_suite:
            refresh_suite(args.work)
            # A re-check through the reach needs no clean run of its own: the reach run is one,
            # and the tests it saw fail unmutated are never run against a mutant.
            if recheck_profile and recheck_tests:
                clean_run(args.work, recheck_profile, recheck_tests)
            meta["suite_refreshed_from"] = git_head()
            meta_path.write_text(json.dumps(meta, indent=1))
        only = args.recheck_only or ""
        if only.count(",") > 3:  # a list of survivors by name: the report says how many
            only = f"{only.count(',') + 1} mutants by name"
        meta["recheck"] = (args.recheck if recheck_profile else "none: earlier runs' verdicts") + (
            f" ({only})" if only else ""
        )
        text, total = report(
            args.work,
            chosen,
            meta,
            recheck_profile,
            args.recheck_timeout,
            args.recheck_only,
            recheck_tests,
            args.recheck_quick,
            keep=lambda: save_state(args.work, chosen, args.state),
            infect=not args.no_infection,
        )
        save_state(args.work, chosen, args.state)
    except CampaignError as exc:
        print(f"mutation campaign: {exc}", file=sys.stderr)
        return 2
    print(text, end="")
    if args.min_score is not None and total < args.min_score:
        print(f"score {total:.1%} is below --min-score {args.min_score:.1%}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
