"""A storage outage for the chaos soak: every local write of a run fails with EIO while one is on.

`armed_env(state_dir)` puts every local path a run resolves, in all its processes, behind this
filesystem (the seam is production's `faults.local_filesystem`, as for testing/faultfs.py).
`begin(state_dir, seconds)` starts an outage from outside the run: until it ends, writes,
creates, moves, deletes and fsyncs raise OSError(EIO); reads go on. Unlike FaultFs nothing is
recorded or shadowed, so a long run behind it costs one small file read per operation at most.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from rollout_recovery import faults
from rollout_recovery.data_plane import filesystem
from rollout_recovery.testing.faultfs import ReadThrough

UNTIL = "outage_until"  # the outage's end (time.time()), in the state directory
_CHECK_EVERY_S = 0.05


def begin(state_dir: str | os.PathLike[str], seconds: float) -> float:
    """Fail every write of the armed run for `seconds` from now; returns the outage's end."""
    end = time.time() + seconds
    tmp = Path(state_dir) / f".{UNTIL}.tmp"
    tmp.write_text(repr(end))
    tmp.replace(Path(state_dir) / UNTIL)
    return end


def armed_env(state_dir: str | os.PathLike[str]) -> dict[str, str]:
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    return {faults.FAULTFS_ENV: os.fspath(state_dir), faults.FAULTFS_HOOK_ENV: HOOK}


class OutageFs(ReadThrough):
    """Delegates to `inner`, failing writes while the state directory's outage lasts."""

    object_store = False

    def __init__(self, inner: pafs.FileSystem, state_dir: str) -> None:
        self.inner, self.state_dir = inner, state_dir
        self._until, self._read_at = 0.0, 0.0

    def __reduce__(self) -> tuple[Any, ...]:
        return (OutageFs, (self.inner, self.state_dir))

    def _write(self, path: str) -> None:
        now = time.time()
        if now - self._read_at > _CHECK_EVERY_S:
            try:
                self._until = float((Path(self.state_dir) / UNTIL).read_text())
            except (OSError, ValueError):
                self._until = 0.0
            self._read_at = now
        if now < self._until:
            raise OSError(errno.EIO, f"{os.strerror(errno.EIO)} (injected storage outage)", path)

    def get_type_name(self) -> str:
        return "outage"

    def equals(self, other: Any) -> bool:
        return isinstance(other, OutageFs) and other.state_dir == self.state_dir

    def create_dir(self, path: str, recursive: bool) -> None:
        self._write(path)
        self.inner.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self._write(path)
        self.inner.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self._write(path)
        self.inner.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        raise OSError(errno.EPERM, "refusing to delete the root directory's contents")

    def delete_file(self, path: str) -> None:
        self._write(path)
        self.inner.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self._write(dest)
        self.inner.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self._write(dest)
        self.inner.copy_file(src, dest)

    def create_only(self, path: str, data: bytes) -> bool:
        self._write(path)
        return filesystem.create_only(self.inner, path, data)

    def fsync(self, path: str, directory: bool = False) -> None:
        self._write(path)
        if directory:
            filesystem.sync_dir(self.inner, path)
        else:
            filesystem.sync_file(self.inner, path)

    def open_output_stream(self, path: str, metadata: dict[str, str] | None) -> Any:
        self._write(path)
        return self.inner.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path: str, metadata: dict[str, str] | None) -> Any:
        self._write(path)
        return self.inner.open_append_stream(path, metadata=metadata)


def local_outage_filesystem(fs: pafs.FileSystem, state_dir: str) -> pafs.PyFileSystem:
    """The hook `armed_env` names."""
    return pafs.PyFileSystem(OutageFs(fs, state_dir))


HOOK = f"{__name__}:{local_outage_filesystem.__name__}"
