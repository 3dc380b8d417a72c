#!/usr/bin/env bash
# End to end through the newcomer's command: scripts/demo.sh must print a chat completion with
# its token ids and leave no engine process behind.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(bash scripts/demo.sh 2>&1)
echo "$out" | grep -E '^\[demo\] token_ids: \[[0-9]+(, [0-9]+)*\]$' >/dev/null \
  || { echo "$out"; echo "FAIL: no token ids in the demo output" >&2; exit 1; }
echo "$out" | grep -E '^\[demo\] completion: ' >/dev/null || { echo "FAIL: no completion" >&2; exit 1; }
sleep 3
if pgrep -f "VLLM::EngineCore|EngineCore" >/dev/null; then
  echo "FAIL: an EngineCore process survived the demo" >&2; exit 1
fi
echo "demo_smoke: 1 passed, 0 failed"
