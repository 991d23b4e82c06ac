"""C-03: the subject's differences registry is honest — each entry complete, each still needed.

A difference from upstream is tolerated only through a registry entry (C-02), so an entry is a
hole in the comparison: it must say exactly what it lets through and why, and it must still be
needed. Two checks (``invariants.registry``):

* ``test_registry_entries_are_complete`` — every entry names its field patterns (within the
  snapshot's sections), its condition in words and as a predicate, its rationale, clauses this
  project defines and at least one test (a pytest node id) that makes it happen. Reads only
  ``Subject.differences()``, so it runs for every subject; a subject without entries passes.
* ``test_registry_entries_are_still_needed`` — for each entry, the subject's witness workload
  (``Subject.difference_witnesses``) passes in lock step with the whole registry and is tolerated
  by that entry at least once (used), and fails without it at a field the entry names (needed).
  An entry without a witness, a stale entry (its difference no longer happens) or one the
  workload does not need fails. While the witnesses run, C-62 is checked too: they are where
  the subject ends a request by itself (a send-path fault). Not applicable to a subject that
  declares no witnesses.

Both are cheap: completeness reads a tuple; each witness is a scripted workload of a few steps,
run twice. Positive control: the mutant ``stale_registry_entry`` (``tests/mutants``).
"""

import pytest

from conformance._core.capabilities import require
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
    _fail(witness_problems(conformance_subject, witnesses, conformance))
