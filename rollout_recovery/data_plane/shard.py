"""StoreShard: one Ray actor holding the rows whose keys hash to it.

An async actor: every mutation is synchronous code on its event loop (atomic), while snapshot
file writing and restore reading run in a thread so puts and gets go on meanwhile. Rows arrive
and leave as Arrow tables, which Ray moves through its shared-memory object store without a
per-token copy.
"""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.fs as pafs

from rollout_recovery.crashpoints import crash_point
from rollout_recovery.data_plane.errors import SnapshotCorruptError, UnknownPartitionError
from rollout_recovery.data_plane.filesystem import join, resolve
from rollout_recovery.data_plane.partition import FrozenPartition, Lease, PartitionTable
from rollout_recovery.data_plane.schemas import SCHEMAS, conform, schema_version
from rollout_recovery.data_plane.snapshot_io import (
    FileEntry,
    LeaseEntry,
    read_partitions,
    write_table_checksummed,
)

# Fault injection for tests: seconds to sleep after each snapshot file is written.
FAULT_SLEEP_ENV = "ROLLOUT_RECOVERY_FAULT_SNAPSHOT_SLEEP_S"
# Snapshot files are split into segments of about this size so they are written, hashed and
# verified in parallel.
SEGMENT_BYTES = 16 << 20
_POOL: ThreadPoolExecutor | None = None


def _io_pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)))
    return _POOL


def shard_of(key: str, num_shards: int) -> int:
    """Stable key-hash placement (same in every process and across restarts)."""
    import zlib

    return zlib.crc32(key.encode()) % num_shards if num_shards > 1 else 0


class StoreShard:
    def __init__(self, shard_index: int, num_shards: int, partitions: dict[str, str]) -> None:
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.partitions = {
            name: PartitionTable(name, SCHEMAS[kind]) for name, kind in partitions.items()
        }
        self.kinds = dict(partitions)
        self.leases: dict[str, Lease] = {}
        self.next_seq = 0
        self._pending_restore: tuple[dict[str, pa.Table], int] | None = None
        self._frozen: dict[str, tuple[list[FrozenPartition], list[LeaseEntry]]] = {}

    def _part(self, name: str) -> PartitionTable:
        try:
            return self.partitions[name]
        except KeyError:
            raise UnknownPartitionError(
                f"unknown partition {name!r}; known: {sorted(self.partitions)}"
            ) from None

    def _unlease(self, keys: list[str]) -> None:
        for key in keys:
            for lease in self.leases.values():
                if key in lease.keys:
                    lease.keys.remove(key)

    def _expire(self) -> None:
        now = time.monotonic()
        for lease_id in [i for i, le in self.leases.items() if le.expires_at <= now]:
            lease = self.leases.pop(lease_id)
            self.partitions[lease.partition].release(lease.keys, lease_id)

    # ------------------------------------------------------------------ rows

    async def put(self, partition: str, table: pa.Table) -> int:
        part = self._part(partition)
        table = conform(table, part.schema, f"put to {partition!r}")
        n, released = part.put(table, self.next_seq)
        self.next_seq += n
        self._unlease(released)
        return n

    async def get(self, partition: str, keys: list[str]) -> tuple[pa.Table, list[str]]:
        return self._part(partition).get(keys)

    async def delete(self, partition: str, keys: list[str]) -> int:
        n, released = self._part(partition).delete(keys, self.next_seq)
        self.next_seq += 1  # a later put is ordered after this delete
        self._unlease(released)
        return n

    async def list_keys(self, partition: str, prefix: str) -> list[str]:
        return self._part(partition).list_keys(prefix)

    async def lease(
        self, partition: str, consumer: str, max_rows: int, ttl_s: float, lease_id: str,
        keys: list[str] | None = None,
    ) -> pa.Table:  # fmt: skip
        """Lease up to `max_rows` available rows, oldest first, or those of `keys` available."""
        part = self._part(partition)
        self._expire()
        if keys is None:
            keys = part.take_available(max_rows, lease_id)
        else:
            keys = part.take_keys(keys, lease_id)
        if keys:
            self.leases[lease_id] = Lease(
                lease_id, partition, consumer, keys, time.monotonic() + ttl_s
            )
        return part.get(keys)[0]

    async def ack(self, lease_id: str) -> int:
        self._expire()
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return 0
        n = self.partitions[lease.partition].consume(lease.keys, lease_id, self.next_seq)
        self.next_seq += 1
        return n

    async def stats(self) -> dict[str, dict[str, int]]:
        self._expire()
        return {
            name: {"rows": len(p), "leased": len(p.leased), "batches": len(p.batches)}
            for name, p in self.partitions.items()
        }

    # ------------------------------------------------------------------ snapshots

    async def freeze(self, token: str, since: int | None, keep_changes_from: int | None) -> dict:
        """Freeze this shard atomically for snapshot `token` (every row, or with `since` the
        changes since that boundary); its files are written by `write`. Changes logged before
        `keep_changes_from` (the published parent's boundary; None: this freeze's own) are
        forgotten. Returns the boundary and the row counts."""
        self._expire()
        frozen = [p.freeze(since) for p in self.partitions.values()]
        leases = [
            LeaseEntry(lease_id=le.lease_id, partition=le.partition, consumer=le.consumer,
                       shard=self.shard_index, keys=list(le.keys))
            for le in self.leases.values()
            if le.keys
        ]  # fmt: skip
        boundary = self.next_seq
        for part in self.partitions.values():
            part.prune_logs(boundary if keep_changes_from is None else keep_changes_from)
        while len(self._frozen) >= 4:  # freezes never written (their attempt failed)
            self._frozen.pop(next(iter(self._frozen)))
        self._frozen[token] = (frozen, leases)
        return {"boundary": boundary, "rows": {c.name: c.live_rows for c in frozen},
                "changed_rows": sum(len(c.positions) for c in frozen)}  # fmt: skip

    async def write(
        self, token: str, snapshot_dir_uri: str, filesystem: pafs.FileSystem | None = None
    ) -> tuple[list[FileEntry], list[LeaseEntry]]:
        """Write the files of freeze `token` off the event loop (through `filesystem` when
        given instead of the URI's own)."""
        frozen, leases = self._frozen.pop(token)
        loop = asyncio.get_running_loop()
        files = await loop.run_in_executor(
            None, self._write_files, snapshot_dir_uri, frozen, filesystem
        )
        return files, leases

    async def discard(self, token: str) -> None:
        self._frozen.pop(token, None)

    def _write_files(
        self,
        snapshot_dir_uri: str,
        frozen: list[FrozenPartition],
        filesystem: pafs.FileSystem | None = None,
    ):
        """Write each partition as segments of <= SEGMENT_BYTES, several at a time, so that
        writing and hashing (and later verifying) use every core."""
        fs, root = resolve(snapshot_dir_uri, filesystem)
        sleep_s = float(os.environ.get(FAULT_SLEEP_ENV, "0") or 0)
        jobs = []
        for cap in frozen:
            if cap.deleted:
                rel = f"shard-{self.shard_index:03d}/{cap.name}.deletes.arrow"
                jobs.append((cap.name, rel, cap.deletes_table(), "deletes"))
            if len(cap.positions) == 0:
                continue  # an empty partition needs no file; restore leaves it empty
            table = cap.to_table()
            segments = max(1, -(-table.nbytes // SEGMENT_BYTES))
            per = -(-table.num_rows // segments)
            for k in range(segments):
                rel = f"shard-{self.shard_index:03d}/{cap.name}.{k:04d}.arrow"
                jobs.append((cap.name, rel, table.slice(k * per, per), "rows"))

        def write(job) -> FileEntry:
            name, rel, table, content = job
            sha, size = write_table_checksummed(fs, join(root, rel), table)
            crash_point("snapshot_file_written")
            if sleep_s:
                time.sleep(sleep_s)
            kind = self.kinds[name]
            return FileEntry(
                path=rel,
                partition=name,
                shard=self.shard_index,
                row_kind=kind,
                schema_version=schema_version(SCHEMAS[kind]),
                rows=table.num_rows,
                bytes=size,
                sha256=sha,
                content=content,
            )

        return list(_io_pool().map(write, jobs))

    async def restore_prepare(
        self,
        snapshot_dir_uri: str,
        files: list[FileEntry],
        num_shards_written: int,
        filesystem: pafs.FileSystem | None = None,
        boundary: int = 0,
    ) -> int:
        """Read and verify this shard's rows from a snapshot (the files of its chain, resolved
        to the rows live at its freeze), staged until commit. `boundary`: the seq the shard
        had reached when the snapshot was frozen; later puts must be ordered after it."""
        loop = asyncio.get_running_loop()
        staged = await loop.run_in_executor(
            None, self._read_files, snapshot_dir_uri, files, num_shards_written, filesystem
        )
        self._pending_restore = (staged, boundary)
        return sum(t.num_rows for t in staged.values())

    def _read_files(
        self,
        snapshot_dir_uri: str,
        files: list[FileEntry],
        num_shards_written: int,
        filesystem: pafs.FileSystem | None = None,
    ):
        fs, root = resolve(snapshot_dir_uri, filesystem)
        for entry in files:
            if entry.partition not in self.partitions:
                raise SnapshotCorruptError(
                    f"snapshot file {entry.path} is for partition {entry.partition!r}, "
                    f"which this store does not have"
                )
        mine = None
        if num_shards_written != self.num_shards:
            mine = lambda key: shard_of(key, self.num_shards) == self.shard_index  # noqa: E731
        tables = read_partitions(fs, root, files, _io_pool(), mine)
        out = {}
        for name, table in tables.items():
            schema = self.partitions[name].schema
            body = conform(table.drop_columns(["_seq"]), schema, f"snapshot of {name!r}")
            out[name] = body.append_column("_seq", table.column("_seq"))
        return out

    async def restore_commit(self) -> None:
        if self._pending_restore is None:
            raise RuntimeError("restore_commit without a prepared restore")
        (staged, boundary), self._pending_restore = self._pending_restore, None
        self.leases.clear()
        self._frozen.clear()
        next_seq = boundary
        for name, part in list(self.partitions.items()):
            if name in staged:
                self.partitions[name], after = PartitionTable.loaded(name, part.schema,
                                                                     staged[name])  # fmt: skip
                next_seq = max(next_seq, after)
            else:
                self.partitions[name] = PartitionTable(name, part.schema)
        self.next_seq = next_seq

    async def restore_abort(self) -> None:
        self._pending_restore = None
