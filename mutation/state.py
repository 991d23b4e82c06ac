"""The campaign's verdicts kept in the checkout, ``mutation/state/<slice>/``.

A campaign outlasts a working session and its work folder may not survive one, so what it
decided is copied into the checkout, small enough to commit (``save_state``): mutmut's per-file
results and test stats, the clock (``campaign.json``), and the re-check, reach, parts and
infection files. ``restore`` rebuilds a work folder from them over the campaign's commit or a
later one (where mutmut keeps the verdicts of unchanged functions). Re-check verdicts from two
work folders merge with a kill standing (``merge_verdicts``, ``merge``); every state file is
written under a lock and atomically (``update_json``). The files' format is fixed: the state
committed today must keep loading. Details: ``docs/mutation-score.md``.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mutation import REPO, CampaignError
from mutation.targets import SLICES, Slice
from mutation.workdir import campaign_env, prepare, refresh_suite, resolve

STATE = REPO / "mutation" / "state"

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
