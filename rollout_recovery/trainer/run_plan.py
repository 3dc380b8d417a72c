"""Opening a run's location: claim it, and plan a restore from files before anything starts.

A fresh run claims the location only as its first owner (data_plane/ownership.py): a location
that holds a run, or that another run owns or is claiming at the same moment, is refused with
one line naming it. A restore first chooses, from files only, the newest usable snapshot
(selection.py) whose trainer checkpoint is the one its ledger paired with it
(trainer_checkpoints.py), the same base model, and unfinished episodes the first restored
step runs: a refusal is a RestoreError with one line and deletes nothing. Then it claims the
location (a new owner epoch: an older controller still running can no longer write there),
chooses again if a snapshot was published between the choice and the claim, and sets aside
each newer snapshot the choice skipped, with the old run's trainer checkpoints and batches of
the steps after the restored one (set_aside.py): the restored run's retention would delete
them and its steps overwrite them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rollout_recovery.config import RolloutRecoveryConfig
from rollout_recovery.controller import run_settings
from rollout_recovery.controller.selection import (
    DATA_PLANE,
    SnapshotChoice,
    SnapshotUnusable,
    check_model,
    read_ledger,
    run_has_state,
    select_snapshot,
)
from rollout_recovery.data_plane import SnapshotError, StagingStore
from rollout_recovery.data_plane.errors import OwnershipConflict
from rollout_recovery.data_plane.ownership import Fence, Owner
from rollout_recovery.data_plane.snapshot_io import published_uris
from rollout_recovery.errors import RestoreError, RunExistsError
from rollout_recovery.model_identity import base_model_identity, resolve_model_path
from rollout_recovery.protocol import Ledger, group_id, parse_group_id
from rollout_recovery.storage import RunStorage
from rollout_recovery.trainer import step_log, trainer_checkpoints
from rollout_recovery.trainer.set_aside import (
    RECORD,
    SetAside,
    restore_id,
    set_aside_skipped,
    snapshot_name,
)
from rollout_recovery.trainer.trainer_checkpoints import (
    TrainerCheckpoint,
    TrainerCheckpointError,
)


@dataclass
class RestorePlan:
    choice: SnapshotChoice
    step: int
    checkpoint: TrainerCheckpoint | None  # the paired one (None at step 0: the base weights)
    set_aside: SetAside | None = None  # where the skipped snapshots went (claim_restore)


def plan_restore(cfg: RolloutRecoveryConfig, storage: RunStorage) -> RestorePlan | None:
    """Choose the snapshot to restore and verify everything it needs, from files only: None
    when the location holds no work (no published snapshot and no trainer checkpoint: the run
    starts again from step 0, whatever else it left); RestoreError when it holds work that
    cannot be restored (the reasons listed, nothing deleted)."""
    identity = base_model_identity(cfg.policy.model_path, resolve_model_path(cfg.policy.model_path))

    def accept(uri: str, ledger: Ledger) -> dict:
        check_model(uri, ledger, identity)  # another model: refused outright
        try:
            paired = trainer_checkpoints.check_paired(storage, ledger.step,
                                                      ledger.trainer_checkpoint)  # fmt: skip
        except TrainerCheckpointError as err:
            raise SnapshotUnusable(f"its trainer checkpoint: {err}") from None
        return {"checkpoint": paired}

    rc = cfg.rollout_checkpointing
    root = storage.child_uri(DATA_PLANE)
    choice = select_snapshot(root, rc.restore_mode, cfg.rollout_recovery.target_level, accept)
    if choice is None:
        # No published snapshot. Without a trainer checkpoint either the run's records hold
        # no work (a step log, an unpublished snapshot's directory, ownership entries): the
        # restore starts it from step 0 as the next owner, its history kept (None).
        if "trainer checkpoints" in run_has_state(storage):
            raise RestoreError(
                f"{storage.display()} holds trainer checkpoints but no published snapshot to "
                "restore them with (checkpointing.save_data_plane=true keeps them); nothing "
                "was deleted. Start a new run on purpose in another checkpointing.checkpoint_dir"
            )
        return None
    diff = run_settings.changed(choice.ledger.settings, cfg)
    if diff:
        raise RestoreError(run_settings.refusal(storage.display(), snapshot_name(choice.snapshot),
                                                diff))  # fmt: skip
    step = choice.ledger.step
    if step >= cfg.grpo.steps:
        repaired = step_log.complete(storage, step)
        raise RestoreError(
            f"the run in {storage.display()} already finished its {step} steps "
            f"(grpo.steps={cfg.grpo.steps}); raise grpo.steps to train it further, or start a "
            "new run in another checkpointing.checkpoint_dir"
            + (f" (step {step}'s log line, lost to a crash, was written from its trainer "
               "checkpoint)" if repaired else "")
        )  # fmt: skip
    check_claimed(cfg, choice, step)
    return RestorePlan(choice, step, choice.extra.get("checkpoint"))


def check_claimed(cfg: RolloutRecoveryConfig, choice: SnapshotChoice, step: int) -> None:
    """Every unfinished episode of the snapshot belongs to a group the first restored step
    submits: one it does not would wait for a step that never comes (a restore that hands
    episodes to no one), so the restore is refused before anything starts."""
    g = cfg.grpo
    groups = {group_id(step, i) for i in range(g.prompts_per_step)}
    n = g.generations_per_prompt

    def runs(group: str) -> bool:
        if not g.async_grpo.enabled:
            return group in groups
        # Asynchronous GRPO: the producer starts the groups its cursor holds open and those
        # dispatched after it, of any producer step (producer.py).
        parsed = parse_group_id(group)
        return parsed is not None and parsed[1] < g.prompts_per_step

    orphans = [e for e in choice.ledger.episodes if not runs(e.group_id) or e.generation_index >= n]
    if orphans:
        e, many = orphans[0], "s" if len(orphans) > 1 else ""
        raise RestoreError(
            f"snapshot {choice.snapshot} holds {len(orphans)} unfinished episode{many} that "
            f"step {step} would not run (e.g. {e.rollout_id}: generation {e.generation_index} "
            f"of group {e.group_id}, with grpo.prompts_per_step={g.prompts_per_step} and "
            f"grpo.generations_per_prompt={g.generations_per_prompt}); restore with the grpo "
            "settings the run was started with (nothing was deleted)"
        )


def claim_fresh(storage: RunStorage) -> Owner:
    """Claim an empty location as its first owner; RunExistsError (one line) when it holds a
    run, or another run owns it or is claiming it at the same moment."""
    found = run_has_state(storage)
    if found:
        raise RunExistsError(
            f"checkpointing.checkpoint_dir={storage.display()} already holds a run "
            f"({', '.join(found)}); continue it with `train --restore` once the process that "
            "wrote it has stopped (a restore takes the run over and fences a copy still "
            "running), or choose another checkpointing.checkpoint_dir (nothing was deleted)"
        )
    try:  # only as the location's first owner: another run may own it or be starting
        return StagingStore.claim(storage.child_uri(DATA_PLANE), first=True)
    except OwnershipConflict as err:
        raise RunExistsError(
            f"checkpointing.checkpoint_dir={storage.display()}: {err}; continue that run with "
            "`train --restore` once it has stopped, or choose another "
            "checkpointing.checkpoint_dir (nothing was deleted)"
        ) from None


def claim_restore(
    cfg: RolloutRecoveryConfig, storage: RunStorage
) -> tuple[RestorePlan | None, Owner]:
    """Choose what to restore (files only: a refusal changes nothing), claim the location (an
    older controller can no longer write there), choose again if a snapshot was published
    meanwhile, and set aside each newer snapshot the choice skipped, with the old run's
    trainer checkpoints and batches of the steps after the restored one. A failed move
    refuses the restore (RestoreError), deleting nothing."""
    root = storage.child_uri(DATA_PLANE)
    seen = _published(root)
    plan = plan_restore(cfg, storage)  # files only: a refusal changes nothing
    owner = StagingStore.claim(root)  # from here on an older controller cannot publish
    if seen is None or _published(root) != seen:
        plan = plan_restore(cfg, storage)  # its last publication landed meanwhile
    if plan is not None and plan.choice.skipped:
        also = _after_step(storage, plan.step)
        mine = storage.fenced(Fence.of(root, owner))
        plan.set_aside = set_aside_skipped(mine, plan.choice, also, restore_id(owner.epoch))
    return plan, owner


def _published(root: str) -> list[str] | None:
    """The published snapshots under root (None when they cannot be listed)."""
    try:
        return published_uris(root)
    except SnapshotError:
        return None


_STEP_RE = re.compile(r"(?:^|/)step-(\d+)")  # trainer/step-NNNNNN/..., batches/step-NNNNNN.*


def _after_step(storage: RunStorage, step: int) -> list[str]:
    """The trainer checkpoints and batches of steps after `step`, relative to the location:
    the restored run writes them again."""
    found = [f"{d}/{n}" for d in ("trainer", "batches") for n in storage.list_dir(d)]
    return [rel for rel in found if (m := _STEP_RE.search(rel)) and int(m.group(1)) > step]


def announce(storage: RunStorage, plan: RestorePlan) -> None:
    """Say what the restore chose and skipped, and where the skipped went, on the terminal and
    in the step log."""
    aside = plan.set_aside
    went = aside.snapshots if aside is not None else {}
    skipped = []

    def shown(uri: str) -> str:  # as messages show a location: without credentials
        return storage.display(f"{DATA_PLANE}/{snapshot_name(uri)}")

    for uri, reason in plan.choice.skipped:
        line = f"Snapshot {shown(uri)} is unusable ({reason}); falling back to the previous one"
        if uri in went:
            line += f"; set aside to {went[uri]}"
        print(line, flush=True)
        skipped.append({"snapshot": uri, "reason": reason}
                       | ({"set_aside": went[uri]} if uri in went else {}))  # fmt: skip
    if aside is not None and aside.files:
        steps = sorted({int(m.group(1)) for f in aside.files if (m := _STEP_RE.search(f))})
        print(f"Also set aside to {aside.shown}: the old run's trainer checkpoints and batches "
              f"of step{'s' * (len(steps) > 1)} {', '.join(map(str, steps))}, which the restored "
              f"run would overwrite ({RECORD} lists every file)", flush=True)  # fmt: skip
    print(f"Selected rollout recovery snapshot: {shown(plan.choice.snapshot)}", flush=True)
    event = {"event": "restore", "snapshot": plan.choice.snapshot, "step": plan.step,
             "skipped": skipped}  # fmt: skip
    if aside is not None:
        event["set_aside"] = {"where": aside.shown, "files": aside.files}
    step_log.append(storage, event)


def started_again(storage: RunStorage, owner: Owner, left: list[str]) -> None:
    """A restore of a location that holds no work: say so, and log it when the location has
    a history (its step log keeps the earlier lines)."""
    if not left:
        print(f"Nothing to restore under {storage.display()}: starting from step 0", flush=True)
        return
    print(f"No published snapshot or trainer checkpoint under {storage.display()} (it holds "
          f"{', '.join(left)}): the run starts again from step 0 as owner epoch {owner.epoch}, "
          "its history kept", flush=True)  # fmt: skip
    step_log.append(storage, {"event": "started_again", "step": 0, "epoch": owner.epoch,
                              "held": left})  # fmt: skip


def paired_steps(storage: RunStorage) -> list[int] | None:
    """The steps of the published snapshots (None when they cannot be listed: prune nothing)."""
    paired = []
    try:
        for uri in published_uris(storage.child_uri(DATA_PLANE)):
            try:
                paired.append(read_ledger(uri).step)
            except SnapshotUnusable:
                continue
    except SnapshotError:
        return None
    return paired
