#!/usr/bin/env bash
# A preemption (SIGTERM) mid-generation, then `train --restore`: zero tokens decoded twice.
# Usage: functional_tests/preemption_check.sh --out DIR [--steps N] [--cuts N] [--fault NAME] [overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python functional_tests/preemption_check.py "$@"
