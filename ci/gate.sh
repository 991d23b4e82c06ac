#!/usr/bin/env bash
# The omni-conformance CI gate: install the tool, run the invariant suite against the installed
# vLLM and the chosen subject, and exit with its code (non-zero on any violation).
#
# Environment (all optional):
#   OMNI_CONFORMANCE_SPEC     what to pip install (default: this checkout, ".[test]")
#   OMNI_CONFORMANCE_SUBJECT  subject to check: a registered name or module:attr (default: omni)
#   OMNI_CONFORMANCE_PROFILE  hypothesis profile: ci | dev | thorough (default: ci)
#   REPORT_DIR / FAILURES_DIR where the compat report and failing traces go
#   GATE_SKIP_INSTALL=1       use the already installed tool (local re-runs)
set -euo pipefail

cd "$(dirname "$0")/.."
SPEC="${OMNI_CONFORMANCE_SPEC:-.[test]}"
SUBJECT="${OMNI_CONFORMANCE_SUBJECT:-omni}"
PROFILE="${OMNI_CONFORMANCE_PROFILE:-ci}"
REPORT_DIR="${REPORT_DIR:-compat-report}"
FAILURES_DIR="${FAILURES_DIR:-conformance-failures}"

export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"

if [[ "${GATE_SKIP_INSTALL:-0}" != "1" ]]; then
  python -m pip install --quiet "$SPEC"
fi

set +e
omni-conformance check \
  --subject "$SUBJECT" \
  --profile "$PROFILE" \
  --report-dir "$REPORT_DIR" \
  --failures-dir "$FAILURES_DIR"
code=$?
set -e

if [[ -n "${GITHUB_STEP_SUMMARY:-}" && -f "$REPORT_DIR/compat-report.md" ]]; then
  cat "$REPORT_DIR/compat-report.md" >> "$GITHUB_STEP_SUMMARY"
fi
exit "$code"
