"""The change log behind incremental snapshots, on one partition (pure logic): what a freeze
since a boundary holds, and that a partition never snapshotted logs nothing."""

from __future__ import annotations

import pyarrow as pa
import pytest

from rollout_recovery.data_plane.partition import PartitionTable

SCHEMA = pa.schema([("key", pa.string()), ("v", pa.int64())])


def _rows(keys: list[str]) -> pa.Table:
    return pa.table({"key": keys, "v": list(range(len(keys)))}, schema=SCHEMA)


def test_a_partition_never_captured_logs_no_changes():
    part = PartitionTable("p", SCHEMA)
    for i in range(50):
        part.put(_rows([f"k{i}"]), i)
    part.delete(["k1", "k2"], 50)
    assert part.put_log == [] and part.delete_log == []
    with pytest.raises(RuntimeError, match="logged no changes since"):
        part.freeze(since=0)


def test_a_capture_since_a_boundary_holds_only_the_changes():
    part = PartitionTable("p", SCHEMA)
    part.put(_rows(["a", "b", "c"]), 0)
    full = part.freeze()  # boundary 3: changes are logged from here on
    assert len(full.positions) == 3 and full.deleted is None
    part.put(_rows(["b", "d"]), 3)  # b replaced, d new
    part.delete(["a"], 5)
    inc = part.freeze(since=3)
    assert sorted(inc.seqs.tolist()) == [3, 4] and inc.deleted == [(5, "a")]
    assert inc.live_rows == 3
    part.prune_logs(6)
    assert part.put_log == [] and part.delete_log == []
