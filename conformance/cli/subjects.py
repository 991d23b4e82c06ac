"""``omni-conformance subjects``: the subjects this installation can check, one a line (name,
then where it comes from: the embedded set or an installed entry point). Exit 0."""

from __future__ import annotations

import argparse
from typing import Any


def cmd_subjects(args: argparse.Namespace) -> int:
    from conformance._core.subjects import available_subjects

    for name, origin in sorted(available_subjects().items()):
        print(f"{name:<16} {origin}")
    return 0


def register(sub: Any) -> None:
    s = sub.add_parser("subjects", help="list available subjects")
    s.set_defaults(func=cmd_subjects)
