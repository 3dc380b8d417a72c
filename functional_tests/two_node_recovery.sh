#!/usr/bin/env bash
# Two-node kill/restore: a GRPO run on a local two-node Ray cluster (workers, store shards and
# environment actors on both nodes, checkpoints on a local S3 server) has its driver SIGKILLed
# in the middle of generation, Ray ends its actors, and `train --restore` on the same cluster
# finishes it with the reference run's batches, every cut call resumed from its prefix
# (functional_tests/two_node_recovery.py).
# Usage: functional_tests/two_node_recovery.sh --out DIR [two_node_recovery.py options...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python functional_tests/two_node_recovery.py "$@"
