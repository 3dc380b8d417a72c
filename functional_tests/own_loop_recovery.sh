#!/usr/bin/env bash
# A training loop of one's own (examples/own_loop/train.py) at prefix level, end to end:
# reference run, SIGKILL mid-generation, restore, parity (the same checks as prefix_recovery.sh,
# the final checkpoint in the loop's own format byte-identical to the reference's).
# Usage: functional_tests/own_loop_recovery.sh --out DIR [--cuts N] [--kills K] [overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python functional_tests/recovery_check.py --level prefix \
  --train examples/own_loop/train.py "$@"
