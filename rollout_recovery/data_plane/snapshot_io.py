"""Snapshot files on any pyarrow filesystem: checksummed writes, a manifest published last.

Layout under a root (a local path or a pyarrow.fs URI such as s3://bucket/prefix):

    <root>/snapshot-<seq:010d>-<id>/shard-<i>/<partition>.arrow   Arrow IPC files
    <root>/snapshot-<seq:010d>-<id>/MANIFEST.json                 written last

A snapshot exists only once its manifest is published (written under a temporary name, then
moved: an atomic rename locally, an atomic single-object write on object stores). Data files
are fsynced before that on local disks. Everything without a manifest is ignored by readers
and removed by `gc`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import uuid
from datetime import UTC, datetime
from urllib.parse import urlsplit, urlunsplit

import pyarrow as pa
import pyarrow.fs as pafs
from pydantic import BaseModel, ConfigDict

from rollout_recovery.data_plane.errors import (
    SnapshotCorruptError,
    SnapshotError,
    SnapshotNotFoundError,
)

MANIFEST_NAME = "MANIFEST.json"
MANIFEST_FORMAT = "rollout_recovery.snapshot/v1"
_DIR_RE = re.compile(r"^snapshot-(\d{10})-([0-9a-f]{8})$")


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
    payload_bytes: int
    meta: dict[str, str] = {}
    sidecars: list[SidecarEntry] = []


class Manifest(BaseModel):
    """The manifest: its body plus a sha256 over the body's canonical JSON."""

    model_config = ConfigDict(extra="forbid")

    body: ManifestBody
    sha256: str


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path) for a local path or a pyarrow.fs URI (query options allowed)."""
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
    try:
        return pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, ValueError, OSError) as err:
        raise SnapshotError(f"cannot open {uri!r}: {err}") from None


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


def child_uri(root_uri: str, name: str) -> str:
    """The URI of `name` under a root URI, keeping a URI's query options (e.g. an endpoint)."""
    if "://" not in root_uri:
        return os.path.join(os.path.abspath(os.path.expanduser(root_uri)), name)
    parts = urlsplit(root_uri)
    return urlunsplit(parts._replace(path=join(parts.path, name) if parts.path else "/" + name))


def _is_local(fs: pafs.FileSystem) -> bool:
    return isinstance(fs, pafs.LocalFileSystem)


def _fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256_of_file(path: str) -> str:
    with pa.memory_map(path) as mm:
        return hashlib.sha256(mm.read_buffer()).hexdigest()


def write_table_checksummed(fs: pafs.FileSystem, path: str, table: pa.Table) -> tuple[str, int]:
    """Write an Arrow IPC file durably; returns (sha256, bytes).

    Local disks: the IPC writer streams the table's buffers straight to the file (no
    serialised copy), then the file is hashed from the page cache while fsync runs. Other
    filesystems: serialise once, hash, upload (an object store PUT is durable on return).
    """
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    if not _is_local(fs):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        data = sink.getvalue()
        with fs.open_output_stream(path) as out:
            out.write(data)
        return hashlib.sha256(data).hexdigest(), data.size
    with fs.open_output_stream(path) as out, pa.ipc.new_file(out, table.schema) as writer:
        writer.write_table(table)
    digest: list[str] = []
    hasher = threading.Thread(target=lambda: digest.append(_sha256_of_file(path)))
    hasher.start()
    _fsync_path(path)
    hasher.join()
    return digest[0], os.path.getsize(path)


def read_verified(fs: pafs.FileSystem, snapshot_dir: str, entry: FileEntry) -> pa.Table:
    """Read one snapshot file, checking size, sha256, row count and schema against its entry."""
    path = join(snapshot_dir, entry.path)
    try:
        if _is_local(fs):
            # Zero-copy: the table's buffers stay backed by the (immutable) snapshot file.
            data = pa.memory_map(path).read_buffer()
        else:
            with fs.open_input_file(path) as f:
                data = f.read_buffer()
    except (FileNotFoundError, OSError) as err:
        raise SnapshotCorruptError(f"snapshot file {entry.path} is missing: {err}") from None
    if data.size != entry.bytes:
        raise SnapshotCorruptError(
            f"snapshot file {entry.path} has {data.size} bytes, manifest says {entry.bytes}"
        )
    if hashlib.sha256(data).hexdigest() != entry.sha256:
        raise SnapshotCorruptError(f"snapshot file {entry.path} fails its sha256 check")
    try:
        table = pa.ipc.open_file(data).read_all()
    except pa.ArrowInvalid as err:
        raise SnapshotCorruptError(f"snapshot file {entry.path} is not Arrow IPC: {err}") from None
    if table.num_rows != entry.rows:
        raise SnapshotCorruptError(
            f"snapshot file {entry.path} has {table.num_rows} rows, manifest says {entry.rows}"
        )
    return table


_SIDECAR_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def write_sidecar(fs: pafs.FileSystem, snapshot_dir: str, name: str, data: bytes) -> SidecarEntry:
    if not _SIDECAR_RE.fullmatch(name):
        raise ValueError(f"invalid sidecar name {name!r}")
    path = join(snapshot_dir, "sidecars", name)
    fs.create_dir(join(snapshot_dir, "sidecars"), recursive=True)
    with fs.open_output_stream(path) as out:
        out.write(data)
    if _is_local(fs):
        _fsync_path(path)
        _fsync_path(join(snapshot_dir, "sidecars"), directory=True)
    return SidecarEntry(name=name, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())


def read_sidecar(fs: pafs.FileSystem, snapshot_dir: str, entry: SidecarEntry) -> bytes:
    path = join(snapshot_dir, "sidecars", entry.name)
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


def publish_manifest(fs: pafs.FileSystem, snapshot_dir: str, body: ManifestBody) -> Manifest:
    manifest = Manifest(body=body, sha256=_body_digest(body))
    data = manifest.model_dump_json(indent=1).encode()
    tmp = join(snapshot_dir, f".{MANIFEST_NAME}.tmp-{uuid.uuid4().hex[:8]}")
    with fs.open_output_stream(tmp) as out:
        out.write(data)
    if _is_local(fs):
        _fsync_path(tmp)
    fs.move(tmp, join(snapshot_dir, MANIFEST_NAME))
    if _is_local(fs):
        _fsync_path(snapshot_dir, directory=True)
        _fsync_path(os.path.dirname(snapshot_dir), directory=True)
    return manifest


def read_manifest(fs: pafs.FileSystem, snapshot_dir: str) -> Manifest:
    path = join(snapshot_dir, MANIFEST_NAME)
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
    if manifest.body.format != MANIFEST_FORMAT:
        raise SnapshotCorruptError(
            f"{MANIFEST_NAME} in {snapshot_dir} has format {manifest.body.format!r}; "
            f"this reader knows {MANIFEST_FORMAT!r} (upgrade rollout_recovery)"
        )
    if _body_digest(manifest.body) != manifest.sha256:
        raise SnapshotCorruptError(f"{MANIFEST_NAME} in {snapshot_dir} fails its sha256 check")
    return manifest


def _list_snapshot_dirs(fs: pafs.FileSystem, root: str) -> list[tuple[int, str, bool]]:
    """(seq, dir path, published) for every snapshot directory under root."""
    try:
        infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    except OSError as err:
        raise SnapshotError(f"cannot list {root}: {err}") from None
    out = []
    for info in infos:
        m = _DIR_RE.match(info.base_name)
        if info.type != pafs.FileType.Directory or not m:
            continue
        manifest = fs.get_file_info(join(info.path, MANIFEST_NAME))
        out.append((int(m.group(1)), info.path, manifest.type == pafs.FileType.File))
    return sorted(out)


def new_snapshot_dir(fs: pafs.FileSystem, root: str) -> tuple[int, str]:
    dirs = _list_snapshot_dirs(fs, root)
    seq = (dirs[-1][0] + 1) if dirs else 1
    path = join(root, f"snapshot-{seq:010d}-{uuid.uuid4().hex[:8]}")
    fs.create_dir(path, recursive=True)
    return seq, path


def latest_published(fs: pafs.FileSystem, root: str) -> str | None:
    published = [d for _, d, ok in _list_snapshot_dirs(fs, root) if ok]
    return published[-1] if published else None


def latest_uri(root_uri: str) -> str | None:
    """URI of the newest published snapshot under root_uri, or None."""
    fs, root = resolve(root_uri)
    found = latest_published(fs, root)
    return None if found is None else child_uri(root_uri, found.rstrip("/").rsplit("/", 1)[-1])


def published_uris(root_uri: str) -> list[str]:
    """URIs of every published snapshot under root_uri, oldest first."""
    fs, root = resolve(root_uri)
    return [
        child_uri(root_uri, d.rstrip("/").rsplit("/", 1)[-1])
        for _, d, ok in _list_snapshot_dirs(fs, root)
        if ok
    ]


def require_latest(root_uri: str) -> str:
    found = latest_uri(root_uri)
    if found is None:
        raise SnapshotNotFoundError(f"no published snapshot under {root_uri}")
    return found


def gc(fs: pafs.FileSystem, root: str, keep_latest_k: int) -> list[str]:
    """Delete published snapshots beyond the newest k, and unpublished ones older than the
    newest published (a newer unpublished one may still be being written)."""
    if keep_latest_k < 1:
        raise ValueError("keep_latest_k must be >= 1")
    dirs = _list_snapshot_dirs(fs, root)
    published = [(s, d) for s, d, ok in dirs if ok]
    if not published:
        return []
    keep = {d for _, d in published[-keep_latest_k:]}
    newest_seq = published[-1][0]
    doomed = [d for s, d, ok in dirs if (ok and d not in keep) or (not ok and s < newest_seq)]
    for d in doomed:
        fs.delete_dir(d)
    return doomed


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")
