#!/usr/bin/env bash
# Two owners of one run: the own loop frozen mid-generation, a restore taking the run over, the
# stale one thawed (it must stop, say so in one line and write nothing), a last restore going on
# from the newer history. Writes DIR/parity.json.
# Usage: functional_tests/two_owners.sh --out DIR [--steps S] [--fault NAME] [overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python functional_tests/two_owners.py "$@"
