"""A whole-job restore, as the controller runs it: the fresh environment closes admission (it
refuses once it served calls), the store is restored from the chosen snapshot (selection.py),
each call in flight continues from the newer of its snapshot cut and its token log
(token_log_restore.py), and the environment takes the episodes back, also when a step failed, so
it is never left closed. What each restore took from the token log is appended to
`restores.jsonl`, the evidence a recovery check reads.

Where the token log lives is set here too, so the workers append where a restore reads.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import TYPE_CHECKING

from rollout_recovery.config import RolloutRecoveryConfig
from rollout_recovery.controller.selection import restore_snapshot
from rollout_recovery.controller.token_log_restore import extend_from_token_log
from rollout_recovery.data_plane import SnapshotError, ownership
from rollout_recovery.data_plane.filesystem import resolve
from rollout_recovery.data_plane.ownership import Owner
from rollout_recovery.protocol import EpisodeRecord
from rollout_recovery.storage import RunStorage

if TYPE_CHECKING:  # the job's module imports this one
    from rollout_recovery.controller.job import Job

TOKEN_LOG_DIR = "token_log"  # under the checkpoint dir (data_plane/token_log_segments.py)
RESTORES_LOG = "restores.jsonl"  # per restore: what each call took from the token log


def with_token_log_uri(cfg: RolloutRecoveryConfig) -> RolloutRecoveryConfig:
    """`cfg`, or a copy whose token log is under the checkpoint dir when the token log is on and
    kept with the run's data plane: the workers append segments there, a restore reads them."""
    tc = cfg.token_capture
    log_on = tc.log_interval_tokens is not None or tc.log_interval_s is not None
    if not (log_on and tc.log_storage and cfg.checkpointing.save_data_plane):
        return cfg
    cfg = cfg.model_copy(deep=True)
    cfg.token_capture.log_uri = RunStorage(cfg.checkpointing.checkpoint_dir).child_uri(
        TOKEN_LOG_DIR
    )
    return cfg


def restore_run(job: Job, snapshot: str | None, mode: str | None) -> dict | None:
    """Restore `job`'s store and its environment's episodes from `snapshot`, or from the newest
    usable one by `mode`; the ledger as a dict (with `snapshot`, the newer `skipped` ones and
    why, and what the `token_log` added), or None when nothing was ever published."""
    restore_id = f"restore-{time.time_ns()}"
    job.env.begin_restore(restore_id)  # refused once calls were served
    episodes: list[EpisodeRecord] = []
    step = 1
    try:
        where = (job.coordinator.cfg, job.store, job.coordinator.snapshot_root)
        chosen = restore_snapshot(*where, job.state.model, snapshot, mode)
        if chosen is None:
            return None
        episodes = chosen.ledger.episodes
        step = attempt_step(job.coordinator.snapshot_root, chosen.snapshot, job.owner)
        token_log = _extend_and_log(job, restore_id, chosen.snapshot, episodes,
                                    chosen.ledger.weight_version)  # fmt: skip
    finally:
        job.env.end_restore(restore_id, episodes, step)
    job.state.checkpointed(chosen.ledger.step, chosen.ledger.trainer_checkpoint)
    return chosen.ledger.model_dump(mode="json") | {"snapshot": chosen.snapshot,
                                                    "skipped": chosen.skipped,
                                                    "token_log": token_log}  # fmt: skip


def attempt_step(root: str, snapshot: str, owner: Owner | None) -> int:
    """How far a restore moves each restored episode's attempt past its record's: the owner
    epochs between the snapshot's publisher and this restore (at least 1). Two restores of one
    snapshot claim different epochs, so their attempts differ and the engines keep one record
    per attempt, never two tries merged into one (the attempt minus the epoch stays the same
    along a run's restores)."""
    if owner is None or owner.epoch == 0:
        return 1
    name = snapshot.split("?")[0].rstrip("/").rsplit("/", 1)[-1]
    try:
        fs, path = resolve(root)
        published = ownership.read_log(fs, path).publications().get(name)
    except (OSError, SnapshotError, ValueError):  # unreadable now: it was read to choose it
        published = None
    if published is None:
        return 1
    return max(1, owner.epoch - published[1].epoch)


def _extend_and_log(
    job: Job, restore_id: str, snapshot: str, episodes: list[EpisodeRecord],
    weight_version: int,
) -> dict:  # fmt: skip
    """Extend the restored calls in flight from the token log (with tokens of the restored
    weights or older), counted and logged to RESTORES_LOG (a failed write loses only
    evidence, never the restore)."""
    tc = job.cfg.token_capture
    # Below prefix level a restore keeps no call in flight (level table, docs/restore.md):
    # the token log then serves only moves off a dead worker within the run.
    if not tc.log_uri or not episodes or job.cfg.rollout_recovery.target_level != "prefix":
        return {}
    ext = extend_from_token_log(episodes, job.store, tc.staging_partition, tc.log_uri,
                                weight_version)  # fmt: skip
    for name, n in ext.counts.items():
        job.metrics.add(name, n)
    line = {"restore_id": restore_id, "snapshot": snapshot, "token_log": ext.calls,
            "counts": dict(ext.counts)}  # fmt: skip
    with contextlib.suppress(OSError):
        job.storage.append_line(RESTORES_LOG, json.dumps(line))
    return ext.calls
