"""No pass without a run: each check that could pass having checked nothing reports not
applicable instead, with its reason. One planted vacuous case per such check, and its
non-vacuous control:

* the run-time audit (C-10..C-12) whose programs never had a request live on both sides;
* "still needed" (C-03) for a subject that lists no registry entries;
* the static payload check (C-11) for a payload type nothing constructs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conformance._core.capabilities import DifferenceWitness, NotApplicable, SourceLayout
from conformance._core.subjects import UpstreamSubject
from invariants import test_registry
from invariants.test_ar_inv_002_adapters import require_audited, require_constructed


def test_an_audit_of_no_live_request_is_not_applicable():
    idle = SimpleNamespace(sessions=[SimpleNamespace(requests_audited=0)] * 3)
    with pytest.raises(NotApplicable, match="never audited a live request"):
        require_audited(idle)
    require_audited(SimpleNamespace(sessions=[*idle.sessions, SimpleNamespace(requests_audited=2)]))


class NoEntries(UpstreamSubject):
    """A subject with a witness hook but nothing in its registry."""

    name = "no-entries"

    def difference_witnesses(self) -> tuple[DifferenceWitness, ...]:
        return ()


def test_still_needed_without_entries_is_not_applicable():
    with pytest.raises(NotApplicable, match="lists no registry entries"):
        test_registry.test_registry_entries_are_still_needed(None, NoEntries())


def test_a_payload_type_nothing_constructs_is_not_applicable(tmp_path):
    (tmp_path / "adapters").mkdir()
    (tmp_path / "adapters" / "build.py").write_text("def f(r):\n    return Payload(r)\n")
    misspelt = SourceLayout(
        payload_root=tmp_path, payload_type="Paylod", payload_builders=("adapters/",)
    )
    with pytest.raises(NotApplicable, match="constructs Paylod"):
        require_constructed(misspelt)
    require_constructed(SourceLayout(payload_root=tmp_path, payload_type="Payload"))
    # No layout of a payload at all is the static check's own not-applicable case.
    require_constructed(SourceLayout())
