"""``omni-conformance report REPORT.json``: re-renders a compat report's Markdown and JUnit from
its JSON (validated against the schema first). Exit 0 written; 2 when the file is missing, a
folder, unreadable JSON or not a compat report (one line naming the file)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from conformance._core.preflight import fail_environment


def cmd_report(args: argparse.Namespace) -> int:
    from conformance._core.report import render_from_json, render_markdown, validate

    path = Path(args.report)
    if not path.exists():
        return fail_environment(f"no such report: {path}")
    if not path.is_file():
        return fail_environment(f"{path} is a folder; give the report's compat-report.json")
    try:
        report = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return fail_environment(f"{path} is not a compat report (not readable JSON: {exc})")
    try:
        validate(report)
    except Exception as exc:  # jsonschema.ValidationError; keep the message to one line
        return fail_environment(
            f"{path} does not match the compat-report schema: {str(exc).splitlines()[0]}"
        )
    paths = render_from_json(path, args.out)
    print(render_markdown(report), end="")
    print(f"wrote {paths['markdown']} and {paths['junit']}")
    return 0


def register(sub: Any) -> None:
    rp = sub.add_parser("report", help="re-render Markdown and JUnit from a report's JSON")
    rp.add_argument("report")
    rp.add_argument("--out", default=None)
    rp.set_defaults(func=cmd_report)
