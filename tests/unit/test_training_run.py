"""TrainingRun's own refusals, before any engine: a step begun before the restored trainer
state's weights were pushed (the restored calls would continue with other weights), and a
step's calls made outside a step. The whole loop runs on real engines in the own-loop and
two-owner functional checks (functional_tests/own_loop_recovery.sh, two_owners.py)."""

from __future__ import annotations

import pytest

from rollout_recovery.config import load_config
from rollout_recovery.controller.selection import DATA_PLANE, SnapshotChoice
from rollout_recovery.data_plane import StagingStore
from rollout_recovery.data_plane.ownership import Fence
from rollout_recovery.errors import RecoveryError, RunExistsError
from rollout_recovery.protocol import Ledger, ServedModel
from rollout_recovery.run import TrainingRun
from rollout_recovery.storage import RunStorage
from rollout_recovery.trainer.run_plan import RestorePlan
from rollout_recovery.trainer.trainer_checkpoints import TrainerCheckpoint


def _run(tmp_path, plan: RestorePlan | None) -> TrainingRun:
    storage = RunStorage(str(tmp_path / "run"))
    root = storage.child_uri(DATA_PLANE)
    owner = StagingStore.claim(root, first=True)
    cfg = load_config(None, [f"checkpointing.checkpoint_dir={tmp_path / 'run'}",
                             "policy.model_path=hf://org/tiny"])  # fmt: skip
    return TrainingRun(cfg, storage.fenced(Fence.of(root, owner)), owner, plan)


def test_a_step_before_the_restored_weights_are_pushed_is_refused(tmp_path):
    ledger = Ledger(step=2, weight_version=2, reason="cadence", level="prefix",
                    model=ServedModel(base={"path": "hf://org/tiny"}, weight_version=2,
                                      weights_sha256="ab" * 32))  # fmt: skip
    checkpoint = TrainerCheckpoint(2, {"w": b"x"}, {}, "cd" * 32)
    run = _run(tmp_path, RestorePlan(SnapshotChoice("snap", ledger), 2, checkpoint))
    assert run.start_step == 2 and run.checkpoint is checkpoint and run.weight_version == 2
    assert run.weights_dir == tmp_path / "run" / "weights" / "epoch-000001"
    with pytest.raises(RecoveryError) as info:
        run.begin_step(2)
    assert str(info.value).startswith("run.checkpoint holds the trainer state of step 2: load it")
    assert "run.push_weights()" in str(info.value)


def test_a_steps_calls_outside_a_step_are_refused(tmp_path):
    run = _run(tmp_path, None)
    assert run.start_step == 0 and run.checkpoint is None
    for call in (lambda: run.take_batch([]), lambda: run.save_checkpoint({"w": b"x"})):
        with pytest.raises(RecoveryError, match=r"call run.begin_step\(step\) first"):
            call()


def test_a_second_fresh_run_on_a_claimed_location_is_refused_naming_the_owner(tmp_path):
    from rollout_recovery.trainer.run_plan import claim_fresh

    storage = RunStorage(str(tmp_path / "run"))
    claim_fresh(storage)
    with pytest.raises(RunExistsError) as info:
        claim_fresh(storage)
    assert "is owned by another run: epoch 1" in str(info.value) and "\n" not in str(info.value)
