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
from rollout_recovery.protocol import EpisodeRecord
from rollout_recovery.storage import RunStorage

if TYPE_CHECKING:  # the facade calls in; this module never imports it at load time
    from rollout_recovery.api import RolloutRecovery

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


def restore_run(rr: RolloutRecovery, snapshot: str | None, mode: str | None) -> dict | None:
    """Restore `rr`'s store and its environment's episodes from `snapshot`, or from the newest
    usable one by `mode`; the ledger as a dict (with `snapshot`, the newer `skipped` ones and
    why, and what the `token_log` added), or None when nothing was ever published."""
    restore_id = f"restore-{time.time_ns()}"
    rr.env.begin_restore(restore_id)  # refused once calls were served
    episodes: list[EpisodeRecord] = []
    try:
        where = (rr.coordinator.cfg, rr.store, rr.coordinator.snapshot_root)
        chosen = restore_snapshot(*where, rr.state.model, snapshot, mode)
        if chosen is None:
            return None
        episodes = chosen.ledger.episodes
        token_log = _extend_and_log(rr, restore_id, chosen.snapshot, episodes,
                                    chosen.ledger.weight_version)  # fmt: skip
    finally:
        rr.env.end_restore(restore_id, episodes)
    rr.state.step = chosen.ledger.step
    rr.state.trainer_checkpoint = chosen.ledger.trainer_checkpoint
    return chosen.ledger.model_dump(mode="json") | {"snapshot": chosen.snapshot,
                                                    "skipped": chosen.skipped,
                                                    "token_log": token_log}  # fmt: skip


def _extend_and_log(
    rr: RolloutRecovery, restore_id: str, snapshot: str, episodes: list[EpisodeRecord],
    weight_version: int,
) -> dict:  # fmt: skip
    """Extend the restored calls in flight from the token log (with tokens of the restored
    weights or older), counted and logged to RESTORES_LOG (a failed write loses only
    evidence, never the restore)."""
    tc = rr.cfg.token_capture
    if not tc.log_uri or not episodes:
        return {}
    ext = extend_from_token_log(episodes, rr.store, tc.staging_partition, tc.log_uri,
                                weight_version)  # fmt: skip
    for name, n in ext.counts.items():
        rr.metrics.add(name, n)
    line = {"restore_id": restore_id, "snapshot": snapshot, "token_log": ext.calls,
            "counts": dict(ext.counts)}  # fmt: skip
    with contextlib.suppress(OSError):
        rr.storage.append_line(RESTORES_LOG, json.dumps(line))
    return ext.calls
