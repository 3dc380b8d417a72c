#!/usr/bin/env bash
# Turn-level recovery, end to end: 3-turn tool episodes; reference run, SIGKILL mid-episode,
# restore from the last committed turns, parity (tokens, rewards, tool states applied once).
# Usage: functional_tests/turn_recovery.sh --out DIR [--cuts N] [--model M] [--gpu] [overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python functional_tests/recovery_check.py --level turn "$@"
