#!/usr/bin/env bash
# End to end through the newcomer's command: scripts/demo.sh must end with the parity table
# and a pass, and leave no engine process behind.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(bash scripts/demo.sh 2>&1) || { echo "$out"; echo "FAIL: scripts/demo.sh failed" >&2; exit 1; }
for want in '^prefix-level recovery parity' '^recovery_check: 1 passed, 0 failed$'; do
  echo "$out" | grep -E "$want" >/dev/null \
    || { echo "$out"; echo "FAIL: the demo output lacks /$want/" >&2; exit 1; }
done
sleep 3
if pgrep -f "VLLM::EngineCore|EngineCore" >/dev/null; then
  echo "FAIL: an EngineCore process survived the demo" >&2; exit 1
fi
echo "demo_smoke: 1 passed, 0 failed"
