#!/usr/bin/env bash
# Worker failover: one worker's engine SIGKILLed, then one worker actor ray.killed, in the
# middle of generation; the run goes on without a restart, its batches equal an uninterrupted
# reference's, and each moved call resumed from its token log (functional_tests/worker_failover.py).
# Usage: functional_tests/worker_failover.sh --out DIR [worker_failover.py options...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python functional_tests/worker_failover.py "$@"
