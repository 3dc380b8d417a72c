from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.cluster


def test_restore_with_worker_and_store_on_different_nodes(tiny_model_dir, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(HERE / "two_node_restore.py"), str(tiny_model_dir),
         str(tmp_path / "snaps")],
        capture_output=True, text=True, timeout=600, check=False,
        cwd=HERE.parents[1],
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    r = json.loads(lines[-1].removeprefix("RESULT "))
    assert r["worker_node"] not in r["store_nodes"]  # placed on different nodes
    assert 0 < r["prefix"] < 300
    assert r["same_tokens"] and r["same_logprobs"]
    assert r["metrics"]["resume.resumed"] == 1
