"""Snapshot files on any pyarrow filesystem: checksummed writes, a manifest published last.

Layout under a root (a local path or a pyarrow.fs URI such as s3://bucket/prefix):

    <root>/snapshot-<seq:010d>-<id>/shard-<i>/<partition>.<k>.arrow   Arrow IPC files
    <root>/snapshot-<seq:010d>-<id>/sidecars/<name>                   small files (a ledger)
    <root>/snapshot-<seq:010d>-<id>/MANIFEST.json                     published last

Incremental snapshots: a snapshot may write only what changed since its parent (the previous
published snapshot of the same store): per shard and partition, the rows put since the
parent's freeze and a `<partition>.deletes.arrow` file of the keys deleted since, each with
the seq of its delete. Its manifest lists every file a restore reads: its own and, by the
name of the earlier snapshot that wrote them (`FileEntry.snapshot`), the files of its chain,
each with its size and sha256. Verification and restore read them all; a restore keeps, per
key, the row with the highest seq unless a delete with a higher seq follows it (`resolve_rows`).
A full snapshot (no `base`) starts a new chain.

Durability order (docs/storage.md): each data file is fsynced, then its directory; each
sidecar likewise; then the manifest is written under a temporary name and fsynced, the
snapshot directory fsynced, the manifest moved into place, and the snapshot directory and the
root fsynced. Every fsync goes through `filesystem.sync_file` / `sync_dir`: os.fsync on a local
disk, the handler's recorded fsync on a fault-injecting filesystem (testing/faultfs.py),
nothing on object stores (an upload is durable once its stream closes). An fsync error ends
the attempt: it propagates, unretried.

Publication: a snapshot exists only once its MANIFEST.json is in place. The manifest is
written under a temporary name, then moved into place (an atomic rename locally, a single
object on object stores), followed by directory fsyncs. That move and the fsyncs run
under the attempt's `PublishGate` lock, and only if the gate was not aborted and the attempt's
deadline has not passed; so once `PublishGate.abort()` returns True the snapshot can never
appear, and when it returns False it already has. Readers ignore directories without a
manifest.

Retention (which snapshots to delete) is `retention.py`; it counts a published snapshot only
if `verify_snapshot` passes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
from pydantic import BaseModel, ConfigDict

from rollout_recovery.crashpoints import crash_point
from rollout_recovery.data_plane import filesystem as fsys
from rollout_recovery.data_plane import ownership
from rollout_recovery.data_plane.errors import (
    BadInputError,
    SnapshotAborted,
    SnapshotCorruptError,
    SnapshotError,
)
from rollout_recovery.data_plane.schemas import check_version
from rollout_recovery.protocol import ID_RE

MANIFEST_NAME = "MANIFEST.json"
MANIFEST_FORMAT = "rollout_recovery.snapshot/v2"  # v2: incremental (file references, deletes)
READABLE_FORMATS = ("rollout_recovery.snapshot/v1", MANIFEST_FORMAT)
SNAPSHOT_DIR_RE = re.compile(r"^snapshot-(\d{10})-([0-9a-f]{8})$")
_HASH_CHUNK = 8 << 20
log = logging.getLogger("rollout_recovery")


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str  # relative to the snapshot directory
    partition: str
    shard: int
    row_kind: str
    schema_version: int
    rows: int
    bytes: int
    sha256: str
    snapshot: str | None = None  # the earlier snapshot that wrote it; None: this one
    content: Literal["rows", "deletes"] = "rows"  # deletes: (key, seq of the delete)


class LeaseEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lease_id: str
    partition: str
    consumer: str
    shard: int
    keys: list[str]


class SidecarEntry(BaseModel):
    """A small file published with the snapshot (a controller ledger, episode records)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    bytes: int
    sha256: str


class ManifestBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: str = MANIFEST_FORMAT
    snapshot_id: str
    seq: int
    created_at: str
    num_shards: int
    partitions: dict[str, str]  # partition -> row kind
    files: list[FileEntry]
    leases: list[LeaseEntry]
    payload_bytes: int  # every listed file's bytes: what a restore reads
    meta: dict[str, str] = {}
    sidecars: list[SidecarEntry] = []
    base: str | None = None  # the parent of an incremental snapshot; None: a full one
    chain_length: int = 1  # snapshots whose files a restore reads (1: a full one)
    boundaries: list[int] = []  # per shard: its seq at freeze (rows after it are newer)
    rows: dict[str, int] = {}  # partition -> rows in the store at freeze
    written_bytes: int = 0  # bytes of the files this snapshot wrote itself

    def chain(self) -> list[str]:
        """The earlier snapshots whose files this one lists, by name."""
        return sorted({f.snapshot for f in self.files if f.snapshot is not None})


class Manifest(BaseModel):
    """The manifest: its body plus a sha256 over the body's canonical JSON."""

    model_config = ConfigDict(extra="forbid")

    body: ManifestBody
    sha256: str


class PublishGate:
    """Decides, once and thread-safely, whether one snapshot attempt publishes or is abandoned.

    The writer publishes while holding the gate's lock; `abort()` takes the same lock. This
    closes the race between a caller that gives an attempt up (a timeout) and a writer thread
    that is still running: exactly one of them wins, and the loser learns which.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._aborted = False
        self._published = False

    def abort(self) -> bool:
        """Forbid publication: True if nothing was (or ever will be) published, False if the
        snapshot was already published (the caller must then treat it as published). Waits
        for a publication in progress, which is one manifest rename."""
        with self._lock:
            if not self._published:
                self._aborted = True
            return not self._published

    def check(self, what: str, deadline: float | None = None) -> None:
        """Raise SnapshotAborted if the attempt was aborted or `deadline` (time.monotonic())
        has passed; a missed deadline aborts the gate for good."""
        with self._lock:
            self._refuse_if_closed(what, deadline)

    @contextmanager
    def publishing(self, what: str, deadline: float | None = None) -> Iterator[Callable[[], None]]:
        """Hold the gate for one publish step, or raise SnapshotAborted without running it.

        The step calls the yielded function right after the move that makes the snapshot
        visible, so a failure after that point still counts as published.
        """
        with self._lock:
            if self._published:
                raise BadInputError("a PublishGate publishes one snapshot; use one per attempt")
            self._refuse_if_closed(what, deadline)
            yield self._mark_published
            self._published = True

    def _mark_published(self) -> None:
        self._published = True

    def _refuse_if_closed(self, what: str, deadline: float | None) -> None:
        if self._aborted:
            raise SnapshotAborted(f"snapshot {what} was aborted; it was not published")
        if deadline is not None and time.monotonic() > deadline:
            self._aborted = True
            raise SnapshotAborted(f"snapshot {what} missed its deadline; it was not published")


def _sha256_of_file(path: str) -> str:
    with pa.memory_map(path) as mm:
        return hashlib.sha256(mm.read_buffer()).hexdigest()


def write_table_checksummed(fs: pafs.FileSystem, path: str, table: pa.Table) -> tuple[str, int]:
    """Write an Arrow IPC file durably; returns (sha256, bytes).

    Local disks: the IPC writer streams the table's buffers straight to the file (no
    serialised copy), then the file is hashed from the page cache while fsync runs. Other
    filesystems: serialise once, hash, upload. Either way the file, then its directory, is
    synced before this returns.
    """
    parent = path.rsplit("/", 1)[0]
    fs.create_dir(parent, recursive=True)
    if not fsys._is_local(fs):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        data = sink.getvalue()
        with fs.open_output_stream(path) as out:
            out.write(data)
        fsys.sync_file(fs, path)
        fsys.sync_dir(fs, parent)
        return hashlib.sha256(data).hexdigest(), data.size
    with fs.open_output_stream(path) as out, pa.ipc.new_file(out, table.schema) as writer:
        writer.write_table(table)
    digest: list[str] = []
    hasher = threading.Thread(target=lambda: digest.append(_sha256_of_file(path)))
    hasher.start()
    try:
        fsys.sync_file(fs, path)
    finally:
        hasher.join()
    fsys.sync_dir(fs, parent)
    return digest[0], os.path.getsize(path)


def file_path(snapshot_dir: str, entry: FileEntry) -> str:
    """Where a listed file lies: in the snapshot's directory, or in the earlier snapshot's
    directory (a sibling under the same root) that wrote it."""
    if entry.snapshot is None:
        return fsys.join(snapshot_dir, entry.path)
    return fsys.join(snapshot_dir.rstrip("/").rsplit("/", 1)[0], entry.snapshot, entry.path)


def file_name(entry: FileEntry) -> str:
    """A listed file's path for messages: relative to the snapshot's directory."""
    return entry.path if entry.snapshot is None else f"../{entry.snapshot}/{entry.path}"


def read_verified(fs: pafs.FileSystem, snapshot_dir: str, entry: FileEntry) -> pa.Table:
    """Read one snapshot file, checking size, sha256, row count and schema against its entry."""
    path = file_path(snapshot_dir, entry)
    try:
        if fsys._is_local(fs):
            # Zero-copy: the table's buffers stay backed by the (immutable) snapshot file.
            data = pa.memory_map(path).read_buffer()
        else:
            with fs.open_input_file(path) as f:
                data = f.read_buffer()
    except (FileNotFoundError, OSError) as err:
        raise SnapshotCorruptError(f"snapshot file {file_name(entry)} is missing: {err}") from None
    if data.size != entry.bytes:
        raise SnapshotCorruptError(
            f"snapshot file {file_name(entry)} has {data.size} bytes, manifest says {entry.bytes}"
        )
    if hashlib.sha256(data).hexdigest() != entry.sha256:
        raise SnapshotCorruptError(f"snapshot file {file_name(entry)} fails its sha256 check")
    try:
        table = pa.ipc.open_file(data).read_all()
    except pa.ArrowInvalid as err:
        where = file_name(entry)
        raise SnapshotCorruptError(f"snapshot file {where} is not Arrow IPC: {err}") from None
    if table.num_rows != entry.rows:
        raise SnapshotCorruptError(
            f"snapshot file {file_name(entry)} has {table.num_rows} rows, "
            f"manifest says {entry.rows}"
        )
    return table


def resolve_rows(rows: list[pa.Table], deletes: list[pa.Table]) -> pa.Table:
    """The rows live at a snapshot's freeze, from the files of its chain: per key the row
    with the highest seq, unless the key's latest delete has a higher seq. Seqs of one key
    always come from one shard, so they are comparable. Vectorized over dictionary codes of
    the keys (no Python object per row)."""
    table = pa.concat_tables(rows) if len(rows) > 1 else rows[0]
    if table.num_rows == 0:
        return table
    encoded = pc.dictionary_encode(table.column("key")).combine_chunks()
    codes = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    seqs = table.column("_seq").to_numpy()
    order = np.lexsort((-seqs, codes))  # by key, newest first
    first = np.ones(len(order), dtype=bool)
    first[1:] = codes[order][1:] != codes[order][:-1]
    keep = order[first]
    dead = [d for d in deletes if d.num_rows]
    if dead:
        gone = pa.concat_tables(dead)
        where = pc.index_in(gone.column("key"), value_set=encoded.dictionary)
        found = pc.is_valid(where).to_numpy(zero_copy_only=False)
        deleted_at = np.full(len(encoded.dictionary), -1, dtype=np.int64)
        np.maximum.at(
            deleted_at,
            where.to_numpy(zero_copy_only=False)[found].astype(np.int64),
            gone.column("_seq").to_numpy()[found],
        )
        keep = keep[seqs[keep] >= deleted_at[codes[keep]]]
    return table.take(pa.array(np.sort(keep)))


def read_partitions(
    fs: pafs.FileSystem,
    snapshot_dir: str,
    files: list[FileEntry],
    pool: ThreadPoolExecutor | None = None,
    keep: Callable[[str], bool] | None = None,
) -> dict[str, pa.Table]:
    """The rows of each partition the listed files hold (a chain resolved by
    `resolve_rows`), each file verified on read, with their `_seq` column; `keep(key)`
    selects rows (and deletes) by key first. Partitions without rows are left out."""
    for entry in files:
        check_version(entry.row_kind, entry.schema_version, f"snapshot file {file_name(entry)}")
    read = (pool.map if pool else map)(lambda e: read_verified(fs, snapshot_dir, e), files)
    rows: dict[str, list[pa.Table]] = {}
    deletes: dict[str, list[pa.Table]] = {}
    for entry, table in zip(files, read, strict=True):
        if keep is not None:
            mask = [keep(k) for k in table.column("key").to_pylist()]
            table = table.filter(pa.array(mask, pa.bool_()))
        into = deletes if entry.content == "deletes" else rows
        into.setdefault(entry.partition, []).append(table)
    chained = any(e.snapshot is not None or e.content == "deletes" for e in files)
    out = {}
    for name, tables in rows.items():
        if chained:
            table = resolve_rows(tables, deletes.get(name, []))
        else:  # one full snapshot: every key once, nothing deleted
            table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        if table.num_rows:
            out[name] = table
    return out


def write_sidecar(fs: pafs.FileSystem, snapshot_dir: str, name: str, data: bytes) -> SidecarEntry:
    if not ID_RE.fullmatch(name):
        raise ValueError(f"invalid sidecar name {name!r}")
    path = fsys.join(snapshot_dir, "sidecars", name)
    fs.create_dir(fsys.join(snapshot_dir, "sidecars"), recursive=True)
    with fs.open_output_stream(path) as out:
        out.write(data)
    fsys.sync_file(fs, path)
    fsys.sync_dir(fs, fsys.join(snapshot_dir, "sidecars"))
    crash_point("sidecar_written")
    return SidecarEntry(name=name, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())


def read_sidecar(fs: pafs.FileSystem, snapshot_dir: str, entry: SidecarEntry) -> bytes:
    path = fsys.join(snapshot_dir, "sidecars", entry.name)
    try:
        with fs.open_input_stream(path) as f:
            data = f.read()
    except (FileNotFoundError, OSError):
        raise SnapshotCorruptError(f"snapshot sidecar {entry.name} is missing") from None
    if len(data) != entry.bytes or hashlib.sha256(data).hexdigest() != entry.sha256:
        raise SnapshotCorruptError(f"snapshot sidecar {entry.name} fails its sha256 check")
    return data


def _body_digest(body: ManifestBody) -> str:
    canonical = json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def publish_manifest(
    fs: pafs.FileSystem,
    snapshot_dir: str,
    body: ManifestBody,
    gate: PublishGate | None = None,
    deadline: float | None = None,
    owner: ownership.Owner | None = None,
) -> Manifest:
    """Publish a snapshot whose files are all durable: write the manifest under a temporary
    name and sync it and the directory (every name the manifest lists is then durable), then
    move it into place under `gate` and sync the directory and the root (see the module
    docstring). The temporary write stays outside the gate so that `abort()` waits for at
    most one move and its syncs.

    The last step, still under the gate, is the publish entry in the root's ownership log
    (`ownership.publish_entry`), written for `owner` (None: epoch 0): until it exists readers
    do not count the snapshot as published. The log is read before the move, so a writer that
    a newer claim fenced already raises OwnerFenced without moving the manifest; one fenced
    while publishing raises it when its create-only write of the entry loses.

    Raises SnapshotAborted, publishing nothing, when the gate was aborted or `deadline` passed;
    the temporary file is invisible to readers and goes with its directory in `retention.gc`.
    """
    manifest = Manifest(body=body, sha256=_body_digest(body))
    tmp = fsys.join(snapshot_dir, f".{MANIFEST_NAME}.tmp-{uuid.uuid4().hex[:8]}")
    with fs.open_output_stream(tmp) as out:
        out.write(manifest.model_dump_json(indent=1).encode())
    fsys.sync_file(fs, tmp)
    fsys.sync_dir(fs, snapshot_dir)
    crash_point("manifest_written")
    root, name = snapshot_dir.rstrip("/").rsplit("/", 1)
    with (gate or PublishGate()).publishing(snapshot_dir, deadline) as published:
        log = ownership.prepare_publish(fs, root, owner)
        fs.move(tmp, fsys.join(snapshot_dir, MANIFEST_NAME))
        fsys.sync_dir(fs, snapshot_dir)
        fsys.sync_dir(fs, root)
        published()  # from here on the attempt may be visible: an error still counts
        crash_point("manifest_moved")
        ownership.publish_entry(fs, root, owner, name, manifest.sha256, log)
    crash_point("manifest_published")
    return manifest


def read_manifest(fs: pafs.FileSystem, snapshot_dir: str) -> Manifest:
    path = fsys.join(snapshot_dir, MANIFEST_NAME)
    try:
        with fs.open_input_stream(path) as f:
            raw = f.read()
    except (FileNotFoundError, OSError):
        raise SnapshotCorruptError(
            f"{snapshot_dir} has no {MANIFEST_NAME}: the snapshot was never published"
        ) from None
    try:
        manifest = Manifest.model_validate_json(raw)
    except ValueError as err:
        msg = " ".join(str(err).split())[:300]
        raise SnapshotCorruptError(
            f"{MANIFEST_NAME} in {snapshot_dir} is unreadable: {msg}"
        ) from None
    if manifest.body.format not in READABLE_FORMATS:
        raise SnapshotCorruptError(
            f"{MANIFEST_NAME} in {snapshot_dir} has format {manifest.body.format!r}; "
            f"this reader knows {', '.join(READABLE_FORMATS)} (upgrade rollout_recovery)"
        )
    if _body_digest(manifest.body) != manifest.sha256:
        raise SnapshotCorruptError(f"{MANIFEST_NAME} in {snapshot_dir} fails its sha256 check")
    return manifest


_verified: set[tuple[str, str, str]] = set()
_verified_files: set[tuple[str, str, str]] = set()  # (fs type, path, sha256) hashed and good
_verified_lock = threading.Lock()


def _verified_key(
    fs: pafs.FileSystem, snapshot_dir: str, manifest: Manifest
) -> tuple[str, str, str]:
    return (fs.type_name, snapshot_dir.rstrip("/"), manifest.sha256)


def _file_digest(fs: pafs.FileSystem, path: str) -> tuple[str, int]:
    """(sha256, bytes) of a file, read once: memory-mapped locally, streamed elsewhere."""
    if fsys._is_local(fs):
        with pa.memory_map(path) as mm:
            data = mm.read_buffer()
            return hashlib.sha256(data).hexdigest(), data.size
    hasher, size = hashlib.sha256(), 0
    with fs.open_input_stream(path) as f:
        while chunk := f.read(_HASH_CHUNK):
            hasher.update(chunk)
            size += len(chunk)
    return hasher.hexdigest(), size


def _check_file(fs: pafs.FileSystem, snapshot_dir: str, entry: FileEntry) -> None:
    try:
        sha, size = _file_digest(fs, file_path(snapshot_dir, entry))
    except OSError as err:
        where = file_name(entry)
        raise SnapshotCorruptError(f"snapshot file {where} cannot be read: {err}") from None
    if size != entry.bytes:
        raise SnapshotCorruptError(
            f"snapshot file {file_name(entry)} has {size} bytes, manifest says {entry.bytes}"
        )
    if sha != entry.sha256:
        raise SnapshotCorruptError(f"snapshot file {file_name(entry)} fails its sha256 check")


def check_files(fs: pafs.FileSystem, snapshot_dir: str, files: list[FileEntry]) -> None:
    """Find a missing or truncated file from metadata alone, before reading any bytes."""
    try:
        infos = fs.get_file_info([file_path(snapshot_dir, f) for f in files])
    except OSError as err:
        raise SnapshotCorruptError(f"cannot inspect the files of {snapshot_dir}: {err}") from None
    for entry, info in zip(files, infos, strict=True):
        if info.type != pafs.FileType.File:
            raise SnapshotCorruptError(f"snapshot file {file_name(entry)} is missing")
        if info.size != entry.bytes:
            raise SnapshotCorruptError(
                f"snapshot file {file_name(entry)} has {info.size} bytes, "
                f"manifest says {entry.bytes}"
            )


def verify_snapshot(fs: pafs.FileSystem, snapshot_dir: str, use_cache: bool = True) -> Manifest:
    """The manifest of a snapshot that is restorable: the manifest parses and passes its format
    and sha256 checks, and every sidecar and data file it lists (an incremental snapshot's
    chain included) exists with its size and sha256.

    Raises SnapshotCorruptError naming the first bad file. Reading every byte is costly, so a
    success is remembered in-process per (directory, manifest sha256), and each data file per
    (path, sha256): the manifest is read again each call, a file is hashed at most once per
    process, so verifying an incremental snapshot hashes only the files it wrote itself.
    `use_cache=False` hashes them all again (a restore reads every byte it trusts, whatever
    happened since).
    """
    manifest = read_manifest(fs, snapshot_dir)
    key = _verified_key(fs, snapshot_dir, manifest)
    with _verified_lock:
        if use_cache and key in _verified:
            return manifest
    for sidecar in manifest.body.sidecars:
        read_sidecar(fs, snapshot_dir, sidecar)
    files = manifest.body.files
    check_files(fs, snapshot_dir, files)
    keys = {id(f): (fs.type_name, file_path(snapshot_dir, f), f.sha256) for f in files}
    with _verified_lock:
        todo = [f for f in files if not use_cache or keys[id(f)] not in _verified_files]
    workers = max(1, min(8, len(todo), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(lambda entry: _check_file(fs, snapshot_dir, entry), todo))
    with _verified_lock:
        _verified.add(key)
        _verified_files.update(keys.values())
    return manifest


def _forget_verified(deleted: list[str]) -> None:
    gone = {d.rstrip("/") for d in deleted}
    with _verified_lock:
        _verified.difference_update({k for k in _verified if k[1] in gone})
        _verified_files.difference_update(
            {k for k in _verified_files if k[1].rsplit("/", 2)[0] in gone}
        )


@dataclass(frozen=True)
class SnapshotDir:
    """A snapshot directory under a root, as one listing (with one read of the ownership
    log) found it."""

    seq: int
    path: str
    published: bool
    has_manifest: bool = False
    slot: int | None = None  # the slot of its publish entry in the ownership log
    epoch: int | None = None  # the owner epoch that published it
    why: str | None = None  # why a directory holding a manifest is not published

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]


def _snapshot_dir_infos(fs: pafs.FileSystem, root: str) -> list[tuple[int, str]]:
    try:
        infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    except OSError as err:
        raise SnapshotError(f"cannot list {root}: {err}") from None
    out = []
    for info in infos:
        m = SNAPSHOT_DIR_RE.match(info.base_name)
        if info.type == pafs.FileType.Directory and m:
            out.append((int(m.group(1)), info.path))
    return sorted(out)


def _list_snapshot_dirs(
    fs: pafs.FileSystem, root: str, log: ownership.OwnershipLog | None = None
) -> list[SnapshotDir]:
    """Every snapshot directory under root, oldest first. One is published when its manifest
    exists and a publish entry of the ownership log (read once per listing) names it with
    that manifest's sha256, no claim of a higher epoch before it. A manifest that cannot be
    read keeps its publication (verification then names the damage); a manifest without an
    entry is an attempt that stopped before publishing."""
    log = log if log is not None else ownership.read_log(fs, root)
    publications = log.publications()
    out = []
    for seq, path in _snapshot_dir_infos(fs, root):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if fs.get_file_info(fsys.join(path, MANIFEST_NAME)).type != pafs.FileType.File:
            out.append(SnapshotDir(seq, path, False))
            continue
        if name not in publications:
            out.append(SnapshotDir(seq, path, False, True, why=log.why_unpublished(name)))
            continue
        slot, entry = publications[name]
        try:
            sha = read_manifest(fs, path).sha256
        except SnapshotCorruptError:
            sha = entry.manifest_sha256
        if sha != entry.manifest_sha256:
            why = (f"not published: its {MANIFEST_NAME} (sha256 {sha[:12]}) is not the one its "
                   f"publish entry names ({str(entry.manifest_sha256)[:12]})")  # fmt: skip
            out.append(SnapshotDir(seq, path, False, True, slot, entry.epoch, why))
            continue
        out.append(SnapshotDir(seq, path, True, True, slot, entry.epoch))
    return out


def list_snapshot_dirs(
    root_uri: str, filesystem: pafs.FileSystem | None = None
) -> tuple[list[SnapshotDir], ownership.OwnershipLog]:
    """Every snapshot directory under root_uri (oldest first) and the ownership log read."""
    fs, root = fsys.resolve(root_uri, filesystem)
    log = ownership.read_log(fs, root)
    return _list_snapshot_dirs(fs, root, log), log


def new_snapshot_dir(fs: pafs.FileSystem, root: str) -> tuple[int, str]:
    """A new, empty snapshot directory under root (created durably if it is new); its own
    name becomes durable when it is published."""
    dirs = _snapshot_dir_infos(fs, root)
    seq = (dirs[-1][0] + 1) if dirs else 1
    path = fsys.join(root, f"snapshot-{seq:010d}-{uuid.uuid4().hex[:8]}")
    fsys.make_dirs(fs, root.rstrip("/"))
    fs.create_dir(path, recursive=True)
    return seq, path


def latest_published(fs: pafs.FileSystem, root: str) -> str | None:
    published = [d.path for d in _list_snapshot_dirs(fs, root) if d.published]
    return published[-1] if published else None


def latest_uri(root_uri: str, filesystem: pafs.FileSystem | None = None) -> str | None:
    """URI of the newest published snapshot under root_uri, or None."""
    fs, root = fsys.resolve(root_uri, filesystem)
    found = latest_published(fs, root)
    return None if found is None else fsys.child_uri(root_uri, found.rstrip("/").rsplit("/", 1)[-1])


def published_uris(root_uri: str, filesystem: pafs.FileSystem | None = None) -> list[str]:
    """URIs of every published snapshot under root_uri, oldest first."""
    fs, root = fsys.resolve(root_uri, filesystem)
    return [fsys.child_uri(root_uri, d.name) for d in _list_snapshot_dirs(fs, root) if d.published]


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")
