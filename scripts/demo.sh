#!/usr/bin/env bash
# Set up if needed, then run the main demo: a GenerationWorker on the offline tiny model
# answering one chat completion with its token ids. Extra args go to `rollout-recovery demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/rollout-recovery demo --config configs/grpo_tiny_cpu.yaml "$@"
