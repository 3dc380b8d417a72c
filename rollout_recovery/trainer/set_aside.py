"""Keeping what a restore skipped: the newer snapshots it could not restore are set aside, not
left where the restored run's retention would delete them.

A restore restores the newest usable snapshot (selection.py); each newer one it skipped (its
trainer checkpoint missing or of other weights, a damaged file, no publish entry) holds the old
run's history after the restore point. Left under `data_plane/`, the restored run's retention
deletes it once it has published `keep_latest_k` snapshots of its own, and the restored run
overwrites the old run's trainer checkpoints and batches of the same steps. So, after the claim
and before anything starts, `set_aside_skipped` moves them under the run's location, laid out
like a run's location so that `rollout-recovery snapshots ls|show|verify` read it:

    set_aside/<id>/SET_ASIDE.json                    what was moved and copied, from where, why
    set_aside/<id>/data_plane/snapshot-<seq>-<id>/   each skipped snapshot, moved
    set_aside/<id>/data_plane/ownership/<slot>.json  a copy of each one's publish entry
    set_aside/<id>/data_plane/snapshot-<...>/<file>  copies of the files an incremental one reads
                                                     from earlier snapshots left in place
    set_aside/<id>/trainer/..., batches/...          other files the caller names (the driver:
                                                     the old run's trainer checkpoints and
                                                     batches of the steps after the restored one)

Nothing reads, deletes or overwrites `set_aside/`: retention lists `data_plane/` and `trainer/`
only, and temporary files (a write a crash cut short, which the restore deletes) are never
moved there. Files move one by one through the run's storage layer (`RunStorage`'s filesystem:
a rename on a disk, one object's copy and delete on an object store), each snapshot's
`MANIFEST.json` (each trainer checkpoint's `meta.json`) last, so that a crash halfway leaves the
rest a damaged snapshot, which the next restore skips and sets aside in turn. The new names are
made durable before the old ones' removal. A failure moves back what was moved and refuses the
restore in one line (RestoreError): nothing is deleted.
"""

from __future__ import annotations

import contextlib
import errno
import json
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pyarrow.fs as pafs

from rollout_recovery.controller.selection import DATA_PLANE, SnapshotChoice
from rollout_recovery.data_plane import ownership
from rollout_recovery.data_plane.errors import SnapshotError
from rollout_recovery.data_plane.filesystem import make_dirs, sync_dir, sync_file
from rollout_recovery.data_plane.snapshot_io import (
    MANIFEST_NAME,
    SnapshotDir,
    list_snapshot_dirs,
    read_manifest,
)
from rollout_recovery.errors import RestoreError
from rollout_recovery.storage import TMP_MARK, RunStorage

SET_ASIDE_DIR = "set_aside"
RECORD = "SET_ASIDE.json"
_LAST = (MANIFEST_NAME, "meta.json")  # what makes a snapshot or a trainer checkpoint complete
_CHUNK = 8 << 20


@dataclass
class SetAside:
    """What one restore set aside, and where."""

    where: str  # relative to the checkpoint location: set_aside/<id>
    shown: str  # the same, as messages show it (no credentials)
    snapshots: dict[str, str] = field(default_factory=dict)  # skipped URI -> where it went
    files: list[str] = field(default_factory=list)  # the caller's other files moved (old places)


def restore_id(epoch: int) -> str:
    """A set-aside directory's name: when, and the owner epoch the restore claimed."""
    return f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}-epoch-{epoch}"


def snapshot_name(uri: str) -> str:
    return uri.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]


def set_aside_skipped(
    storage: RunStorage, choice: SnapshotChoice, also: list[str], name: str
) -> SetAside | None:
    """Move each snapshot `choice` skipped, and the files and directories `also` names
    (relative to the checkpoint location), to `set_aside/<name>/` (see the module docstring).
    None when nothing was skipped (then nothing moves, `also` neither). RestoreError, one line,
    when a move fails: what was moved is moved back, nothing is deleted."""
    if not choice.skipped:
        return None
    try:
        return _set_aside(storage, choice, also, name)
    except _Refused as refused:
        raise RestoreError(str(refused)) from None
    except (OSError, SnapshotError) as err:  # before anything moved
        raise RestoreError(
            f"cannot set aside the snapshots this restore skipped: {_why(err)}; nothing was "
            "moved or deleted. Fix the storage and run `train --restore` again"
        ) from None


class _Refused(Exception):
    """A move failed (its message says what was moved back)."""


def _set_aside(
    storage: RunStorage, choice: SnapshotChoice, also: list[str], name: str
) -> SetAside | None:
    dirs, _ = list_snapshot_dirs(storage.child_uri(DATA_PLANE))
    found = {d.name: d for d in dirs}
    skipped = [(reason, found[snapshot_name(uri)], uri) for uri, reason in choice.skipped
               if snapshot_name(uri) in found]  # fmt: skip
    if not skipped:
        return None  # gone meanwhile: nothing left to keep
    where = f"{SET_ASIDE_DIR}/{name}"
    if storage.exists(where):
        where = f"{where}-{uuid.uuid4().hex[:6]}"
    aside = SetAside(where, storage.display(where))
    moving = {d.name for _, d, _ in skipped}
    moves: list[str] = []  # relative paths, each moved to f"{where}/{rel}"
    copies: list[str] = []  # likewise, copied
    tops: list[str] = []  # the directories the moves empty
    record: dict = {
        "format": 1,
        "at": datetime.now(UTC).isoformat(timespec="milliseconds"),
        "restored": {"snapshot": snapshot_name(choice.snapshot), "step": choice.ledger.step},
        "snapshots": [],
    }
    for reason, d, uri in skipped:
        rel = f"{DATA_PLANE}/{d.name}"
        moves += _files(storage, rel)
        tops.append(rel)
        aside.snapshots[uri] = storage.display(f"{where}/{rel}")
        entry = None
        if d.published and d.slot is not None:
            entry = f"{DATA_PLANE}/{ownership.OWNERSHIP_DIR}/{ownership.entry_name(d.slot)}"
            copies.append(entry)
        chain = _chain_files(storage, d, moving)
        copies += [c for c in chain if c not in copies]
        record["snapshots"].append({"name": d.name, "reason": reason, "published": d.published,
                                    "publish_entry": entry, "reads_copied": chain})  # fmt: skip
    for rel in also:
        files = _files(storage, rel)
        moves += files
        aside.files += files
        if storage.is_dir(rel):
            tops.append(rel)
    record["moved"], record["copied"] = moves, copies
    done: list[str] = []
    try:
        storage.write_bytes(f"{where}/{RECORD}", json.dumps(record, indent=1).encode())
        for rel in copies:
            _copy(storage, rel, f"{where}/{rel}")
        for rel in moves:
            _move(storage, rel, f"{where}/{rel}")
            done.append(rel)
        for parent in _parents([f"{where}/{rel}" for rel in moves]) + _parents(moves):
            sync_dir(storage.fs, storage.path(parent))  # the new names first, then the removals
    except (OSError, SnapshotError) as err:
        raise _Refused(_refusal(storage, aside, sorted(moving), done, err)) from None
    for top in tops:
        _remove_if_empty(storage, top)
    return aside


def _files(storage: RunStorage, rel: str) -> list[str]:
    """The files at or under `rel`, relative to the checkpoint location, temporary files left
    out, completion markers last."""
    info = storage.fs.get_file_info(storage.path(rel))
    if info.type == pafs.FileType.File:
        return [rel]
    if info.type != pafs.FileType.Directory:
        return []
    base = storage.root.rstrip("/") + "/"
    selector = pafs.FileSelector(storage.path(rel), recursive=True)
    found = [i.path[len(base):] for i in storage.fs.get_file_info(selector)
             if i.type == pafs.FileType.File and TMP_MARK not in i.base_name]  # fmt: skip
    return sorted(found, key=lambda r: (r.rsplit("/", 1)[-1] in _LAST, r))


def _chain_files(storage: RunStorage, d: SnapshotDir, moving: set[str]) -> list[str]:
    """The files an incremental snapshot reads from earlier snapshots that stay in place (and
    that exist), relative to the checkpoint location: copied, so that the snapshot set aside
    verifies on its own. Nothing when its manifest is unreadable."""
    try:
        manifest = read_manifest(storage.fs, storage.path(f"{DATA_PLANE}/{d.name}"))
    except SnapshotError:
        return []
    wanted = sorted({f"{DATA_PLANE}/{f.snapshot}/{f.path}" for f in manifest.body.files
                     if f.snapshot is not None and f.snapshot not in moving})  # fmt: skip
    return [rel for rel in wanted if storage.exists(rel)]


def _parents(rels: list[str]) -> list[str]:
    return sorted({rel.rsplit("/", 1)[0] for rel in rels if "/" in rel})


def _move(storage: RunStorage, src: str, dst: str) -> None:
    fs, target = storage.fs, storage.path(dst)
    make_dirs(fs, target.rsplit("/", 1)[0])
    if fs.get_file_info(target).type != pafs.FileType.NotFound:
        raise OSError(errno.EEXIST, "already exists", storage.display(dst))
    fs.move(storage.path(src), target)


def _copy(storage: RunStorage, src: str, dst: str) -> None:
    """Copy one file, streamed; locally through a temporary file, fsynced, moved into place."""
    fs, target = storage.fs, storage.path(dst)
    make_dirs(fs, target.rsplit("/", 1)[0])
    tmp = target if storage.object_store else f"{target}{TMP_MARK}{uuid.uuid4().hex[:8]}"
    with fs.open_input_stream(storage.path(src)) as f, fs.open_output_stream(tmp) as out:
        while chunk := f.read(_CHUNK):
            out.write(chunk)
    if not storage.object_store:
        sync_file(fs, tmp)
        fs.move(tmp, target)


def _remove_if_empty(storage: RunStorage, rel: str) -> None:
    """Remove a directory the moves emptied (one still holding a file stays)."""
    selector = pafs.FileSelector(storage.path(rel), recursive=True, allow_not_found=True)
    with contextlib.suppress(OSError):
        if not any(i.type == pafs.FileType.File for i in storage.fs.get_file_info(selector)):
            storage.delete_dir(rel)


def _why(err: BaseException) -> str:
    why = getattr(err, "strerror", None) or str(err) or type(err).__name__
    where = getattr(err, "filename", None)
    return " ".join(why.split()) + (f" ({where})" if where and str(where) not in why else "")


def _refusal(
    storage: RunStorage, aside: SetAside, names: list[str], done: list[str], err: Exception
) -> str:
    """Move back what was moved; the one line that says what happened."""
    back = True
    for rel in reversed(done):
        try:
            storage.fs.move(storage.path(f"{aside.where}/{rel}"), storage.path(rel))
        except OSError:
            back = False
    if back:
        with contextlib.suppress(OSError):
            for parent in _parents(done):
                sync_dir(storage.fs, storage.path(parent))
            storage.delete_dir(aside.where)  # only the record and copies are left there
        state = "what was moved was moved back"
    else:
        state = f"files that could not be moved back are under {aside.shown} ({RECORD} lists them)"
    return (
        f"cannot set aside the snapshots this restore skipped ({', '.join(names)}) under "
        f"{aside.shown}: {_why(err)}; {state}, nothing was deleted. The restore stops rather "
        "than let the restored run delete or overwrite them: fix the storage and run "
        "`train --restore` again"
    )
