"""Driving mutmut: the campaign's own test runs, one per mutant.

Owns ``run_mutmut`` (one ``mutmut run`` in the work folder, its log in ``mutmut.log``),
``timed_mutmut`` (``run`` and ``resume``: the campaign's clock kept every half minute, and on a
resume only the mutants still without a verdict named to mutmut) and ``rerun`` (the survivors
again through mutmut, against the checkout's suite, under another profile). The verdicts go to
the checkout's state folder as they come (``mutation.state``). Method: ``docs/mutation-score.md``.
"""

from __future__ import annotations

import fnmatch
import json
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from mutation import CampaignError
from mutation.ledger import apply_ledger, load_ledger
from mutation.recheck import recheck_kills
from mutation.results import RECHECKED, load_results, mutant_changes
from mutation.state import save_state
from mutation.targets import Slice, Target
from mutation.workdir import campaign_env, git_head, refresh_suite


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
    state: Path,
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
        save_state(work, chosen, state)
