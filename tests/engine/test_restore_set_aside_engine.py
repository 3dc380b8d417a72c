"""`train --restore` end to end when the newest snapshot's trainer checkpoint is missing: the
restore falls back to the previous snapshot, sets the skipped one aside with the old run's
trainer checkpoint and batches of its step, says where on the terminal and in the step log, and
trains on; every file set aside is still there, byte for byte, after the restored run's own
checkpoints and retention. The real engine on the finished run of the reduced crash campaign
(shared through tests/conftest.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rollout_recovery.testing.campaign.crash_points import JOB
from tests.engine.test_train_failures import _train, _tree

pytestmark = pytest.mark.engine


def test_a_restore_past_a_missing_trainer_checkpoint_keeps_what_it_skipped(crash_chain, tmp_path):
    work, result = crash_chain
    [case] = result.cases
    run_dir = tmp_path / "run"
    shutil.copytree(work / case.case / "run", run_dir)
    (run_dir / "trainer" / "step-000003" / "meta.json").unlink()  # step 3's checkpoint: gone
    newest = sorted((run_dir / "data_plane").glob("snapshot-*"))[-1]
    before = _tree(run_dir)
    mine = {rel: sha for rel, sha in before.items()
            if rel.startswith((f"data_plane/{newest.name}/", "trainer/step-000003/",
                               "batches/step-000003."))}  # fmt: skip
    assert f"data_plane/{newest.name}/MANIFEST.json" in mine and "batches/step-000003.arrow" in mine

    proc, _ = _train(run_dir, *JOB, "grpo.steps=4", restore=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    [where] = list((run_dir / "set_aside").iterdir())
    kept = _tree(where)
    lost = sorted(rel for rel, sha in mine.items() if kept.get(rel) != sha)
    assert lost == [], f"deleted or overwritten: {lost}"
    moved = where / "data_plane" / newest.name
    assert (f"Snapshot {newest} is unusable (its trainer checkpoint: the trainer checkpoint of "
            "step 3") in proc.stdout  # fmt: skip
    assert f"falling back to the previous one; set aside to {moved}\n" in proc.stdout
    assert f"Also set aside to {where}: " in proc.stdout
    events = [json.loads(ln) for ln in (run_dir / "steps.jsonl").read_text().splitlines()
              if '"event": "restore"' in ln]  # fmt: skip
    assert events[-1]["skipped"][0]["set_aside"] == str(moved) and events[-1]["step"] == 2
    steps = [json.loads(ln)["step"] for ln in (run_dir / "steps.jsonl").read_text().splitlines()
             if '"event"' not in ln]  # fmt: skip
    assert steps[-2:] == [3, 4] and (run_dir / "trainer" / "step-000004" / "meta.json").is_file()
    assert Path(run_dir / "trainer" / "step-000003").is_dir()  # written again by the restored run
