#!/usr/bin/env bash
# Set up if needed, lint, then run the whole test suite (what CI runs), or with --fast only the
# fast tier: tests/unit and tests/cluster, nothing that starts an engine. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
tier=suite budget=1200
if [ "${1:-}" = "--fast" ]; then
  shift
  tier="fast tier" budget=300
  set -- tests/unit tests/cluster "$@"
fi
bash scripts/setup.sh
PY=.venv/bin/python
echo "[test] ruff"
"$PY" -m ruff check .
"$PY" -m ruff format --check .
echo "[test] pytest"
start=$(date +%s)
set +e
"$PY" -m pytest "$@"
rc=$?
set -e
echo "[test] $tier took $(( $(date +%s) - start )) s (budget $budget s)"
if [ "$rc" -eq 5 ]; then
  echo "[test] pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
