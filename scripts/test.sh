#!/usr/bin/env bash
# Set up if needed, lint, then run the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
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
echo "[test] suite took $(( $(date +%s) - start )) s"
if [ "$rc" -eq 5 ]; then
  echo "[test] pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
