"""Shared by the offline-engine subprocess scripts and the tests that run them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def offline_llm(req: dict, **extra):
    """vLLM's offline `LLM` with the worker's determinism settings (model and KV from req)."""
    from vllm import LLM

    return LLM(
        model=req["model"],
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=req["kv_bytes"],
        max_model_len=req["max_model_len"],
        seed=0,
        **extra,
    )


def run_offline(script: str, request: dict, cfg) -> dict:
    """Run one offline script in a subprocess with the engine environment; parse its RESULT."""
    from rollout_recovery.generation.engine_setup import engine_env

    request = {
        "kv_bytes": cfg.vllm_cfg.kv_cache_memory_bytes,
        "max_model_len": cfg.vllm_cfg.max_model_len,
        **request,
    }
    proc = subprocess.run(
        [sys.executable, str(HERE / script)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env={**os.environ, **engine_env(cfg)},
        timeout=600,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))
