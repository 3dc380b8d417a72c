"""The trainer's parts behind TrainingRun: the weights directory and its version rule
(trainer/weights.py), and one step's figures (trainer/step_figures.py)."""

from __future__ import annotations

from types import SimpleNamespace

from rollout_recovery.controller.selection import DATA_PLANE
from rollout_recovery.data_plane import StagingStore
from rollout_recovery.protocol import GroupResult
from rollout_recovery.storage import RunStorage
from rollout_recovery.trainer.step_figures import StepFigures
from rollout_recovery.trainer.weights import RunWeights


class _Controller:
    def __init__(self) -> None:
        self.pushes: list[tuple] = []

    def push_weights(self, weights_dir, version, expect_sha256, in_flight=True) -> int:
        self.pushes.append((version, expect_sha256, in_flight))
        return 7 if version is None else version


def _ledger(version: int) -> SimpleNamespace:
    return SimpleNamespace(weight_version=version, model=SimpleNamespace(weights_sha256="ab" * 32))


def test_the_first_push_after_a_restore_re_establishes_the_snapshots_weights(tmp_path):
    storage = RunStorage(str(tmp_path / "run"))
    owner = StagingStore.claim(storage.child_uri(DATA_PLANE), first=True)
    weights = RunWeights(storage, owner, _ledger(3), due=True)
    assert weights.due and weights.version == 3
    assert weights.dir.name == f"epoch-{owner.epoch:06d}" and weights.dir.is_dir()
    ctl = _Controller()
    assert weights.push(ctl, in_flight=False) == 3
    assert weights.push(ctl, in_flight=False) == 7  # then the next version, as any push
    assert ctl.pushes == [(3, "ab" * 32, True), (None, None, False)]
    assert not weights.due


def test_a_restore_without_a_trainer_checkpoint_pushes_nothing_first(tmp_path):
    storage = RunStorage(str(tmp_path / "run"))
    owner = StagingStore.claim(storage.child_uri(DATA_PLANE), first=True)
    weights = RunWeights(storage, owner, _ledger(0), due=False)
    assert not weights.due and weights.version == 0


def test_a_newer_owners_weights_directory_replaces_the_older_ones(tmp_path):
    storage = RunStorage(str(tmp_path / "run"))
    first = RunWeights(storage, StagingStore.claim(storage.child_uri(DATA_PLANE)), None, False)
    (first.dir / "model.safetensors").write_bytes(b"old")
    second = RunWeights(storage, StagingStore.claim(storage.child_uri(DATA_PLANE)), None, False)
    assert second.dir != first.dir and not first.dir.exists()


def test_a_steps_line_counts_its_own_increments():
    fig = StepFigures(4, before={"calls": 10.0, "resumed": 2.0})
    fig.generated([GroupResult("g", [], [], 30, []), GroupResult("h", [], [], 12, [])])
    fig.batch_digest, fig.wait_s = "d", 0.5
    line = fig.line(5, {"loss": 0.1}, weight_version=2, push_s=0.25,
                    counters={"calls": 25.0, "resumed": 2.0, "new": 1.0})  # fmt: skip
    assert line["step"] == 5 and line["loss"] == 0.1 and line["generated_tokens"] == 42
    assert line["calls"] == 15.0 and line["resumed"] == 0.0 and line["new"] == 1.0
    assert (line["weight_version"], line["push_s"], line["batch_digest"]) == (2, 0.25, "d")
    assert line["trainer_wait_s"] == 0.5 and line["tokens_per_s"] > 0
