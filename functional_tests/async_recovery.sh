#!/usr/bin/env bash
# Asynchronous GRPO killed and restored, checked by invariants; writes DIR/parity.json.
# Usage: functional_tests/async_recovery.sh --out DIR [--level prefix|turn|none] [--kills N]
#        [--steps N] [--journal on|off] [overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python functional_tests/async_recovery.py "$@"
