"""The rows of one partition on one shard: immutable Arrow batches plus a key index and leases.

Pure logic (no Ray), so it can be tested directly. Every mutation is a plain synchronous call;
the shard actor runs them on its event loop, which makes each one atomic with respect to the
others and to a snapshot's freeze.

For incremental snapshots a partition also logs what changed: every put as (seq, key) and
every delete as (op seq, key), both in increasing seq order. A freeze `since` a boundary
(the shard's next seq when the parent snapshot was frozen) reads only the rows put since
then and the keys deleted since then, without scanning the index; the logs are pruned below
the boundary of the newest published snapshot (the parent of every later one).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from rollout_recovery.data_plane.errors import BadInputError

SEQ_COLUMN = "_seq"


@dataclass
class Lease:
    lease_id: str
    partition: str
    consumer: str
    keys: list[str]
    expires_at: float


DELETES_SCHEMA = pa.schema([("key", pa.string()), (SEQ_COLUMN, pa.int64())])


@dataclass
class FrozenPartition:
    """A snapshot's view of a partition: references to immutable batches, rows in seq order.
    An incremental freeze holds only the rows put since its boundary, plus `deleted`: the
    keys deleted since then with the op seq of their delete (a row of that key with a lower
    seq is gone)."""

    name: str
    schema: pa.Schema
    batches: list[pa.Table]
    offsets: list[int]
    positions: np.ndarray  # global row positions, in seq order
    seqs: np.ndarray
    deleted: list[tuple[int, str]] | None = None  # None: a full freeze
    live_rows: int = 0  # rows in the partition at freeze

    def to_table(self) -> pa.Table:
        base = _select(self.batches, self.offsets, self.positions, self.schema)
        return base.append_column(SEQ_COLUMN, pa.array(self.seqs, pa.int64()))

    def deletes_table(self) -> pa.Table:
        seqs, keys = zip(*self.deleted, strict=True) if self.deleted else ((), ())
        return pa.table(
            [pa.array(keys, pa.string()), pa.array(seqs, pa.int64())], schema=DELETES_SCHEMA
        )


def _select(batches: list[pa.Table], offsets: list[int], positions: np.ndarray, schema) -> pa.Table:
    """Rows at global positions; contiguous runs become zero-copy slices."""
    if len(positions) == 0 or not batches:
        return schema.empty_table()
    combined = pa.concat_tables(batches) if len(batches) > 1 else batches[0]
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    if len(breaks) + 1 > max(8, len(positions) // 64):
        return combined.take(pa.array(positions))
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(positions)]))
    pieces = [
        combined.slice(int(positions[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)
    ]
    return pa.concat_tables(pieces) if len(pieces) > 1 else pieces[0]


@dataclass
class PartitionTable:
    name: str
    schema: pa.Schema
    batches: list[pa.Table] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # global position of each batch's row 0
    index: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> (position, seq)
    available: dict[str, int] = field(default_factory=dict)  # unleased keys -> seq
    available_sorted: bool = True
    leased: dict[str, str] = field(default_factory=dict)  # key -> lease id
    dead_rows: int = 0
    put_log: list[tuple[int, str]] = field(default_factory=list)  # (seq, key), seq order
    delete_log: list[tuple[int, str]] = field(default_factory=list)  # (op seq, key)
    # Changes are logged from the first freeze on: before it no snapshot can be a parent, and
    # a store never snapshotted must not keep a log of every put.
    logging: bool = False

    @property
    def total_rows(self) -> int:
        return self.offsets[-1] + self.batches[-1].num_rows if self.batches else 0

    def __len__(self) -> int:
        return len(self.index)

    def put(self, table: pa.Table, next_seq: int) -> tuple[int, list[str]]:
        """Insert or replace rows; returns (rows, keys taken out of their leases)."""
        keys = table.column("key").to_pylist()
        if len(set(keys)) != len(keys):
            raise BadInputError(f"put to {self.name!r}: duplicate keys in one batch")
        base = self.total_rows
        self.batches.append(table.combine_chunks())
        self.offsets.append(base)
        released = []
        for i, key in enumerate(keys):
            if self._drop(key):
                released.append(key)
            self.index[key] = (base + i, next_seq + i)
            self.available[key] = next_seq + i
        if self.logging:
            self.put_log.extend(zip(range(next_seq, next_seq + len(keys)), keys, strict=True))
        self._maybe_compact()
        return len(keys), released

    def _drop(self, key: str) -> bool:
        """Remove a key's row; True if it was leased."""
        if self.index.pop(key, None) is None:
            return False
        self.dead_rows += 1
        self.available.pop(key, None)
        return self.leased.pop(key, None) is not None

    def get(self, keys: list[str]) -> tuple[pa.Table, list[str]]:
        """Rows for the keys that exist, in the order asked; plus the missing keys."""
        found = [self.index[k][0] for k in keys if k in self.index]
        missing = [k for k in keys if k not in self.index]
        positions = np.fromiter(found, dtype=np.int64, count=len(found))
        return _select(self.batches, self.offsets, positions, self.schema), missing

    def delete(self, keys: list[str], op_seq: int) -> tuple[int, list[str]]:
        """Delete rows; `op_seq` orders the delete after every row put before it."""
        deleted, released = 0, []
        for k in keys:
            if k in self.index:
                deleted += 1
                if self.logging:
                    self.delete_log.append((op_seq, k))
                if self._drop(k):
                    released.append(k)
        self._maybe_compact()
        return deleted, released

    def list_keys(self, prefix: str) -> list[str]:
        return sorted(k for k in self.index if k.startswith(prefix))

    def take_available(self, max_rows: int, lease_id: str) -> list[str]:
        if not self.available_sorted:
            self.available = dict(sorted(self.available.items(), key=lambda kv: kv[1]))
            self.available_sorted = True
        keys = list(itertools.islice(self.available, max_rows))
        for k in keys:
            del self.available[k]
            self.leased[k] = lease_id
        return keys

    def take_keys(self, keys: list[str], lease_id: str) -> list[str]:
        """Lease those of `keys` that are available (present and not leased)."""
        taken = [k for k in dict.fromkeys(keys) if k in self.available]
        for k in taken:
            del self.available[k]
            self.leased[k] = lease_id
        return taken

    def release(self, keys: list[str], lease_id: str) -> None:
        """Make a lease's rows available again (expired lease)."""
        for k in keys:
            if self.leased.get(k) == lease_id:
                del self.leased[k]
                self.available[k] = self.index[k][1]
                self.available_sorted = False

    def consume(self, keys: list[str], lease_id: str, op_seq: int) -> int:
        """Ack: delete the rows still held by this lease."""
        n = 0
        for k in keys:
            if self.leased.get(k) == lease_id:
                if self.logging:
                    self.delete_log.append((op_seq, k))
                self._drop(k)
                n += 1
        self._maybe_compact()
        return n

    def freeze(self, since: int | None = None) -> FrozenPartition:
        """Every row (`since` None), or only what changed since the boundary `since`: the
        rows put at or after it that are still live, and the keys deleted at or after it."""
        if since is not None and not self.logging:
            raise RuntimeError(f"partition {self.name!r} logged no changes since {since}")
        self.logging = True
        if since is None:
            items = sorted(self.index.values(), key=lambda ps: ps[1])
            deleted = None
        else:
            start = bisect.bisect_left(self.put_log, (since, ""))
            items = []
            for seq, key in itertools.islice(self.put_log, start, None):
                entry = self.index.get(key)
                if entry is not None and entry[1] == seq:
                    items.append(entry)
            first = bisect.bisect_left(self.delete_log, (since, ""))
            deleted = self.delete_log[first:]
        arr = np.array(items, dtype=np.int64).reshape(-1, 2)
        return FrozenPartition(self.name, self.schema, list(self.batches), list(self.offsets),
                                 arr[:, 0], arr[:, 1], deleted, len(self.index))  # fmt: skip

    def prune_logs(self, below: int) -> None:
        """Forget changes before `below`: no later snapshot's parent is older than that."""
        if self.put_log and self.put_log[0][0] < below:
            del self.put_log[: bisect.bisect_left(self.put_log, (below, ""))]
        if self.delete_log and self.delete_log[0][0] < below:
            del self.delete_log[: bisect.bisect_left(self.delete_log, (below, ""))]

    @classmethod
    def loaded(cls, name: str, schema: pa.Schema, table: pa.Table) -> tuple[PartitionTable, int]:
        """A partition holding exactly the rows read from a snapshot (carrying their seq
        column), and the next seq after them."""
        seqs = table.column(SEQ_COLUMN).to_numpy()
        order = np.argsort(seqs, kind="stable")
        table = table.drop_columns([SEQ_COLUMN])
        if len(order) and np.any(np.diff(order) != 1):
            table = table.take(pa.array(order))
        seqs = seqs[order]
        part = cls(name, schema)
        if table.num_rows:
            # Keep the snapshot's segments as batches: combining them would copy every row.
            for batch in table.to_batches():
                part.offsets.append(part.total_rows)
                part.batches.append(pa.Table.from_batches([batch]))
            keys = table.column("key").to_pylist()
            part.index = {k: (i, int(s)) for i, (k, s) in enumerate(zip(keys, seqs, strict=True))}
            part.available = {k: int(s) for k, s in zip(keys, seqs, strict=True)}
        return part, int(seqs.max()) + 1 if len(seqs) else 0

    def _maybe_compact(self) -> None:
        """Rewrite live rows into one batch when dead rows dominate or batches pile up."""
        total = self.total_rows
        if not total or (self.dead_rows * 2 <= total and len(self.batches) <= 256):
            return
        if not self.index:
            self.batches, self.offsets, self.dead_rows = [], [], 0
            return
        keys = list(self.index)
        positions = np.fromiter((self.index[k][0] for k in keys), np.int64, count=len(keys))
        table = _select(self.batches, self.offsets, positions, self.schema).combine_chunks()
        self.batches, self.offsets, self.dead_rows = [table], [0], 0
        self.index = {k: (i, self.index[k][1]) for i, k in enumerate(keys)}
