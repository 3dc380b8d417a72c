"""The recovery functional tests at a small size (reference, SIGKILL, restore, parity)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.engine


def test_prefix_recovery_after_sigkill_matches_the_reference(tmp_path):
    out = tmp_path / "prefix"
    proc = subprocess.run(
        [sys.executable, str(REPO / "functional_tests" / "recovery_check.py"), "--level",
         "prefix", "--out", str(out), "--steps", "2", "--max-tokens", "256", "--cuts", "2"],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "parity.json").read_text())
    assert report["violations"] == []
    assert report["restored_calls"] >= 2 and report["restored_prefix_tokens"] > 0
    assert all(s["same_batch"] and s["same_reward"] for s in report["steps"])
    assert report["selected"].startswith("Selected rollout recovery snapshot:")


def test_turn_recovery_after_sigkill_matches_the_reference(tmp_path):
    out = tmp_path / "turn"
    proc = subprocess.run(
        ["bash", str(REPO / "functional_tests" / "turn_recovery.sh"), "--out", str(out),
         "--steps", "2", "--max-tokens", "64", "--cuts", "2"],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "parity.json").read_text())
    assert report["violations"] == [] and report["level"] == "turn"
    assert report["restored_episodes"] >= 2 and report["restored_turn_tokens"] > 0
    assert all(s["same_batch"] and s["same_reward"] for s in report["steps"])
