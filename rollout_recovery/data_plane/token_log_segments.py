"""The token log's durable copy: every chunk row a worker stages (token log and cut rows alike) is
also appended to checkpoint storage, so the rows outlive a whole-job crash, which loses the
in-memory staging store (docs/failover.md, "Whole-job restore").

Each append is one Arrow IPC file, `<token log root>/<writer>/<time_ns>-<n>.arrow`, written
atomically through `RunStorage` (temporary file, fsync, rename; one PUT on an object store):
a crash leaves whole segments or none. A restore reads the segments for the calls it wants
(`read`), and the controller deletes segments older than the retention window after each
published snapshot (`gc`). A segment that cannot be read is skipped and counted, never
trusted: the chain checks at restore decide what is used.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict

import pyarrow as pa

from rollout_recovery.data_plane.ownership import Fence
from rollout_recovery.data_plane.schemas import ChunkRow, table_to_chunk_rows
from rollout_recovery.protocol import CallIdentity
from rollout_recovery.storage import RunStorage

SUFFIX = ".arrow"


def _ipc_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


class TokenLogSegments:
    """One writer's segments under a token log root (a local path or any pyarrow.fs URI)."""

    def __init__(self, uri: str, writer: str, fence: Fence | None = None) -> None:
        self.storage, self.writer = RunStorage(uri, fence), writer  # fenced: see storage.py
        self._n = itertools.count()

    def append(self, table: pa.Table) -> str:
        """Write `table` (chunk rows) as the next segment; its path under the root."""
        rel = f"{self.writer}/{time.time_ns():020d}-{next(self._n):06d}{SUFFIX}"
        self.storage.write_bytes(rel, _ipc_bytes(table))
        return rel

    @staticmethod
    def segments(uri: str) -> list[tuple[int, str]]:
        """(time_ns, path under the root) of every segment, oldest first."""
        storage, out = RunStorage(uri), []
        for writer in storage.list_dir(""):
            for name in storage.list_dir(writer):
                stamp = name.split("-", 1)[0]
                if name.endswith(SUFFIX) and stamp.isdigit():
                    out.append((int(stamp), f"{writer}/{name}"))
        return sorted(out)

    @staticmethod
    def read(
        uri: str, wanted: set[CallIdentity]
    ) -> tuple[dict[CallIdentity, dict[int, ChunkRow]], int]:
        """The logged rows of the `wanted` call attempts, by chunk seq, and the number of
        segments that could not be read. Two different rows for one key make that call's
        rows unusable (the key maps to None)."""
        storage = RunStorage(uri)
        found: dict[CallIdentity, dict[int, ChunkRow | None]] = defaultdict(dict)
        unreadable = 0
        for _, rel in TokenLogSegments.segments(uri):
            try:
                table = pa.ipc.open_file(pa.py_buffer(storage.read_bytes(rel))).read_all()
                rows = table_to_chunk_rows(table)
            except (OSError, pa.ArrowException, ValueError):
                unreadable += 1
                continue
            for row in rows:
                ident = CallIdentity(row.rollout_id, row.model_call_id, row.attempt)
                if ident not in wanted:
                    continue
                seen = found[ident].get(row.chunk_seq)
                if row.chunk_seq in found[ident] and (seen is None or seen.digest != row.digest):
                    found[ident][row.chunk_seq] = None  # two versions of one row: doubt
                else:
                    found[ident][row.chunk_seq] = row
        return dict(found), unreadable

    @staticmethod
    def gc(uri: str, before_ns: int) -> int:
        """Delete segments written before `before_ns`; how many."""
        storage, n = RunStorage(uri), 0
        for stamp, rel in TokenLogSegments.segments(uri):
            if stamp < before_ns:
                storage.delete_file(rel)
                n += 1
        return n
