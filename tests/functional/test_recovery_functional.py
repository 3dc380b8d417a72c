"""The recovery functional tests at a small size (reference, SIGKILL, restore, parity)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.engine


def test_prefix_recovery_after_sigkills_at_two_steps_matches_the_reference(tmp_path):
    """Killed during step 0 (restored onto the base weights) and again during step 1 (onto a
    trainer checkpoint): the same batches, losses equal, the final trainer checkpoint the
    same bytes as the uninterrupted run's."""
    out = tmp_path / "prefix"
    proc = subprocess.run(
        [sys.executable, str(REPO / "functional_tests" / "recovery_check.py"), "--level",
         "prefix", "--out", str(out), "--steps", "2", "--max-tokens", "256", "--cuts", "2",
         "--kills", "2"],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "parity.json").read_text())
    assert report["violations"] == []
    assert [k["step"] for k in report["kills"]] == [0, 1]
    assert report["restored_calls"] >= 4 and report["restored_prefix_tokens"] > 0
    assert all(s["same_batch"] and s["same_reward"] and s["loss_abs_diff"] == 0
               for s in report["steps"])  # fmt: skip
    ckpt = report["final_trainer_checkpoint"]
    assert ckpt["reference"] == ckpt["recovered"]
    assert report["selected"] == [k["snapshot"] for k in report["kills"]]


def test_turn_recovery_with_checkpoints_on_s3_matches_the_reference(tmp_path):
    """checkpoint_dir on the local S3 server: snapshots, ledgers, trainer checkpoints and
    logs all through pyarrow.fs."""
    out = tmp_path / "turn"
    proc = subprocess.run(
        ["bash", str(REPO / "functional_tests" / "turn_recovery.sh"), "--out", str(out),
         "--steps", "2", "--max-tokens", "64", "--cuts", "2", "--storage", "s3"],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "parity.json").read_text())
    assert report["violations"] == [] and report["level"] == "turn"
    assert report["storage"] == "s3" and not (out / "recovered").exists()
    assert report["restored_episodes"] >= 2 and report["restored_turn_tokens"] > 0
    assert all(s["same_batch"] and s["same_reward"] for s in report["steps"])
