"""``omni-conformance release-diff``: two recordings of one corpus from two releases compared.
The parser and the handler stay beside the comparison in ``conformance.release.release_diff``
(their exit codes are documented there); this module puts them in the group."""

from __future__ import annotations

from typing import Any

from conformance.release.release_diff import add_parser


def register(sub: Any) -> None:
    add_parser(sub)
