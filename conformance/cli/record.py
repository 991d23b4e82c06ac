"""``omni-conformance record``: a corpus of workloads (generated under a fixed seed, plus every
saved trace in ``--traces``) on the installed vLLM's own schedulers, sync and async, each step's
normalised observation written as one recording. Exit 0 written; 2 for bad input (an unreadable
trace, an unwritable ``--out``) or an environment problem. The parser and the handler stay beside
the recording format in ``conformance.release.record``; this module puts them in the group."""

from __future__ import annotations

from typing import Any

from conformance.release.record import add_parser


def register(sub: Any) -> None:
    add_parser(sub)
