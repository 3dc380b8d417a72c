#!/usr/bin/env bash
# Set up if needed, then run the main demo: a small GRPO run on the offline tiny model is
# killed with SIGKILL in the middle of generation, restored from its last snapshot (in-flight
# calls resume from their staged prefixes), and compared with an uninterrupted reference run.
# Ends with the parity table and the work lost to the crash at levels prefix, turn and none
# (measured from the engines' own records). Extra args go to the check.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python functional_tests/recovery_check.py --level prefix --out runs/demo \
  --steps 2 --max-tokens 256 --cuts 4 "$@"
