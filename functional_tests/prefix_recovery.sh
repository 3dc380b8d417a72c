#!/usr/bin/env bash
# Prefix-level recovery, end to end: reference run, SIGKILL mid-generation, restore, parity.
# Usage: functional_tests/prefix_recovery.sh --out DIR [--cuts N] [--model M] [--gpu] [overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python functional_tests/recovery_check.py --level prefix "$@"
