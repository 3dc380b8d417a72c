"""A run's checkpoint location on any pyarrow filesystem: a local path or a URI (`s3://...`).

Everything a run keeps under `checkpointing.checkpoint_dir` goes through here (data-plane
snapshots take their own root URI from `child_uri`): trainer checkpoints, the step and
checkpoint logs, the training batches kept for parity checks. Names are joined as URI paths,
never with `os.path.join` (which turns `s3://bucket/run` into `s3:/bucket/run`), and a URI's
query options (an endpoint, a region) are kept on every child.

Writes are atomic and durable per file, through the snapshot layer's fsync seam (so the fault
filesystem sees them too): on a disk a temporary file is fsynced and moved over the target,
then the directory is fsynced (new directories, and deletes, are made durable the same way);
on object stores a single PUT is atomic. Logs are appended on a disk (fsynced per line);
object stores have no append, so a log there is rewritten whole (logs are small). A crash
mid-write can leave a temporary file (`*.tmp-*`): `leftover_temporaries` finds them and the
restore deletes them. A write or delete that fails the way a storage outage does (EIO, a timeout, a
refused or reset connection, an object store's 503) is tried again for up to
`TRANSIENT_RETRY_S`, backing off; a full disk, a read-only location or a denied permission fail
at once. A log line is tried again only when none of it was written. A failure that stays
raises `StorageError` naming the location, the cause and what to run once it is fixed.

A storage opened with the run owner's `Fence` checks the run's ownership log before every
write and delete (data_plane/ownership.py, docs/ownership.md): once a newer owner claimed the
run, the next one raises OwnerFenced naming it, and nothing more is written.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pyarrow.fs as pafs

from rollout_recovery.data_plane.filesystem import (
    child_uri,
    is_object_store,
    join,
    make_dirs,
    resolve,
    sync_dir,
    sync_file,
)
from rollout_recovery.data_plane.ownership import Fence, OwnerFenced, OwnershipWatch
from rollout_recovery.errors import StorageError

TMP_MARK = ".tmp-"  # in the name of a file being written, before it is moved into place
# How long a write that failed like an outage is tried again before the run gives up on it.
TRANSIENT_RETRY_S = 10.0
TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.EAGAIN, errno.EBUSY, errno.ETIMEDOUT,
                              errno.ECONNRESET, errno.ECONNREFUSED, errno.ENETUNREACH,
                              errno.EHOSTUNREACH})  # fmt: skip
# What pyarrow's S3 filesystem says (without an errno) for a failure that may pass.
TRANSIENT_MESSAGES = ("NETWORK_CONNECTION", "SlowDown", "Service Unavailable", "RequestTimeout",
                      "timed out", "Timeout")  # fmt: skip
AFTER_FAILURE = "fix the storage, then continue the run with `--restore` (nothing was deleted)"
log = logging.getLogger(__name__)


class RunStorage:
    def __init__(self, uri: str, fence: Fence | None = None) -> None:
        self.uri = uri
        self.fs, self.root = resolve(uri)
        self.object_store = is_object_store(self.fs)
        self.local = not self.object_store and "://" not in uri
        self.fence = fence
        self._watch = OwnershipWatch(fence) if fence is not None else None

    def fenced(self, fence: Fence) -> RunStorage:
        """The same location (and filesystem), every write checked against `fence` first."""
        other = copy.copy(self)
        other.fence, other._watch = fence, OwnershipWatch(fence)
        return other

    def check_owner(self, doing: str) -> None:
        """OwnerFenced when the fence's owner no longer owns the run (nothing without one)."""
        if self._watch is not None:
            self._watch.check(doing)

    def __repr__(self) -> str:
        return f"RunStorage({self.display()})"

    def display(self, rel: str = "") -> str:
        """A location for messages: the path or URI without credentials or options."""
        where = join(self.root, rel) if rel else self.root
        if self.local:
            return where
        scheme = self.uri.split("://", 1)[0]
        return f"{scheme}://{where}"

    def child_uri(self, *parts: str) -> str:
        uri = self.uri
        for part in parts:
            uri = child_uri(uri, part)
        return uri

    def path(self, rel: str) -> str:
        return join(self.root, rel) if rel else self.root

    def local_path(self, rel: str = "") -> Path | None:
        return Path(self.path(rel)) if self.local else None

    # ------------------------------------------------------------------ checks

    def check_writable(self) -> None:
        """Create the root and write, read back and delete a probe file, so that a read-only
        or unreachable location fails before a run starts."""
        probe = f".write-probe-{uuid.uuid4().hex[:8]}"
        try:
            make_dirs(self.fs, self.root.rstrip("/"))
            self.write_bytes(probe, b"probe")
            if self.read_bytes(probe) != b"probe":
                raise OSError("a probe file read back different bytes")
        except OSError as err:
            cause = err.__cause__ if isinstance(err, StorageError) else err
            reason = _reason(cause if isinstance(cause, OSError) else err)
            raise StorageError(
                f"cannot write to checkpointing.checkpoint_dir {self.display()}: {reason}; "
                "make it writable or point checkpointing.checkpoint_dir elsewhere"
            ) from None
        finally:
            with contextlib.suppress(OSError):
                self.fs.delete_file(self.path(probe))

    # ------------------------------------------------------------------ files

    def exists(self, rel: str) -> bool:
        return self.fs.get_file_info(self.path(rel)).type != pafs.FileType.NotFound

    def is_dir(self, rel: str) -> bool:
        return self.fs.get_file_info(self.path(rel)).type == pafs.FileType.Directory

    def list_dir(self, rel: str) -> list[str]:
        """Names directly under `rel` (empty when it does not exist)."""
        selector = pafs.FileSelector(self.path(rel), allow_not_found=True)
        return sorted(info.base_name for info in self.fs.get_file_info(selector))

    def read_bytes(self, rel: str) -> bytes:
        """The file's bytes; FileNotFoundError when it does not exist."""
        if not self.exists(rel):
            raise FileNotFoundError(self.display(rel))
        with self.fs.open_input_stream(self.path(rel)) as f:
            return f.read()

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Replace `rel` with `data` atomically and durably (a reader, also after a power
        loss, sees the old or the new file). The owner is checked before the write and again
        before the rename that makes it visible (a writer paused in between, whose temporary
        file a newer owner's restore removed, is told it no longer owns the run)."""
        doing = f"writing {self.display(rel)}"
        self.check_owner(doing)
        what = f"cannot write {self.display(rel)}"
        self._retried(lambda: self._write_once(rel, data, doing), what, doing)

    def _write_once(self, rel: str, data: bytes, doing: str) -> None:
        target = self.path(rel)
        parent = target.rsplit("/", 1)[0]
        make_dirs(self.fs, parent)
        if self.object_store:
            with self.fs.open_output_stream(target) as out:
                out.write(data)
            return
        tmp = f"{target}{TMP_MARK}{uuid.uuid4().hex[:8]}"
        try:
            with self.fs.open_output_stream(tmp) as out:
                out.write(data)
            sync_file(self.fs, tmp)
            self.check_owner(doing)
            self.fs.move(tmp, target)
        except (OSError, OwnerFenced):  # the temporary file must not outlive the write
            with contextlib.suppress(OSError):
                self.fs.delete_file(tmp)
            raise
        sync_dir(self.fs, parent)

    def append_line(self, rel: str, line: str) -> None:
        """Append one line to a log, durably."""
        data = (line.rstrip("\n") + "\n").encode()
        doing = f"appending to {self.display(rel)}"
        self.check_owner(doing)
        if self.object_store:
            old = self.read_bytes(rel) if self.exists(rel) else b""
            self.write_bytes(rel, old + data)
            return
        what = f"cannot append to {self.display(rel)}"
        self._retried(lambda: self._append_once(rel, data), what, doing)

    def _append_once(self, rel: str, data: bytes) -> None:
        """Append; raises _Written where the line may be partly written (not to be tried
        again)."""
        target = self.path(rel)
        parent = target.rsplit("/", 1)[0]
        make_dirs(self.fs, parent)
        new = not self.exists(rel)
        with self.fs.open_append_stream(target) as out:
            try:
                out.write(data)
            except OSError as err:
                raise _Written(err) from err
        try:
            sync_file(self.fs, target)
            if new:
                sync_dir(self.fs, parent)
        except OSError as err:
            raise _Written(err) from err

    def _retried(self, once: Callable[[], None], what: str, doing: str) -> None:
        """`once()`, tried again while it fails like an outage, for up to TRANSIENT_RETRY_S."""
        deadline, delay = time.monotonic() + TRANSIENT_RETRY_S, 0.05
        while True:
            try:
                once()
                return
            except OSError as raised:
                self.check_owner(doing)  # a failure a newer owner caused says so
                err = raised.err if isinstance(raised, _Written) else raised
                again = not isinstance(raised, _Written) and transient(err)
                if not again or time.monotonic() + delay > deadline:
                    waited = f" (tried for {TRANSIENT_RETRY_S:g} s)" if again else ""
                    raise StorageError(f"{what}: {_reason(err)}{waited}", AFTER_FAILURE) from err
                log.warning("%s: %s; trying again in %.2f s", what, _reason(err), delay)
                time.sleep(delay)
                delay = min(2 * delay, 1.0)

    def read_lines(self, rel: str) -> list[str]:
        if not self.exists(rel):
            return []
        return [ln for ln in self.read_bytes(rel).decode().splitlines() if ln.strip()]

    def delete_file(self, rel: str) -> None:
        """Delete `rel` (if it exists), durably."""
        self._delete(rel, self.fs.delete_file)

    def delete_dir(self, rel: str) -> None:
        """Delete the directory `rel` and everything under it (if it exists), durably."""
        self._delete(rel, self.fs.delete_dir)

    def _delete(self, rel: str, how: Callable[[str], None]) -> None:
        doing = f"deleting {self.display(rel)}"
        self.check_owner(doing)

        def once() -> None:  # a second try finds it gone, and makes that durable
            with contextlib.suppress(FileNotFoundError):
                how(self.path(rel))
            with contextlib.suppress(FileNotFoundError):
                self._sync_parent(rel)

        self._retried(once, f"cannot delete {self.display(rel)}", doing)

    def _sync_parent(self, rel: str) -> None:
        if not self.object_store:
            sync_dir(self.fs, self.path(rel).rsplit("/", 1)[0])

    def leftover_temporaries(self) -> list[str]:
        """Temporary files a crash left behind (a write killed before its move), relative."""
        selector = pafs.FileSelector(self.root, recursive=True, allow_not_found=True)
        found = [i.path for i in self.fs.get_file_info(selector)
                 if i.type == pafs.FileType.File and TMP_MARK in i.base_name]  # fmt: skip
        return sorted(p[len(self.root.rstrip("/")) + 1 :] for p in found)


class _Written(OSError):
    """A failure after part of a log line may have landed: trying again could double it."""

    def __init__(self, err: OSError) -> None:
        super().__init__(err.errno, err.strerror or str(err))
        self.err = err


def transient(err: OSError) -> bool:
    """Whether `err` is what a storage outage gives (worth trying again shortly)."""
    if err.errno is not None:
        return err.errno in TRANSIENT_ERRNOS
    return any(m in str(err) for m in TRANSIENT_MESSAGES)


def _reason(err: OSError) -> str:
    """`No space left on device`, `Read-only file system`, ... rather than a repr."""
    return err.strerror or str(err) or type(err).__name__
