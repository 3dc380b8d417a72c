#!/usr/bin/env bash
# A user environment end to end: the notes agent (rollout_recovery/episodes/notes.py, an
# episode function whose tool writes a note store in each episode's scratch directory) at turn
# and at prefix level. Each level: reference run, SIGKILL mid-run, restore, parity as the other
# checks, plus every tool effect applied exactly once and no committed call decoded again.
# Usage: functional_tests/env_recovery.sh --out DIR [--level turn|prefix] [recovery_check options...]
# Writes DIR/<level>/parity.json per level and DIR/parity.json with both.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
out="" levels=(turn prefix) args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --level) levels=("$2"); shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
[ -n "$out" ] || { echo "usage: $0 --out DIR [--level turn|prefix] [options]" >&2; exit 2; }
rc=0
for level in "${levels[@]}"; do
  .venv/bin/python functional_tests/recovery_check.py --env notes --level "$level" \
    --out "$out/$level" ${args[@]+"${args[@]}"} || rc=1
done
.venv/bin/python functional_tests/combine_reports.py "$out" "${levels[@]}"
exit $rc
