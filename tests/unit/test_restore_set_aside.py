"""A restore that skips a newer snapshot (its trainer checkpoint missing or of other weights)
sets it aside under `<checkpoint_dir>/set_aside/`, with the old run's trainer checkpoints and
batches of the steps after the restored one, so the restored run's retention cannot delete it
and its steps cannot overwrite them; the restore line says where each went. A move that fails
refuses the restore and deletes nothing; a restore that skips nothing moves nothing.

No Ray, no engine: snapshots are published the way the store publishes them (data file,
ledger sidecar, manifest, publish entry in the ownership log) and trainer checkpoints are a
small torch module's, written by the driver's own checkpoint code; the restored run's steps
are simulated with the driver's own retention (snapshots and trainer checkpoints).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from rollout_recovery.config import load_config
from rollout_recovery.controller.selection import DATA_PLANE, LEDGER, select_snapshot
from rollout_recovery.data_plane import retention
from rollout_recovery.data_plane.filesystem import join, resolve
from rollout_recovery.data_plane.schemas import row_kind, schema_version
from rollout_recovery.data_plane.snapshot_io import (
    FileEntry,
    ManifestBody,
    new_snapshot_dir,
    now_iso,
    publish_manifest,
    write_sidecar,
    write_table_checksummed,
)
from rollout_recovery.errors import RestoreError
from rollout_recovery.protocol import Ledger, ServedModel
from rollout_recovery.storage import RunStorage
from rollout_recovery.testing.campaign.snapshot_files import replay_rows
from rollout_recovery.trainer import run_plan, trainer_checkpoints
from rollout_recovery.trainer.set_aside import RECORD, SET_ASIDE_DIR
from rollout_recovery.training.checkpoint import load_state, state_files

MODEL_PATH = "hf://org/tiny"  # a hub model is identified by its name: nothing to load
KEEP = 2  # rollout_checkpointing.keep_latest_k


def config(uri: str):
    return load_config(None, [f"checkpointing.checkpoint_dir={uri}",
                              f"policy.model_path={MODEL_PATH}", "grpo.steps=10",
                              f"rollout_checkpointing.keep_latest_k={KEEP}"])  # fmt: skip


class Run:
    """A run's location, written step by step as the driver writes it (batches, trainer
    checkpoint, snapshot, then retention), without Ray or an engine."""

    def __init__(self, uri: str, seed: int = 0) -> None:
        self.storage = RunStorage(uri)
        self.fs, self.root = resolve(self.storage.child_uri(DATA_PLANE))
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(4, 3)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.last: tuple[str, list[FileEntry]] | None = None  # the newest snapshot's files
        self.settings: dict = {}  # the ledgers' run settings (controller/run_settings.py)

    def step(self, step: int, owner, tag: str, incremental: bool = False) -> str:
        """Train one step and checkpoint it; returns the snapshot's directory name."""
        loss = self.model(torch.ones(2, 4)).pow(2).sum()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        batch = f"batches/step-{step:06d}"
        self.storage.write_bytes(f"{batch}.arrow", f"{tag} batch {step}".encode())
        self.storage.write_bytes(f"{batch}.results.json", f'{{"{tag}": 1}}'.encode())
        files = state_files(self.model, self.opt)
        meta = trainer_checkpoints.save(self.storage, step, files, {"data_cursor": step},
                                        {"step": step, "tag": tag})  # fmt: skip
        name = self.snapshot(step, meta["digest"], owner, incremental)
        retention.gc(self.fs, self.root, KEEP, owner)
        trainer_checkpoints.prune(self.storage, KEEP, run_plan.paired_steps(self.storage))
        return name

    def snapshot(self, step: int, paired: str, owner, incremental: bool = False) -> str:
        seq, path = new_snapshot_dir(self.fs, self.root)
        name = path.rsplit("/", 1)[1]
        table = replay_rows([f"s{step}-{seq}-r{i}" for i in range(3)])
        sha, size = write_table_checksummed(self.fs, join(path, "shard-000/replay.0000.arrow"),
                                            table)  # fmt: skip
        kind = row_kind(table.schema)
        own = FileEntry(path="shard-000/replay.0000.arrow", partition="replay", shard=0,
                        row_kind=kind, schema_version=schema_version(table.schema),
                        rows=table.num_rows, bytes=size, sha256=sha)  # fmt: skip
        files, base = [own], None
        if incremental and self.last is not None:
            base, earlier = self.last
            files = [f if f.snapshot else f.model_copy(update={"snapshot": base})
                     for f in earlier] + [own]  # fmt: skip
        ledger = Ledger(step=step, weight_version=step, reason="trainer_checkpoint", level="none",
                        model=ServedModel(base={"path": MODEL_PATH, "sha256": None},
                                          weight_version=step, weights_sha256=None),
                        trainer_checkpoint=paired, settings=self.settings)  # fmt: skip
        sidecar = write_sidecar(self.fs, path, LEDGER, ledger.to_json())
        body = ManifestBody(snapshot_id=name.rsplit("-", 1)[1], seq=seq, created_at=now_iso(),
                            num_shards=1, partitions={"replay": kind}, files=files, leases=[],
                            payload_bytes=sum(f.bytes for f in files), sidecars=[sidecar],
                            meta={"trainer_step": str(step), "reason": "trainer_checkpoint"},
                            base=base, chain_length=2 if base else 1)  # fmt: skip
        publish_manifest(self.fs, path, body, owner=owner)
        self.last = (name, files)
        return name


def tree(root: Path) -> dict[str, str]:
    """Every file under root (relative) with its sha256."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip


def old_run(uri: str, broken: str) -> tuple[Run, str]:
    """Three steps; step 3's snapshot is incremental (it reads step 2's data file), and then
    step 3's trainer checkpoint is made `missing` (no meta.json) or `differs` (other weights
    than the snapshot's calls were decoded with). Returns the run and step 3's snapshot."""
    from rollout_recovery.data_plane import StagingStore

    run = Run(uri)
    owner = StagingStore.claim(run.storage.child_uri(DATA_PLANE))
    for step in (1, 2):
        run.step(step, owner, "old")
    newest = run.step(3, owner, "old", incremental=True)
    if broken == "missing":
        run.storage.delete_file("trainer/step-000003/meta.json")
    else:
        other = Run(uri, seed=1)
        for _ in range(3):
            other.model.weight.data += 1.0
        trainer_checkpoints.save(run.storage, 3, state_files(other.model, other.opt), {}, None)
    return run, newest


@pytest.mark.parametrize("broken", ["missing", "differs"])
def test_a_skipped_newer_snapshot_is_set_aside_and_outlives_the_restored_runs_retention(
    tmp_path, capsys, broken
):
    run_dir = tmp_path / "run"
    run, newest = old_run(str(run_dir), broken)
    before = tree(run_dir)
    mine = {rel: sha for rel, sha in before.items()  # what belongs to the skipped snapshot
            if rel.startswith((f"{DATA_PLANE}/{newest}/", "trainer/step-000003/",
                               "batches/step-000003."))}  # fmt: skip
    assert f"{DATA_PLANE}/{newest}/MANIFEST.json" in mine and "batches/step-000003.arrow" in mine

    plan, owner = run_plan.claim_restore(config(str(run_dir)), run.storage)
    [(skipped, reason)] = plan.choice.skipped
    assert plan.step == 2 and skipped == str(run_dir / DATA_PLANE / newest)
    assert "trainer checkpoint" in reason
    run_plan.announce(run.storage, plan)
    out = capsys.readouterr().out.splitlines()

    # The restored run: steps 3 to 6 with two snapshots kept, as the driver runs them.
    load_state(plan.checkpoint.files, run.model, run.opt)
    for step in range(3, 7):
        run.step(step, owner, "restored")
    assert len(list((run_dir / DATA_PLANE).glob("snapshot-*"))) == KEEP

    aside = run_dir / SET_ASIDE_DIR  # every file of it still there, byte for byte
    kept = {rel.split("/", 1)[1]: sha for rel, sha in tree(aside).items()}
    lost = sorted(rel for rel, sha in mine.items() if kept.get(rel) != sha)
    assert lost == [], f"deleted or overwritten: {lost}"
    [where] = list(aside.iterdir())
    assert where.name.endswith(f"-epoch-{owner.epoch}")
    assert not (run_dir / DATA_PLANE / newest).exists()
    moved = where / DATA_PLANE / newest
    line = next(ln for ln in out if ln.startswith(f"Snapshot {skipped} is unusable"))
    assert "falling back to the previous one" in line and line.endswith(f"set aside to {moved}")
    also = next(ln for ln in out if ln.startswith(f"Also set aside to {where}: "))
    assert "batches of step 3, which the restored run would overwrite" in also and RECORD in also
    event = json.loads((run_dir / "steps.jsonl").read_text().splitlines()[0])
    assert event["skipped"][0] == {"snapshot": skipped, "reason": reason, "set_aside": str(moved)}

    # The place set aside reads as a run's location: the snapshot is published there (its
    # publish entry copied) and verifies on its own (the file it reads from step 2's snapshot,
    # which retention has deleted from the run since, copied).
    choice = select_snapshot(str(where / DATA_PLANE), "latest", "none")
    assert choice.snapshot == str(moved) and choice.skipped == [] and choice.ledger.step == 3
    record = json.loads((where / RECORD).read_text())
    assert record["restored"]["step"] == 2 and record["snapshots"][0]["name"] == newest
    [copied] = record["snapshots"][0]["reads_copied"]
    assert not (run_dir / copied).exists() and (where / copied).is_file()


def test_a_restore_that_skips_nothing_moves_nothing(tmp_path, capsys):
    """Also not the trainer checkpoint of a step whose snapshot a crash prevented: the
    restored run writes that step again, as before."""
    run_dir = tmp_path / "run"
    run, _ = old_run(str(run_dir), "missing")
    run.storage.delete_dir(f"{DATA_PLANE}/{run.last[0]}")  # step 3's snapshot never written
    before = tree(run_dir)
    plan, _ = run_plan.claim_restore(config(str(run_dir)), run.storage)
    assert plan.step == 2 and plan.choice.skipped == [] and plan.set_aside is None
    run_plan.announce(run.storage, plan)
    selected = f"Selected rollout recovery snapshot: {plan.choice.snapshot}\n"
    assert capsys.readouterr().out == selected  # as before
    after = tree(run_dir)
    assert not (run_dir / SET_ASIDE_DIR).exists()
    assert {k: v for k, v in after.items() if k in before} == before  # nothing moved or changed
    event = json.loads((run_dir / "steps.jsonl").read_text().splitlines()[-1])
    assert event == {"event": "restore", "snapshot": plan.choice.snapshot, "step": 2,
                     "skipped": []}  # fmt: skip


def test_a_move_that_fails_refuses_the_restore_and_deletes_nothing(tmp_path):
    from rollout_recovery.testing.faultfs import fault_filesystem

    run_dir = tmp_path / "run"
    run, newest = old_run(str(run_dir), "differs")
    before = tree(run_dir)
    run.storage.fs = fault_filesystem(run.storage.fs, tmp_path / "faultfs", object_store=False)
    run.storage.fs.handler.fail("move", f"*/{newest}/MANIFEST.json")  # moved last: all else was
    with pytest.raises(RestoreError) as info:
        run_plan.claim_restore(config(str(run_dir)), run.storage)
    msg = str(info.value)
    assert "\n" not in msg and newest in msg and "Input/output error" in msg
    assert "what was moved was moved back, nothing was deleted" in msg and "--restore" in msg
    after = tree(run_dir)
    claim = [k for k in after if k not in before]
    assert len(claim) == 1 and claim[0].startswith(f"{DATA_PLANE}/ownership/")  # the claim only
    assert {k: after[k] for k in before} == before
    assert list((run_dir / SET_ASIDE_DIR).iterdir()) == []
