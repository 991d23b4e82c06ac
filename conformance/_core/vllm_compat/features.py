"""Which scheduler axes (``conformance._core.axes``) the installed vLLM release can drive.

An axis a release lacks, or spells so differently that the harness cannot build it there, is
listed with the release that brought it and the reason the report gives (not applicable).
"""

from __future__ import annotations

from conformance._core.vllm_compat.versions import ByRelease

# axis name -> why it cannot run; every axis runs on the releases after the last change.
MISSING_AXES: ByRelease[dict[str, str]] = ByRelease("scheduler axes missing", {})


def axis_unavailable(name: str) -> str | None:
    """Why the installed release cannot run axis ``name`` (None: it can)."""
    return MISSING_AXES.value().get(name)
