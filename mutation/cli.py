"""The campaign's command line: ``python -m mutation COMMAND [options]``, from the repository root.

    python -m mutation run --rev HEAD            # the whole campaign over a commit, then the report
    python -m mutation run --slice ci            # payload.py only: the CI guard's slice
    python -m mutation resume [--rev NEW]        # go on with a stopped campaign (or move it on)
    python -m mutation rerun --profile ci        # survivors again through mutmut, current suite
    python -m mutation report --recheck none     # where it stands, running nothing
    python -m mutation report                    # the report, re-checking survivors first
    python -m mutation merge --from STATE        # another state folder's re-check kills, here

Exits 0 when the score meets ``--min-score`` (default: none), 1 below it, 2 on bad input. A
benchmark, not a test: the README's test command runs only the ``ci`` slice
(``tests/test_mutation_slice.py``). Every option and the method: ``docs/mutation-score.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import mutation
from mutation import CampaignError
from mutation.mutmut_run import rerun, timed_mutmut
from mutation.recheck import clean_run
from mutation.report import report
from mutation.state import STATE, merge_command, merge_verdicts, restore, save_state, state_dir
from mutation.targets import MUTMUT_VERSION, SLICES
from mutation.workdir import DEFAULT_WORK, git_head, prepare, refresh_suite, resolve


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mutation", description=(mutation.__doc__ or "").split("\n")[0]
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
                args.work,
                chosen,
                meta,
                meta_path,
                args.children,
                args.recheck_only,
                args.profile,
                args.state,
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
