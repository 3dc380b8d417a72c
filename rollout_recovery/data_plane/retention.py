"""Snapshot retention: which snapshot directories under a root to delete, and the pass that
deletes them (`gc`, run by the controller after a published snapshot).

A published snapshot counts only if it verifies (`snapshot_io.verify_snapshot`: manifest
checksum and format, every listed file's size and sha256, the chain's included). `gc` keeps
the newest k that verify and deletes only directories older than the oldest one kept, plus
unpublished ones older than the newest one kept, never a directory holding a file that a kept
snapshot lists; when none verifies it deletes nothing. It runs as an owner of the root (the
ownership log, `ownership.py`): a fenced owner deletes nothing. It sees the root only: what a
restore set aside (`trainer/set_aside.py`, under the run's `set_aside/`) is never deleted.
"""

from __future__ import annotations

import logging

import pyarrow.fs as pafs

from rollout_recovery.crashpoints import crash_point
from rollout_recovery.data_plane import ownership, snapshot_io
from rollout_recovery.data_plane.errors import SnapshotError
from rollout_recovery.data_plane.snapshot_io import SnapshotDir

log = logging.getLogger("rollout_recovery")


def _newest_verified(fs: pafs.FileSystem, dirs: list[SnapshotDir], k: int) -> list[int]:
    """Indices into `dirs` of the newest k published snapshots that verify, newest first."""
    found: list[int] = []
    for i in range(len(dirs) - 1, -1, -1):
        if len(found) == k:
            break
        path, published = dirs[i].path, dirs[i].published
        if not published:
            continue
        try:
            snapshot_io.verify_snapshot(fs, path)
        except SnapshotError as err:
            log.warning("snapshot %s does not verify; retention skips it: %s", path, err)
            continue
        found.append(i)
    return found


def gc(
    fs: pafs.FileSystem, root: str, keep_latest_k: int, owner: ownership.Owner | None = None
) -> list[str]:
    """Retention that never deletes the newest restorable snapshot; returns the deleted paths.

    Keeps the newest keep_latest_k snapshots that verify. Deletes every directory older than
    the oldest of them, and an unpublished one (no manifest) also when it is older than the
    newest kept one: a snapshot published after it began means its attempt is over. A
    directory holding files a kept (incremental) snapshot lists stays until none does. A corrupt
    snapshot among or after the kept ones stays (for inspection), so does a newer unpublished
    one (it may still be being written); when no snapshot verifies nothing is deleted.

    First of all, `owner` (None: epoch 0) must still own the root: when the ownership log
    holds a newer claim, OwnerFenced is raised and nothing is deleted. The log entries at
    slots below the oldest kept snapshot's publish entry are pruned too, never the newest
    claim.
    """
    if keep_latest_k < 1:
        raise ValueError("keep_latest_k must be >= 1")
    log = ownership.read_log(fs, root)
    ownership.check_current(log, owner, "deleting or publishing anything")
    dirs = snapshot_io._list_snapshot_dirs(fs, root, log)
    kept = _newest_verified(fs, dirs, keep_latest_k)
    if not kept:
        return []
    oldest, newest = min(kept), max(kept)
    chains = (snapshot_io.read_manifest(fs, dirs[i].path).body.chain() for i in kept)
    referenced = {name for chain in chains for name in chain}
    doomed = [
        d.path
        for i, d in enumerate(dirs)
        if (i < oldest or (not d.published and i < newest)) and d.name not in referenced
    ]
    for d in doomed:
        fs.delete_dir(d)
        crash_point("retention_deleted")
    snapshot_io._forget_verified(doomed)
    # A referenced snapshot keeps its publish entry: it stays published while it is kept.
    slots = [d.slot for i, d in enumerate(dirs) if i == oldest or d.name in referenced]
    oldest_slot = min((slot for slot in slots if slot is not None), default=None)
    if oldest_slot is not None:
        ownership.prune(fs, log, oldest_slot)
    return doomed
