"""The invariant suite's mutation score: a mutmut campaign over the runtime code the suite guards.

A package, run as ``python -m mutation run|resume|rerun|report|merge`` from the repository root
(``mutation.cli``). Its modules, one concern each: ``targets`` (what is mutated, how the suite
runs per mutant), ``workdir`` (the work folder mutmut runs in), ``mutmut_run`` (driving mutmut),
``state`` (the verdicts kept in ``mutation/state/``), ``results`` (mutmut's verdicts and diffs),
``ledger`` (``mutation/triage.toml``), ``reach`` and ``infection_run`` (which tests a survivor's
re-check needs), ``recheck``, ``report`` (the score). ``infection`` instruments functions with
probes; ``infection_plugin`` and ``reach_plugin`` are pytest plugins copied into the work folder
and loaded there by module name. The method and the current figures: ``docs/mutation-score.md``.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class CampaignError(Exception):
    """Bad input or a broken work folder: one line for the user."""
