"""Choosing what to restore, and refusing a restore that would corrupt or destroy a run.

Every check here reads only files, so a refusal comes before any worker starts and before any
model is loaded, and it deletes nothing. The newest published snapshot that verifies (manifest,
sidecars and every data file against their sha256), whose ledger is readable and whose paired
trainer checkpoint verifies is chosen; each newer one that does not is reported with its
reason. When snapshots exist but none is usable, the restore is refused with the list: it never
silently starts the run over (that would overwrite the old run's checkpoints and let retention
delete its snapshots).

A snapshot records the model that decoded its tokens (`model_identity`); a restore with another
model is refused, since its in-flight calls would be continued by other weights.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import ValidationError

from rollout_recovery.config import CheckpointCoordinatorConfig
from rollout_recovery.data_plane import SnapshotError, StagingStore
from rollout_recovery.data_plane.filesystem import child_uri
from rollout_recovery.data_plane.snapshot_io import list_snapshot_dirs
from rollout_recovery.errors import RestoreError
from rollout_recovery.protocol import LEDGER_FORMAT, Ledger
from rollout_recovery.storage import RunStorage

LEDGER = "ledger.json"
LEVELS = ("none", "turn", "prefix")
DATA_PLANE = "data_plane"


class SnapshotUnusable(Exception):
    """A snapshot cannot be restored; `str()` is the reason (reported, then the previous one
    is tried)."""


@dataclass
class SnapshotChoice:
    snapshot: str
    ledger: Ledger
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (uri, reason), newest first
    extra: dict = field(default_factory=dict)  # what `accept` returned for the chosen one


def read_ledger(uri: str) -> Ledger:
    """The snapshot's verified ledger; SnapshotUnusable when it is unreadable or too old."""
    try:
        ledger = json.loads(StagingStore.read_sidecar(uri, LEDGER))
    except SnapshotError as err:
        raise SnapshotUnusable(str(err)) from None
    except ValueError:
        raise SnapshotUnusable(f"its {LEDGER} is not JSON") from None
    if not isinstance(ledger, dict) or ledger.get("format") != LEDGER_FORMAT:
        got = ledger.get("format") if isinstance(ledger, dict) else None
        raise SnapshotUnusable(
            f"its ledger has format {got!r}, this version restores format {LEDGER_FORMAT} "
            "(format 2 ledgers predate the model identity a restore must check)"
        )
    try:
        return Ledger.model_validate(ledger)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise SnapshotUnusable(f"its ledger is malformed at `{where}`: {first['msg']}") from None


def select_snapshot(
    root_uri: str,
    mode: str,
    level: str,
    accept: Callable[[str, Ledger], dict] | None = None,
) -> SnapshotChoice | None:
    """The newest usable snapshot under `root_uri` (`mode="trainer_checkpoint"`: among those
    taken right after a trainer checkpoint). `accept(uri, ledger)` may add checks (raising
    SnapshotUnusable to fall back) and returns extra facts for the chosen one. Returns None when
    nothing is published; raises RestoreError when snapshots exist and none is usable, or when
    the newest usable one holds finer-level state than `level`. A directory whose manifest is
    in place but that the ownership log does not count as published (its controller stopped or
    was fenced before publishing, or its log entry is damaged) is reported as skipped."""
    try:
        dirs, _ = list_snapshot_dirs(root_uri)
    except SnapshotError as err:
        raise RestoreError(f"cannot list snapshots under {root_uri}: {err}") from None
    skipped: list[tuple[str, str]] = []
    for found in reversed(dirs):
        if not found.has_manifest:
            continue  # an attempt that never wrote its manifest
        uri = child_uri(root_uri, found.name)
        if not found.published:  # a manifest, but no (valid, unfenced) ownership log entry
            skipped.append((uri, found.why or "not published"))
            continue
        try:
            manifest = StagingStore.verify(uri, use_cache=False)
            if mode == "trainer_checkpoint" and manifest.body.meta.get("reason") != (
                "trainer_checkpoint"
            ):
                continue
            ledger = read_ledger(uri)
            extra = accept(uri, ledger) if accept is not None else {}
        except (SnapshotError, SnapshotUnusable) as err:
            skipped.append((uri, " ".join(str(err).split())))
            continue
        _check_level(uri, ledger, level)
        return SnapshotChoice(uri, ledger, skipped, extra)
    if skipped:
        listing = "; ".join(f"{u}: {r}" for u, r in skipped)
        raise RestoreError(
            f"no usable snapshot under {root_uri} ({len(skipped)} found, none restorable: "
            f"{listing}); nothing was deleted. Repair or move the damaged files, or start a new "
            "run on purpose in another checkpointing.checkpoint_dir"
        )
    return None


def _check_level(uri: str, ledger: Ledger, level: str) -> None:
    taken = ledger.level
    if ledger.holds_unfinished_work() and LEVELS.index(taken) > LEVELS.index(level):
        raise RestoreError(
            f"snapshot {uri} holds {taken}-level recovery state; restore it with "
            f"rollout_recovery.target_level={taken}, or use "
            "rollout_checkpointing.restore_mode=trainer_checkpoint"
        )


def check_model(uri: str, ledger: Ledger, identity: dict) -> None:
    """Refuse a snapshot whose tokens another model decoded (compared before anything loads)."""
    recorded = ledger.model.base
    if recorded.get("sha256") is None or identity.get("sha256") is None:
        same = recorded.get("path") == identity.get("path")  # hub models: by name only
    else:
        same = recorded["sha256"] == identity["sha256"]
    if not same:
        raise RestoreError(
            f"snapshot {uri} was taken with model {recorded.get('path')} (weights sha256 "
            f"{str(recorded.get('sha256'))[:12]}), but policy.model_path={identity.get('path')} "
            f"has sha256 {str(identity.get('sha256'))[:12]}: its in-flight calls would be "
            "continued by other weights. Restore with the model the run was started with, or "
            "start a new run in another checkpointing.checkpoint_dir"
        )


def run_has_state(storage: RunStorage) -> list[str]:
    """What a run left in this location (empty when the location holds no run)."""
    found = []
    if storage.read_lines("steps.jsonl"):
        found.append("steps.jsonl")
    if any(n.startswith("step-") for n in storage.list_dir("trainer")):
        found.append("trainer checkpoints")
    if any(n.startswith("snapshot-") for n in storage.list_dir(DATA_PLANE)):
        found.append("data-plane snapshots")
    return found


def restore_snapshot(
    cfg: CheckpointCoordinatorConfig,
    store: StagingStore,
    root_uri: str,
    model: dict,
    snapshot: str | None,
    mode: str | None,
) -> SnapshotChoice | None:
    """Restore `store` from `snapshot` (already chosen, e.g. by the driver) or from the newest
    usable one under `root_uri` by `mode` (default `rollout_checkpointing.restore_mode`),
    after checking it was taken with `model`. None when nothing was ever published."""
    if snapshot is None:
        mode = mode or cfg.rollout_checkpointing.restore_mode
        choice = select_snapshot(root_uri, mode, cfg.rollout_recovery.target_level)
        if choice is None:
            return None
    else:
        try:
            choice = SnapshotChoice(snapshot, read_ledger(snapshot))
        except SnapshotUnusable as err:
            raise RestoreError(f"snapshot {snapshot} cannot be restored: {err}") from None
    check_model(choice.snapshot, choice.ledger, model)
    try:
        store.restore(choice.snapshot)
    except SnapshotError as err:
        raise RestoreError(f"snapshot {choice.snapshot} cannot be restored: {err}") from None
    return choice
