"""A fault-injecting pyarrow filesystem for durability tests: wraps a real one (local or S3).

`fault_filesystem(inner, state_dir)` returns a `pyarrow.fs.PyFileSystem` over a `FaultFs`
handler that delegates every call to `inner`, records it in an operation log, and can:

* cut a chosen file at a chosen byte (`tear`: the bytes after it never land);
* lose power (`power_loss`): the filesystem returns to what was durable;
* flip one bit of a stored file (`flip_bit`);
* raise OSError(EIO / ENOSPC / ...) on a chosen write, fsync, move, delete or create-only
  write (`fail`).

Durability model. On a local disk (POSIX) a file's bytes are durable once the file is
fsynced, and a name (create, rename, delete, mkdir) once its parent directory is fsynced
afterwards. The handler keeps an explicit shadow of both: for each path it touched, the inode
its name links live and durably, and for each inode a copy of its bytes as of its last fsync.
`power_loss` rewrites the touched paths to that durable state (a file never fsynced comes back
empty, a name whose directory was never fsynced comes back as before) and leaves untouched
paths alone; what existed before the handler first touched it counts as durable. On an object
store a completed PUT or move is durable, so there `power_loss` drops only the writes whose
stream was still open (objects are uploaded whole when their stream closes).

Fsyncs reach the handler through `FaultFs.fsync`, which the data plane's one fsync seam
(`data_plane.filesystem.sync_file` / `sync_dir`) calls for a `PyFileSystem` whose handler has
it; create-only writes through `FaultFs.create_only` likewise (`filesystem.create_only`).

A whole run (every process of it, Ray actors included) is put behind it through the
environment: `armed_env(state_dir)` names the state directory and this module's
`local_fault_filesystem` as the hook that production's seam (`faults.local_filesystem`) calls
for every local path it resolves. Production code never imports this module.

Ray actors write snapshot files in other processes, so the model, the armed faults and the
operation log live in `state_dir` (a local directory) under a file lock: every copy of the handler,
pickled into any process on this machine, shares them. `power_loss` should be called while no
writer is active (stop one first with an injected error); a stream that was open across it
refuses to close.
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import io
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from rollout_recovery import faults
from rollout_recovery.data_plane.filesystem import create_only

# The kinds `fail` accepts -> the recorded operations each one matches.
FAULT_KINDS: dict[str, tuple[str, ...]] = {
    "write": ("write",),
    "fsync": ("fsync", "fsync_dir"),
    "move": ("move",),
    "delete": ("delete_file", "delete_dir"),
    "create": ("create",),
}


@dataclass(frozen=True)
class Op:
    """One recorded operation; `error` is the errno of an injected failure (0: it ran)."""

    op: str
    path: str
    dest: str = ""
    error: int = 0


@dataclass
class _Fault:
    kind: str
    pattern: str
    nth: int
    error: int = 0  # an errno to raise, or 0 for a torn write
    tear_at: int = -1
    seen: int = 0


@dataclass
class _State:
    """Everything shared between the handler's copies (saved as JSON in state_dir)."""

    epoch: int = 0
    next_ino: int = 1
    faults: list[_Fault] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)
    live: dict[str, int | None] = field(default_factory=dict)  # file path -> inode or absent
    durable: dict[str, int | None] = field(default_factory=dict)
    live_dirs: dict[str, bool] = field(default_factory=dict)
    durable_dirs: dict[str, bool] = field(default_factory=dict)
    synced: dict[str, int] = field(default_factory=dict)  # inode -> bytes in its shadow copy

    @classmethod
    def load(cls, raw: dict[str, Any]) -> _State:
        st = cls(**raw)
        st.faults = [_Fault(**f) for f in raw["faults"]]
        st.ops = [Op(**o) for o in raw["ops"]]
        return st


def fault_filesystem(
    inner: pafs.FileSystem, state_dir: str | os.PathLike[str], object_store: bool | None = None
) -> pafs.PyFileSystem:
    """`inner` behind a FaultFs (reach it as `.handler`); `object_store` defaults to whether
    `inner` is anything but the local filesystem."""
    return pafs.PyFileSystem(FaultFs(inner, state_dir, object_store))


def local_fault_filesystem(fs: pafs.FileSystem, state_dir: str) -> pafs.PyFileSystem:
    """The hook `armed_env` names: a local filesystem behind a FaultFs sharing `state_dir`."""
    return fault_filesystem(fs, state_dir, object_store=False)


HOOK = f"{__name__}:{local_fault_filesystem.__name__}"


def armed_env(state_dir: str | os.PathLike[str]) -> dict[str, str]:
    """The environment that puts every local path a run resolves, in all its processes,
    behind a FaultFs sharing `state_dir` (faults.local_filesystem, the production seam)."""
    return {faults.FAULTFS_ENV: os.fspath(state_dir), faults.FAULTFS_HOOK_ENV: HOOK}


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0]


def _ancestors(path: str) -> Iterator[str]:
    while "/" in path.strip("/"):
        path = _parent(path)
        yield path


def _io_error(code: int, path: str) -> OSError:
    return OSError(code, os.strerror(code), path)


class ReadThrough(pafs.FileSystemHandler):
    """A handler over `self.inner` whose reads and lookups go straight through; a subclass
    decides what its writes do."""

    inner: pafs.FileSystem

    def normalize_path(self, path: str) -> str:
        return self.inner.normalize_path(path)

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self.inner.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        return self.inner.get_file_info(selector)

    def open_input_stream(self, path: str) -> pa.NativeFile:
        return self.inner.open_input_stream(path)

    def open_input_file(self, path: str) -> pa.NativeFile:
        return self.inner.open_input_file(path)


class FaultFs(ReadThrough):
    """The handler: delegates to `inner`, records, injects faults, models durability."""

    def __init__(
        self,
        inner: pafs.FileSystem,
        state_dir: str | os.PathLike[str],
        object_store: bool | None = None,
    ) -> None:
        self.inner = inner
        self.state_dir = os.fspath(state_dir)
        self.object_store = (
            not isinstance(inner, pafs.LocalFileSystem) if object_store is None else object_store
        )
        os.makedirs(os.path.join(self.state_dir, "data"), exist_ok=True)
        with self._state():
            pass

    def __reduce__(self) -> tuple[Any, ...]:
        return FaultFs, (self.inner, self.state_dir, self.object_store)

    # ------------------------------------------------------------------ shared state

    @contextmanager
    def _state(self) -> Iterator[_State]:
        """The shared state, locked against every other copy and thread, saved on exit."""
        path = os.path.join(self.state_dir, "state.json")
        with open(os.path.join(self.state_dir, "lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            st = _State()
            if os.path.exists(path):
                with open(path) as f:
                    st = _State.load(json.load(f))
            try:
                yield st
            finally:
                with open(path + ".tmp", "w") as out:
                    json.dump(asdict(st), out)
                os.replace(path + ".tmp", path)

    def _shadow(self, ino: int) -> str:
        return os.path.join(self.state_dir, "data", str(ino))

    def _record(self, st: _State, op: str, path: str, dest: str = "") -> None:
        """Record `op`, raising the injected error if an armed fault picks this one."""
        fault = self._pick(st, op, path, dest, torn=False)
        st.ops.append(Op(op, path, dest, fault.error if fault else 0))
        if fault:
            raise _io_error(fault.error, path)

    @staticmethod
    def _pick(st: _State, op: str, path: str, dest: str, torn: bool) -> _Fault | None:
        for fault in st.faults:
            if op not in FAULT_KINDS[fault.kind] or (fault.tear_at >= 0) != torn:
                continue
            if any(p and fnmatch.fnmatchcase(p, fault.pattern) for p in (path, dest)):
                fault.seen += 1
                if fault.seen == fault.nth:
                    return fault
        return None

    # ------------------------------------------------------------------ arming faults

    def fail(self, kind: str, pattern: str, nth: int = 1, error: int = errno.EIO) -> None:
        """Raise OSError(`error`) on the `nth` `kind` operation (write, fsync, move, delete,
        create) whose path matches the glob `pattern`; a failed write raises on its first
        bytes."""
        if kind not in FAULT_KINDS or nth < 1:
            raise ValueError(f"fail needs a kind in {sorted(FAULT_KINDS)} and nth >= 1")
        with self._state() as st:
            st.faults.append(_Fault(kind, pattern, nth, error=error))

    def tear(self, pattern: str, at_byte: int, nth: int = 1) -> None:
        """Cut the `nth` file written whose path matches `pattern` at `at_byte`: the writer
        sees every write succeed, the bytes from `at_byte` on never land."""
        with self._state() as st:
            st.faults.append(_Fault("write", pattern, nth, tear_at=at_byte))

    def flip_bit(self, path: str, offset: int, bit: int = 0) -> None:
        """Flip one bit of a stored file, in its live bytes and in its durable copy."""
        with self._state() as st:
            self._flip(self.inner, path, offset, bit)
            ino = st.live.get(path)
            if ino is not None and st.synced.get(str(ino), 0) > offset:
                self._flip(pafs.LocalFileSystem(), self._shadow(ino), offset, bit)
            st.ops.append(Op("flip_bit", path))

    @staticmethod
    def _flip(fs: pafs.FileSystem, path: str, offset: int, bit: int) -> None:
        with fs.open_input_stream(path) as f:
            data = bytearray(f.read())
        data[offset] ^= 1 << bit
        with fs.open_output_stream(path) as out:
            out.write(bytes(data))

    def ops(self) -> list[Op]:
        with self._state() as st:
            return list(st.ops)

    # ------------------------------------------------------------------ durability

    def fsync(self, path: str, directory: bool = False) -> None:
        """The fsync the snapshot layer asks for: make a file's bytes, or a directory's names,
        durable (may raise an injected error, which then leaves them as they were)."""
        path = path.rstrip("/")
        with self._state() as st:
            self._record(st, "fsync_dir" if directory else "fsync", path)
            if self.object_store:
                return
            if directory:
                self._sync_names(st, path)
            else:
                self._sync_bytes(st, path)

    def _sync_bytes(self, st: _State, path: str) -> None:
        ino = self._track_file(st, path)
        if ino is None:
            raise _io_error(errno.ENOENT, path)
        self._sync_bytes_of(st, path, ino)

    @staticmethod
    def _sync_names(st: _State, directory: str) -> None:
        for path in st.live:
            if _parent(path) == directory:
                st.durable[path] = st.live[path]
        for path in st.live_dirs:
            if _parent(path) == directory:
                st.durable_dirs[path] = st.live_dirs[path]

    def power_loss(self) -> None:
        """Return the filesystem to what was durable (see the module docstring)."""
        with self._state() as st:
            st.epoch += 1
            st.ops.append(Op("power_loss", ""))
            if not self.object_store:
                self._restore_durable(st)

    def _restore_durable(self, st: _State) -> None:
        def chain_ok(path: str) -> bool:
            return all(st.durable_dirs.get(a, True) for a in _ancestors(path))

        dirs = {d: st.durable_dirs[d] and chain_ok(d) for d in st.durable_dirs}
        files = {p: st.durable[p] if chain_ok(p) else None for p in st.durable}
        for d in sorted(dirs, key=len):
            exists = self._is_dir(d)
            if exists and not dirs[d]:
                self.inner.delete_dir(d)
            elif dirs[d] and not exists:
                self.inner.create_dir(d, recursive=True)
        for path, ino in files.items():
            if ino is not None:
                self._put_durable_bytes(st, path, ino)
            elif self.inner.get_file_info(path).type == pafs.FileType.File:
                self.inner.delete_file(path)
        st.live_dirs, st.durable_dirs = dict(dirs), dict(dirs)
        st.live, st.durable = dict(files), dict(files)

    def _put_durable_bytes(self, st: _State, path: str, ino: int) -> None:
        data = b""
        if str(ino) in st.synced:
            with open(self._shadow(ino), "rb") as f:
                data = f.read()
        with self.inner.open_output_stream(path) as out:
            out.write(data)

    # ------------------------------------------------------------------ the model

    def _track_file(self, st: _State, path: str) -> int | None:
        """The live inode of `path`; on first touch a file already there counts as durable."""
        if path not in st.live and not self.object_store:
            ino = None
            if self.inner.get_file_info(path).type == pafs.FileType.File:
                ino = self._new_ino(st)
                self._sync_bytes_of(st, path, ino)
            st.live[path] = st.durable[path] = ino
        return st.live.get(path)

    def _sync_bytes_of(self, st: _State, path: str, ino: int) -> None:
        with self.inner.open_input_stream(path) as f, open(self._shadow(ino), "wb") as out:
            st.synced[str(ino)] = out.write(f.read())

    def _track_dir(self, st: _State, path: str) -> None:
        if path not in st.live_dirs and not self.object_store:
            exists = self._is_dir(path)
            st.live_dirs[path] = st.durable_dirs[path] = exists

    def _is_dir(self, path: str) -> bool:
        return self.inner.get_file_info(path).type == pafs.FileType.Directory

    @staticmethod
    def _new_ino(st: _State) -> int:
        st.next_ino += 1
        return st.next_ino - 1

    def _track_tree(self, st: _State, path: str) -> None:
        """Track a directory and everything under it (before deleting it), so that a delete
        that never became durable can be undone."""
        self._track_dir(st, path)
        for info in self.inner.get_file_info(pafs.FileSelector(path, recursive=True)):
            if info.type == pafs.FileType.Directory:
                self._track_dir(st, info.path)
            elif info.type == pafs.FileType.File:
                self._track_file(st, info.path)

    def _unlink_tree(self, st: _State, path: str, keep_top: bool) -> None:
        under = path.rstrip("/") + "/"
        for p in st.live:
            if p.startswith(under):
                st.live[p] = None
        for d in st.live_dirs:
            if d.startswith(under) or (d == path and not keep_top):
                st.live_dirs[d] = False

    # ------------------------------------------------------------------ FileSystemHandler

    def get_type_name(self) -> str:
        return "faultfs"

    def create_dir(self, path: str, recursive: bool) -> None:
        path = path.rstrip("/")
        with self._state() as st:
            for p in [path, *_ancestors(path)]:
                self._track_dir(st, p)
            self.inner.create_dir(path, recursive=recursive)
            self._record(st, "create_dir", path)
            for p in [path, *_ancestors(path)]:
                if p in st.live_dirs:
                    st.live_dirs[p] = True

    def delete_dir(self, path: str) -> None:
        path = path.rstrip("/")
        with self._state() as st:
            self._record(st, "delete_dir", path)
            if not self.object_store:
                self._track_tree(st, path)
                self._unlink_tree(st, path, keep_top=False)
            self.inner.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        path = path.rstrip("/")
        with self._state() as st:
            self._record(st, "delete_dir", path + "/*")
            if not self.object_store and self._is_dir(path):
                self._track_tree(st, path)
                self._unlink_tree(st, path, keep_top=True)
            self.inner.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        raise NotImplementedError("faultfs does not delete a whole filesystem")

    def delete_file(self, path: str) -> None:
        with self._state() as st:
            self._record(st, "delete_file", path)
            self._track_file(st, path)
            self.inner.delete_file(path)
            if not self.object_store:
                st.live[path] = None

    def move(self, src: str, dest: str) -> None:
        with self._state() as st:
            self._record(st, "move", src, dest)
            if not self.object_store:
                if self._is_dir(src):
                    raise NotImplementedError("faultfs models moves of files only")
                ino = self._track_file(st, src)
                self._track_file(st, dest)
                st.live[dest], st.live[src] = ino, None
            self.inner.move(src, dest)

    def create_only(self, path: str, data: bytes) -> bool:
        """The create-only write of the ownership log (data_plane.filesystem.create_only), on
        the inner filesystem: True if created, False if the name existed. Locally it is a
        write, an fsync and a link whose name the seam makes durable by fsyncing the
        directory, so a created entry is durable at once; on an object store a completed
        conditional PUT is."""
        with self._state() as st:
            self._record(st, "create", path)
            if self.object_store:
                return create_only(self.inner, path, data)
            self._track_dir(st, _parent(path))
            self._track_file(st, path)
            created = create_only(self.inner, path, data)
            if created:
                ino = self._new_ino(st)
                self._sync_bytes_of(st, path, ino)
                st.live[path] = st.durable[path] = ino
            return created

    def copy_file(self, src: str, dest: str) -> None:
        with self._state() as st:
            self._record(st, "write", dest)
            if not self.object_store and self._track_file(st, dest) is None:
                st.live[dest] = self._new_ino(st)
            self.inner.copy_file(src, dest)

    def open_output_stream(self, path: str, metadata: dict[str, str] | None) -> pa.NativeFile:
        return self._open_sink(path, metadata, append=False)

    def open_append_stream(self, path: str, metadata: dict[str, str] | None) -> pa.NativeFile:
        """Appends (local disks only): the new bytes are live until the file is fsynced."""
        if self.object_store:
            raise NotImplementedError("object stores have no append")
        return self._open_sink(path, metadata, append=True)

    def _open_sink(self, path: str, metadata: dict[str, str] | None, append: bool) -> Any:
        with self._state() as st:
            fault = self._pick(st, "write", path, "", torn=False)
            tear = self._pick(st, "write", path, "", torn=True)
            st.ops.append(Op("write", path, "", fault.error if fault else 0))
            target: Any = io.BytesIO()
            if not self.object_store:
                if self._track_file(st, path) is None:
                    st.live[path] = self._new_ino(st)
                opener = self.inner.open_append_stream if append else self.inner.open_output_stream
                target = opener(path, metadata=metadata)
            sink = _Sink(self, path, target, st.epoch, fault.error if fault else 0)
            sink.tear_at = tear.tear_at if tear else -1
        return pa.PythonFile(sink, mode="w")

    def _closed(self, sink: _Sink) -> None:
        """Finish a stream: refused after a power loss; on an object store, upload it now."""
        with self._state() as st:
            if st.epoch != sink.epoch:
                raise _io_error(errno.EIO, sink.path)
            st.ops.append(Op("close", sink.path))
            if self.object_store:
                with self.inner.open_output_stream(sink.path) as out:
                    out.write(sink.target.getvalue())


class _Sink:
    """The Python side of an output stream: passes bytes on (to the file, or to a buffer
    uploaded on close), dropping those past a tear and failing on an injected error."""

    def __init__(self, owner: FaultFs, path: str, target: Any, epoch: int, error: int) -> None:
        self.owner, self.path, self.target = owner, path, target
        self.epoch, self.error = epoch, error
        self.tear_at = -1
        self.pos = 0
        self.closed = False

    def write(self, data: Any) -> int:
        if self.error:
            raise _io_error(self.error, self.path)
        view = memoryview(data).cast("B")
        keep = view if self.tear_at < 0 else view[: max(0, self.tear_at - self.pos)]
        if len(keep):
            self.target.write(bytes(keep))
        self.pos += len(view)
        return len(view)

    def flush(self) -> None:
        pass

    def tell(self) -> int:
        return self.pos

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.owner.object_store:
            self.target.close()
        if self.error:
            raise _io_error(self.error, self.path)
        self.owner._closed(self)
