"""``omni-conformance merge``: matrix cell folders merged into one report. The parser and the
handler stay beside the merge itself in ``conformance.release.matrix_report``, which defines the
cells and the merged report they read and write; this module puts them in the group."""

from __future__ import annotations

from typing import Any

from conformance.release.matrix_report import add_merge_parser


def register(sub: Any) -> None:
    add_merge_parser(sub)
