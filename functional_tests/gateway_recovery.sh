#!/usr/bin/env bash
# A harness in another process through the rollout gateway, end to end: the official `openai`
# client harness (rollout_recovery/episodes/openai_harness.py, a multi-turn calculator tool
# loop) per rollout; reference run, SIGKILL of the whole job (gateway, workers and harnesses)
# mid-run, restart: each harness replays its episode from the top, its committed calls answered
# from the journal. Parity as the other checks, and no committed call decoded again.
# Usage: functional_tests/gateway_recovery.sh --out DIR [--level prefix|turn] [recovery_check options...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python functional_tests/recovery_check.py --env gateway "$@"
