"""Incremental snapshots on real shard actors and real files (local and the S3 test server):
a snapshot between two full ones writes only what changed, lists its parent's files by
reference, restores to exactly the store it frozen, and keeps every guarantee of a full one
(checksums over the whole chain, retention never breaking a kept chain)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pytest

from rollout_recovery.data_plane import StagingStore
from rollout_recovery.data_plane.errors import SnapshotCorruptError
from rollout_recovery.data_plane.snapshot_io import PublishGate, SnapshotAborted, published_uris
from rollout_recovery.testing.campaign.snapshot_files import same_rows, store_rows
from tests.cluster.store_helpers import chunk_table, local_s3, replay_table

pytestmark = pytest.mark.cluster


def _keys(prefix: str, n: int, start: int = 0) -> list[str]:
    return [f"{prefix}/{i:05d}" for i in range(start, start + n)]


def _restored(make_store, uri: str, shards: int = 1) -> dict[str, pa.Table]:
    fresh = make_store(shards)
    fresh.put("replay", replay_table(["stale/1"]))  # replaced by the restore
    fresh.restore(uri)
    return store_rows(fresh)


def _churn(store: StagingStore, round_: int) -> None:
    """New rows, replaced rows, deleted rows and an acked lease: every kind of change."""
    store.put("rollout_staging", chunk_table(_keys(f"n{round_}", 20)))
    store.put("rollout_staging", chunk_table(_keys("base", 5, start=10 * round_), tokens=9))
    store.delete("rollout_staging", _keys("base", 3, start=100 + 10 * round_))
    lease = store.lease("replay", "trainer", 2)
    store.ack(lease.lease_id)


def test_incremental_chain_restores_exactly_what_each_snapshot_captured(make_store, tmp_path):
    root = str(tmp_path / "snaps")
    store = make_store(2)
    store.put("rollout_staging", chunk_table(_keys("base", 400)))
    store.put("replay", replay_table(_keys("r", 30)))
    full = store.snapshot(root, full_every=3)
    expected = {full.uri: store_rows(store)}
    assert full.manifest.body.base is None and full.manifest.body.chain_length == 1
    snaps = [full]
    for round_ in range(1, 4):
        _churn(store, round_)
        snap = store.snapshot(root, full_every=3)
        expected[snap.uri] = store_rows(store)
        snaps.append(snap)
    bodies = [s.manifest.body for s in snaps]
    # full, incremental, incremental, full again (the chain is bounded by full_every).
    assert [b.base is not None for b in bodies] == [False, True, True, False]
    assert [b.chain_length for b in bodies] == [1, 2, 3, 1]
    inc = bodies[1]
    assert inc.base == Path(snaps[0].uri).name and inc.chain() == [Path(snaps[0].uri).name]
    # Only the changes were written: 25 rows put into staging, the deletes, no replay rows
    # (the ack is a delete).
    own = [f for f in inc.files if f.snapshot is None]
    assert sum(f.rows for f in own if f.content == "rows") == 25
    deletes = [f for f in own if f.content == "deletes"]
    assert {f.partition for f in deletes} == {"rollout_staging", "replay"}
    # A replaced row needs no delete: its new version has the higher seq.
    assert sum(f.rows for f in deletes if f.partition == "rollout_staging") == 3
    assert inc.written_bytes < bodies[0].written_bytes / 4
    assert inc.payload_bytes == sum(f.bytes for f in inc.files)
    assert set(bodies[2].chain()) == {Path(snaps[0].uri).name, Path(snaps[1].uri).name}
    for snap in snaps:
        StagingStore.verify(snap.uri, use_cache=False)
        assert same_rows(_restored(make_store, snap.uri, shards=2), expected[snap.uri])
    # Onto another shard count, too.
    assert same_rows(_restored(make_store, snaps[2].uri, shards=3), expected[snaps[2].uri])


def test_deleted_and_replaced_rows_do_not_come_back(make_store, tmp_path):
    """A restore that ignored the chain's deletes (or kept an older version of a replaced
    row) would resurrect rows; this pins both down."""
    root = str(tmp_path / "snaps")
    store = make_store(1)
    store.put("rollout_staging", chunk_table(_keys("k", 10)))
    store.snapshot(root, full_every=8)
    store.delete("rollout_staging", _keys("k", 4))
    store.put("rollout_staging", chunk_table(_keys("k", 2, start=8), tokens=3))  # replaced
    store.put("rollout_staging", chunk_table(_keys("k", 1)))  # deleted, then put again
    snap = store.snapshot(root, full_every=8)
    assert snap.manifest.body.base is not None
    rows = _restored(make_store, snap.uri)["rollout_staging"]
    assert rows.column("key").to_pylist() == _keys("k", 1) + _keys("k", 6, start=4)
    lengths = dict(zip(rows.column("key").to_pylist(),
                       rows.column("token_ids").to_pylist(), strict=True))  # fmt: skip
    assert len(lengths["k/00008"]) == 3 and len(lengths["k/00004"]) == 64


def test_an_unpublished_snapshot_is_never_a_parent(make_store, tmp_path):
    root = str(tmp_path / "snaps")
    store = make_store(1)
    store.put("rollout_staging", chunk_table(_keys("a", 50)))
    first = store.snapshot(root, full_every=8)
    store.put("rollout_staging", chunk_table(_keys("b", 7)))
    gate = PublishGate()
    gate.abort()
    with pytest.raises(SnapshotAborted):
        store.write(store.freeze(root, full_every=8), gate=gate)
    store.delete("rollout_staging", _keys("a", 2))
    second = store.snapshot(root, full_every=8)
    body = second.manifest.body
    assert body.base == Path(first.uri).name  # not the aborted one
    assert sum(f.rows for f in body.files if f.snapshot is None and f.content == "rows") == 7
    assert same_rows(_restored(make_store, second.uri), store_rows(store))


def test_a_flipped_byte_in_a_referenced_file_fails_the_incremental_snapshot(make_store, tmp_path):
    root = tmp_path / "snaps"
    store = make_store(1)
    store.put("replay", replay_table(_keys("r", 40)))
    first = store.snapshot(str(root), full_every=8)
    store.put("replay", replay_table(_keys("s", 3)))
    second = store.snapshot(str(root), full_every=8)
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    victim = copy / Path(first.uri).name / "shard-000" / "replay.0000.arrow"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    target = make_store(1)
    target.put("replay", replay_table(["keep/1"]))
    broken = str(copy / Path(second.uri).name)
    with pytest.raises(SnapshotCorruptError, match=r"\.\./snapshot-\d+-\w+/shard-000/replay"):
        StagingStore.verify(broken, use_cache=False)
    with pytest.raises(SnapshotCorruptError, match=r"replay\.0000\.arrow fails its sha256"):
        target.restore(broken)
    assert target.list("replay") == ["keep/1"]  # a refused restore changes nothing


def test_a_parent_with_a_missing_file_makes_the_next_snapshot_full(make_store, tmp_path):
    root = tmp_path / "snaps"
    store = make_store(1)
    store.put("replay", replay_table(_keys("r", 40)))
    first = store.snapshot(str(root), full_every=8)
    (Path(first.uri) / "shard-000" / "replay.0000.arrow").unlink()
    store.put("replay", replay_table(_keys("s", 3)))
    second = store.snapshot(str(root), full_every=8)
    assert second.manifest.body.base is None
    assert same_rows(_restored(make_store, second.uri), store_rows(store))


def test_retention_keeps_every_directory_a_kept_snapshot_references(make_store, tmp_path):
    root = tmp_path / "snaps"
    store = make_store(1)
    store.put("replay", replay_table(_keys("r", 40)))
    names = []
    for i in range(3):  # full, incremental, incremental
        store.put("replay", replay_table(_keys(f"x{i}", 2)))
        names.append(Path(store.snapshot(str(root), full_every=3).uri).name)
        StagingStore.gc(str(root), keep_latest_k=1)
    # Only the newest is kept, but it lists files of both older ones: they stay, published.
    assert sorted(p.name for p in root.glob("snapshot-*")) == names
    assert [Path(u).name for u in published_uris(str(root))] == names
    latest = StagingStore.latest(str(root))
    assert Path(latest).name == names[-1]
    assert same_rows(_restored(make_store, latest), store_rows(store))
    store.put("replay", replay_table(_keys("y", 2)))
    full = store.snapshot(str(root), full_every=3)  # the chain is full: a new full one
    assert full.manifest.body.base is None
    StagingStore.gc(str(root), keep_latest_k=1)
    assert [p.name for p in root.glob("snapshot-*")] == [Path(full.uri).name]


def test_after_a_restore_the_next_snapshot_is_full(make_store, tmp_path):
    root = str(tmp_path / "snaps")
    store = make_store(1)
    store.put("replay", replay_table(_keys("r", 10)))
    store.snapshot(root, full_every=8)
    store.put("replay", replay_table(_keys("s", 2)))
    inc = store.snapshot(root, full_every=8)
    store.restore(inc.uri)
    store.put("replay", replay_table(_keys("t", 2)))
    after = store.snapshot(root, full_every=8)
    assert after.manifest.body.base is None
    # Seqs after a restore follow the frozen ones, so a later incremental orders its rows
    # after the restored ones.
    store.delete("replay", _keys("r", 1))
    later = store.snapshot(root, full_every=8)
    assert later.manifest.body.base == Path(after.uri).name
    assert same_rows(_restored(make_store, later.uri), store_rows(store))


def test_incremental_snapshots_on_s3(make_store):
    from rollout_recovery.data_plane.filesystem import resolve

    with local_s3("rr-inc", "snaps") as root:
        fs, _ = resolve(root)
        fs.create_dir("rr-inc")
        store = make_store(2)
        store.put("rollout_staging", chunk_table(_keys("s3", 60)))
        store.snapshot(root, full_every=4)
        _churn(store, 1)
        inc = store.snapshot(root, full_every=4)
        assert inc.manifest.body.base is not None
        StagingStore.verify(inc.uri, use_cache=False)
        assert StagingStore.gc(root, keep_latest_k=1) == []  # the parent is referenced
        assert same_rows(_restored(make_store, inc.uri, shards=2), store_rows(store))


def test_inspection_counts_rows_and_names_a_damaged_file_of_the_chain(make_store, tmp_path):
    from rollout_recovery.cli.inspection import (
        list_snapshots,
        show_snapshot,
        verify_location,
    )

    root = tmp_path / "snaps"
    store = make_store(1)
    store.put("replay", replay_table(_keys("r", 40)))
    first = store.snapshot(str(root), full_every=8)
    store.delete("replay", _keys("r", 5))
    store.put("replay", replay_table(_keys("s", 3)))
    second = store.snapshot(str(root), full_every=8)
    _, summaries = list_snapshots(str(root))
    assert [s.rows["replay"] for s in summaries] == [40, 38]  # live rows, not file rows
    shown = [f.path for f in show_snapshot(str(root), Path(second.uri).name).files]
    assert f"../{Path(first.uri).name}/shard-000/replay.0000.arrow" in shown
    assert all(r.ok for r in verify_location(str(root)))
    victim = Path(first.uri) / "shard-000" / "replay.0000.arrow"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    bad = {r.name: r for r in verify_location(str(root))}
    assert not bad[Path(second.uri).name].ok
    assert bad[Path(second.uri).name].file.startswith(f"../{Path(first.uri).name}/")
    victim.unlink()
    _, summaries = list_snapshots(str(root))
    assert summaries[1].status == "damaged" and "missing" in summaries[1].problem


def test_a_snapshot_into_another_root_keeps_the_changes_this_root_needs(make_store, tmp_path):
    """The shards log changes once for every root: a full snapshot elsewhere must not forget
    the changes an incremental one here still needs."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    store = make_store(1)
    store.put("replay", replay_table(_keys("r", 100)))
    store.snapshot(a, full_every=8)
    store.put("replay", replay_table(_keys("s", 50)))
    store.snapshot(b)  # full, into another root
    inc = store.snapshot(a, full_every=8)
    assert inc.manifest.body.base is not None
    assert same_rows(_restored(make_store, inc.uri), store_rows(store))
