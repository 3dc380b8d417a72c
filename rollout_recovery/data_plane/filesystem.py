"""The filesystem layer at the bottom of the data plane: every storage location (a local path or
a pyarrow.fs URI such as s3://) resolved to a filesystem and a path, URIs joined keeping their
query options, and the one fsync seam that orders durability (a file's bytes, then its name in
its directory). Snapshots (`snapshot_io.py`) and the ownership log (`ownership.py`) both build
on it, so neither needs the other for a path or an fsync.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

import pyarrow as pa
import pyarrow.fs as pafs

from rollout_recovery import faults
from rollout_recovery.data_plane.errors import SnapshotError


def resolve(uri: str, filesystem: pafs.FileSystem | None = None) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path) for a local path or a pyarrow.fs URI (query options allowed).

    A given `filesystem` replaces the URI's own for the same path, so that tests can put a
    fault-injecting filesystem in front of the real one.
    """
    if "://" not in uri:
        fs, path = pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
        fs = faults.local_filesystem(fs)
    else:
        try:
            fs, path = pafs.FileSystem.from_uri(uri)
        except (pa.ArrowInvalid, ValueError, OSError) as err:
            raise SnapshotError(f"cannot open {uri!r}: {err}") from None
    return (fs if filesystem is None else filesystem), path


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


def is_object_store(fs: pafs.FileSystem) -> bool:
    """Whether `fs` stores whole objects (a PUT is atomic and durable, there is no append and
    no cheap rename) rather than files on a disk, seeing through a fault-injecting wrapper."""
    handler = getattr(fs, "handler", None)
    if handler is not None and hasattr(handler, "object_store"):
        return bool(handler.object_store)
    return not _is_local(fs)


def _fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync(fs: pafs.FileSystem, path: str, directory: bool) -> None:
    """The one fsync seam: a handler that models durability (faultfs) records it, a local disk
    runs it, an object store needs none (an upload is durable once its stream closes)."""
    handler_fsync = getattr(getattr(fs, "handler", None), "fsync", None)
    if handler_fsync is not None:
        handler_fsync(path, directory)
    elif _is_local(fs):
        _fsync_path(path, directory)


def sync_file(fs: pafs.FileSystem, path: str) -> None:
    """Make a closed file's bytes durable; an error ends the snapshot attempt."""
    _sync(fs, path, directory=False)


def sync_dir(fs: pafs.FileSystem, path: str) -> None:
    """Make the names in a directory (creates, renames) durable."""
    _sync(fs, path, directory=True)


def make_dirs(fs: pafs.FileSystem, path: str) -> None:
    """Create `path` and any missing ancestors, each one's name made durable in its parent."""
    missing = []
    while path and fs.get_file_info(path).type == pafs.FileType.NotFound:
        missing.append(path)
        path = path.rsplit("/", 1)[0] if "/" in path.strip("/") else ""
    for new in reversed(missing):
        fs.create_dir(new, recursive=True)
        if "/" in new.strip("/"):
            sync_dir(fs, new.rsplit("/", 1)[0])
