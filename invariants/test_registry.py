"""C-03: the subject's differences registry is honest — each entry complete, each still needed.

A difference from upstream is tolerated only through a registry entry (C-02), so an entry is a
hole in the comparison: it must say what it lets through and why, and still be needed.

* ``test_registry_entries_are_complete`` — reads ``Subject.differences()``, so it runs for
  every subject (one without entries passes);
* ``test_registry_entries_are_still_needed`` — each entry's witness workload
  (``Subject.difference_witnesses``) uses the entry and fails without it; C-62 is checked while
  the witnesses run. Not applicable to a subject that declares no witnesses.

What each check demands: ``invariants.registry``; C-03 and its mutant: docs/contracts.md.
"""

import pytest

from conformance._core.capabilities import NotApplicable
from conformance._core.needs import require
from invariants.registry import registry_problems, witness_problems

pytestmark = [pytest.mark.invariants]


def _fail(problems: list[str]) -> None:
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise AssertionError(problems[0] + more + "\n" + "\n".join(problems[1:]))


@pytest.mark.clauses("C-03")
def test_registry_entries_are_complete(conformance_subject):
    _fail(registry_problems(list(conformance_subject.differences())))


@pytest.mark.clauses("C-03", "C-62")
def test_registry_entries_are_still_needed(conformance, conformance_subject):
    witnesses = require(conformance_subject, "difference_witnesses", "difference witnesses")
    if not list(conformance_subject.differences()):
        # Witnesses of no entry check nothing: no pass.
        raise NotApplicable(f"subject {conformance_subject.name!r} lists no registry entries")
    _fail(witness_problems(conformance_subject, witnesses, conformance))
