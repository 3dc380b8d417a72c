"""StagingStore on a real local Ray: rows, leases, snapshots, restore, sharding."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
import ray

from rollout_recovery.data_plane import (
    BadInputError,
    BatchTooLargeError,
    InvalidKeyError,
    SchemaMismatchError,
    SnapshotCorruptError,
    SnapshotError,
    StagingStore,
    StoreLimits,
    UnknownPartitionError,
)
from rollout_recovery.data_plane.snapshot_io import MANIFEST_NAME
from tests.cluster.store_helpers import (
    assert_rows_intact,
    by_key,
    chunk_table,
    local_s3,
    replay_table,
)

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]


def _keys(prefix: str, n: int, start: int = 0) -> list[str]:
    return [f"{prefix}/{i:05d}" for i in range(start, start + n)]


@pytest.mark.parametrize("shards", [1, 2])
def test_put_get_delete_list(make_store, shards):
    store = make_store(shards)
    keys = _keys("ro", 20)
    table = chunk_table(keys)
    assert store.put("rollout_staging", table) == 20
    got, missing = store.get("rollout_staging", [keys[5], "ro/absent", keys[2]])
    assert got.column("key").to_pylist() == [keys[5], keys[2]] and missing == ["ro/absent"]
    assert_rows_intact(got)
    assert store.list("rollout_staging", "ro/0001") == keys[10:20]
    assert store.delete("rollout_staging", [*keys[:5], "ro/absent"]) == 5
    assert store.list("rollout_staging") == keys[5:]
    # A put replaces rows by key.
    store.put("rollout_staging", chunk_table(keys[5:6], tokens=8))
    got, _ = store.get("rollout_staging", keys[5:6])
    assert got.column("delta_len").to_pylist() == [8]
    assert store.stats()["rollout_staging"]["rows"] == 15


def test_bad_input_is_refused_and_writes_nothing(make_store):
    store = make_store(2, StoreLimits(max_batch_rows=10, max_batch_bytes=1 << 20))
    keys = _keys("ro", 5)
    store.put("rollout_staging", chunk_table(keys))
    before = store.stats()
    with pytest.raises(UnknownPartitionError, match="unknown partition 'nope'"):
        store.put("nope", chunk_table(["ro/x"]))
    bad_type = chunk_table(["ro/x", "ro/y"])
    bad_type = bad_type.set_column(
        bad_type.schema.get_field_index("logprobs"),
        "logprobs",
        bad_type.column("logprobs").cast(pa.list_(pa.float64())),
    )
    with pytest.raises(SchemaMismatchError, match="column `logprobs`"):
        store.put("rollout_staging", bad_type)
    with pytest.raises(SchemaMismatchError, match="replay_row"):
        store.put("replay", chunk_table(["ro/x"]))
    with pytest.raises(BatchTooLargeError, match="max_batch_rows 10"):
        store.put("rollout_staging", chunk_table(_keys("big", 11)))
    with pytest.raises(BatchTooLargeError, match="max_batch_bytes"):
        store.put("rollout_staging", chunk_table(_keys("big", 3), tokens=100_000))
    for bad in ["-starts-with-dash", "has space", "", "a" * 600, "ünï"]:
        with pytest.raises(InvalidKeyError):
            store.put("rollout_staging", chunk_table(["ro/ok", bad]))
    with pytest.raises(BadInputError, match="duplicate keys"):
        store.put("rollout_staging", chunk_table(["ro/z", "ro/z"]))
    with pytest.raises(InvalidKeyError):
        store.get("rollout_staging", ["../etc"])
    with pytest.raises(BadInputError):
        store.get("rollout_staging", "ro/00001")
    with pytest.raises(InvalidKeyError):
        store.list("rollout_staging", "bad prefix")
    assert store.stats() == before
    assert store.list("rollout_staging") == keys


def test_lease_expiry_redelivery_and_idempotent_ack(make_store):
    store = make_store(1)
    keys = _keys("r", 10)
    store.put("replay", replay_table(keys))
    first = store.lease("replay", "trainer-a", 3, ttl_s=0.6)
    assert first.rows.column("key").to_pylist() == keys[:3]  # oldest first
    second = store.lease("replay", "trainer-b", 4, ttl_s=30)
    assert second.rows.column("key").to_pylist() == keys[3:7]
    time.sleep(0.8)
    # The expired lease's rows come back first, in their original order.
    third = store.lease("replay", "trainer-c", 5, ttl_s=30)
    assert third.rows.column("key").to_pylist() == keys[:3] + keys[7:9]
    assert store.ack(first.lease_id) == 0  # expired: nothing consumed
    assert store.ack(second.lease_id) == 4
    assert store.ack(second.lease_id) == 0  # a second ack is a no-op
    assert store.ack(third.lease_id) == 5
    assert store.list("replay") == [keys[9]]
    assert store.lease("replay", "t", 10).rows.column("key").to_pylist() == [keys[9]]


def test_put_over_a_leased_key_makes_the_new_row_deliverable(make_store):
    store = make_store(1)
    store.put("replay", replay_table(["r/1", "r/2"]))
    lease = store.lease("replay", "t", 2, ttl_s=30)
    store.put("replay", replay_table(["r/1"], tokens=5))
    assert store.ack(lease.lease_id) == 1  # only r/2 was still held
    again = store.lease("replay", "t", 5)
    assert again.rows.column("key").to_pylist() == ["r/1"]


def test_exactly_once_across_snapshot_and_restore(make_store, tmp_path):
    store = make_store(2)
    keys = _keys("r", 12)
    store.put("replay", replay_table(keys))
    acked = store.lease("replay", "t", 4, ttl_s=30)
    assert store.ack(acked.lease_id) == 4
    pending = store.lease("replay", "t", 3, ttl_s=30)  # leased, not acked at snapshot time
    snap = store.snapshot(str(tmp_path))
    assert {le.lease_id for le in snap.manifest.body.leases} == {pending.lease_id}
    # Work after the snapshot is lost with the crash...
    store.ack(pending.lease_id)
    restored = make_store(2)
    restored.restore(snap.uri)
    delivered = restored.lease("replay", "t2", 100, ttl_s=30).rows.column("key").to_pylist()
    acked_keys = set(acked.rows.column("key").to_pylist())
    pending_keys = set(pending.rows.column("key").to_pylist())
    assert not acked_keys & set(delivered)  # acked before the snapshot: never again
    assert pending_keys <= set(delivered)  # leased but unacked: delivered again
    assert sorted(delivered) == sorted(set(keys) - acked_keys)


def test_restore_reproduces_the_store_exactly(make_store, tmp_path):
    store = make_store(1)
    store.put("rollout_staging", chunk_table(_keys("a", 30)))
    store.put("rollout_staging", chunk_table(_keys("a", 10, start=25), tokens=7))  # overwrite
    store.delete("rollout_staging", _keys("a", 5, start=3))
    store.put("replay", replay_table(_keys("r", 9)))
    store.put("rollout_terminal", pa.Table.from_pylist([], schema=_terminal_schema()))
    snap = store.snapshot(str(tmp_path), meta={"step": "7"}, sidecars={"ledger.json": b"{}"})
    assert snap.manifest.body.meta == {"step": "7"}
    assert StagingStore.read_sidecar(snap.uri, "ledger.json") == b"{}"
    (Path(snap.uri) / "sidecars" / "ledger.json").write_bytes(b"[]")
    with pytest.raises(SnapshotCorruptError, match=r"sidecar ledger\.json fails"):
        StagingStore.read_sidecar(snap.uri, "ledger.json")
    (Path(snap.uri) / "sidecars" / "ledger.json").write_bytes(b"{}")
    fresh = make_store(1)
    fresh.put("replay", replay_table(["stale/1"]))  # replaced by the restore
    fresh.restore(snap.uri)
    for part in ("rollout_staging", "replay", "rollout_terminal"):
        keys = store.list(part)
        assert fresh.list(part) == keys
        a, _ = store.get(part, keys)
        b, _ = fresh.get(part, keys)
        assert a.equals(b), part
    # Delivery order survives too.
    assert (
        fresh.lease("rollout_staging", "t", 100).rows.column("key").to_pylist()
        == store.lease("rollout_staging", "t", 100).rows.column("key").to_pylist()
    )
    total = sum(f.bytes for f in snap.manifest.body.files)
    assert total == snap.manifest.body.payload_bytes


def _terminal_schema():
    from rollout_recovery.data_plane.schemas import TERMINAL_ROW_SCHEMA

    return TERMINAL_ROW_SCHEMA


@ray.remote
class _Writer:
    """Puts batches in a loop and records when each put returned."""

    def __init__(self, store: StagingStore, name: str) -> None:
        self.store, self.name, self.acked, self.stop = store, name, [], False

    async def run(self, batches: int) -> None:
        import asyncio

        for b in range(batches):
            keys = [f"{self.name}/{b:04d}/{i}" for i in range(8)]
            await self.store.aput("rollout_staging", chunk_table(keys, tokens=256))
            self.acked.append((time.monotonic(), keys))
            await asyncio.sleep(0)

    async def log(self):
        return self.acked

    async def count(self) -> int:
        return len(self.acked)


def test_concurrent_puts_during_snapshot(make_store, tmp_path):
    store = make_store(2)
    writers = [_Writer.remote(store, f"w{i}") for i in range(3)]
    batches = 400
    runs = [w.run.remote(batches) for w in writers]
    deadline = time.monotonic() + 60
    while min(ray.get([w.count.remote() for w in writers])) < 20:
        assert time.monotonic() < deadline, "writers did not start"
        time.sleep(0.02)
    began = time.monotonic()
    snap = store.snapshot(str(tmp_path))
    ray.get(runs)
    logs = [entry for w in writers for entry in ray.get(w.log.remote())]
    restored = make_store(2)
    restored.restore(snap.uri)
    present = set(restored.list("rollout_staging"))
    acked_before = {k for t, keys in logs if t < began for k in keys}
    assert acked_before, "some puts finished before the snapshot began"
    assert acked_before <= present
    assert len(present) < 3 * batches * 8, "the snapshot ran while puts were still going on"
    rows, missing = restored.get("rollout_staging", sorted(present))
    assert not missing
    assert_rows_intact(rows)


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_any_snapshot_file_is_detected(make_store, tmp_path):
    store = make_store(1)
    store.put("rollout_staging", chunk_table(_keys("a", 20)))
    store.put("replay", replay_table(_keys("r", 6)))
    snap = store.snapshot(str(tmp_path / "root"))
    snap_dir = Path(snap.uri)
    files = sorted(p for p in snap_dir.rglob("*") if p.is_file())
    assert len(files) == 3  # two non-empty partitions + manifest
    target = make_store(1)
    target.put("replay", replay_table(["keep/1"]))
    for f in files:
        copy = tmp_path / f"copy-{f.name}" / snap_dir.name
        shutil.copytree(snap_dir, copy)
        rel = f.relative_to(snap_dir)
        _flip_byte(copy / rel)
        with pytest.raises(SnapshotCorruptError, match=str(rel.name)):
            target.restore(str(copy))
        # A refused restore changes nothing.
        assert target.list("replay") == ["keep/1"]
        assert target.list("rollout_staging") == []
    # A truncated file and a missing one are refused too.
    copy = tmp_path / "truncated" / snap_dir.name
    shutil.copytree(snap_dir, copy)
    victim = copy / "shard-000" / "replay.0000.arrow"
    victim.write_bytes(victim.read_bytes()[:-10])
    with pytest.raises(SnapshotCorruptError, match=r"replay\.0000\.arrow has"):
        target.restore(str(copy))
    victim.unlink()
    with pytest.raises(SnapshotCorruptError, match=r"replay\.0000\.arrow is missing"):
        target.restore(str(copy))
    target.restore(snap.uri)
    assert len(target.list("rollout_staging")) == 20


def test_sigkill_mid_snapshot_keeps_previous_snapshot(make_store, tmp_path):
    root = tmp_path / "snaps"
    script = tmp_path / "driver.py"
    script.write_text(
        f"""
import os, sys
sys.path.insert(0, {str(REPO)!r})
import ray
from rollout_recovery.data_plane import StagingStore
from tests.cluster.store_helpers import chunk_table

if __name__ == "__main__":
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    store = StagingStore.create(num_shards=1)
    store.put("rollout_staging", chunk_table([f"a/{{i}}" for i in range(50)]))
    first = store.snapshot({str(root)!r})
    print("FIRST " + first.uri, flush=True)
    slow = {{"runtime_env": {{"env_vars": {{"ROLLOUT_RECOVERY_FAULT_SNAPSHOT_SLEEP_S": "30"}}}}}}
    store2 = StagingStore.create(num_shards=1, actor_options=slow)  # slow snapshot writes
    store2.put("rollout_staging", chunk_table([f"b/{{i}}" for i in range(80)]))
    print("SECOND", flush=True)
    store2.snapshot({str(root)!r})
    print("UNREACHABLE", flush=True)
"""
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        first_uri = proc.stdout.readline().strip().removeprefix("FIRST ")
        assert proc.stdout.readline().strip() == "SECOND"
        deadline = time.monotonic() + 60
        partial = None
        while time.monotonic() < deadline and partial is None:
            dirs = [d for d in root.glob("snapshot-*") if d.name != Path(first_uri).name]
            if dirs and any(p.suffix == ".arrow" for p in dirs[0].rglob("*")):
                partial = dirs[0]
            time.sleep(0.05)
        assert partial is not None, "the second snapshot started writing"
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert not (partial / MANIFEST_NAME).exists()
    assert StagingStore.latest(str(root)) == first_uri
    with pytest.raises(SnapshotCorruptError, match="never published"):
        make_store(1).restore(str(partial))
    store = make_store(1)
    store.restore(first_uri)
    assert len(store.list("rollout_staging")) == 50
    # A later published snapshot lets gc remove the abandoned partial one.
    newer = store.snapshot(str(root))
    removed = StagingStore.gc(str(root), keep_latest_k=2)
    assert str(partial) in removed
    assert StagingStore.latest(str(root)) == newer.uri
    assert sorted(p.name for p in root.glob("snapshot-*")) == sorted(
        [Path(first_uri).name, Path(newer.uri).name]
    )


def test_two_shards_behave_like_one(make_store, tmp_path):
    one, two = make_store(1), make_store(2)
    keys = _keys("x", 40)
    for s in (one, two):
        s.put("rollout_staging", chunk_table(keys[:30]))
        s.put("rollout_staging", chunk_table(keys[20:], tokens=9))
        s.delete("rollout_staging", keys[::7])
    assert one.list("rollout_staging") == two.list("rollout_staging")
    live = one.list("rollout_staging")
    a, _ = one.get("rollout_staging", live[::-1])
    b, _ = two.get("rollout_staging", live[::-1])
    assert a.equals(b)  # same rows, same (caller's) order
    # Snapshots move between shard counts.
    s2 = two.snapshot(str(tmp_path / "from2"))
    s1 = one.snapshot(str(tmp_path / "from1"))
    back_one, back_two = make_store(1), make_store(2)
    back_one.restore(s2.uri)
    back_two.restore(s1.uri)
    for s in (back_one, back_two):
        got, _ = s.get("rollout_staging", live)
        assert by_key(got).equals(by_key(a))
    lease_one = one.lease("rollout_staging", "t", 100).rows
    lease_two = two.lease("rollout_staging", "t", 100).rows
    assert by_key(lease_one).equals(by_key(lease_two))


def test_gc_keeps_the_newest_k_and_latest_ignores_unpublished(make_store, tmp_path):
    store = make_store(1)
    root = tmp_path / "snaps"
    uris = []
    for i in range(4):
        store.put("replay", replay_table([f"r/{i}"]))
        uris.append(store.snapshot(str(root)).uri)
    (root / "snapshot-0000000099-deadbeef").mkdir()  # an unpublished (in-progress) one
    assert StagingStore.latest(str(root)) == uris[-1]
    removed = StagingStore.gc(str(root), keep_latest_k=2)
    assert sorted(removed) == sorted(uris[:2])
    assert (root / "snapshot-0000000099-deadbeef").exists()  # newer: may still be written
    assert StagingStore.latest(str(tmp_path / "empty")) is None


def test_a_snapshot_past_its_deadline_is_not_published(make_store, tmp_path):
    store = make_store(1)
    root = str(tmp_path / "snaps")
    store.put("replay", replay_table(["r/late"]))
    with pytest.raises(SnapshotError, match="missed its deadline; it was not published"):
        store.snapshot(root, deadline=time.monotonic())
    assert StagingStore.latest(root) is None
    assert store.snapshot(root, deadline=time.monotonic() + 60).uri == StagingStore.latest(root)


async def test_async_api(make_store, tmp_path):
    store = make_store(2)
    keys = _keys("as", 6)
    assert await store.aput("replay", replay_table(keys)) == 6
    got, missing = await store.aget("replay", keys[:2])
    assert got.num_rows == 2 and not missing
    assert await store.alist("replay", "as/") == keys
    lease = await store.alease("replay", "t", 3, ttl_s=30)
    consumed = lease.rows.column("key").to_pylist()
    assert len(consumed) == 3 and await store.aack(lease.lease_id) == 3
    victim = next(k for k in keys if k not in consumed)
    assert await store.adelete("replay", [victim]) == 1
    snap = await store.asnapshot(str(tmp_path))
    fresh = make_store(1)
    await fresh.arestore(snap.uri)
    assert await fresh.alist("replay") == sorted(set(keys) - set(consumed) - {victim})


@pytest.fixture(scope="module")
def s3_root():
    with local_s3("rr-test", "snaps") as uri:
        yield uri


def test_s3_snapshot_latest_and_restore(make_store, s3_root):
    from rollout_recovery.data_plane.filesystem import resolve

    fs, _ = resolve(s3_root)
    fs.create_dir("rr-test")
    store = make_store(2)
    store.put("rollout_staging", chunk_table(_keys("s3", 25)))
    first = store.snapshot(s3_root)
    store.put("replay", replay_table(_keys("r", 3)))
    second = store.snapshot(s3_root)
    assert first.uri.startswith("s3://") and "endpoint_override" in second.uri
    assert StagingStore.latest(s3_root) == second.uri
    fresh = make_store(1)
    fresh.restore(StagingStore.latest(s3_root))
    assert fresh.list("rollout_staging") == store.list("rollout_staging")
    assert fresh.list("replay") == _keys("r", 3)
    rows, _ = fresh.get("rollout_staging", _keys("s3", 25))
    assert_rows_intact(rows)
    assert StagingStore.gc(s3_root, keep_latest_k=1)
    assert StagingStore.latest(s3_root) == second.uri
    manifest_json = json.dumps(second.manifest.model_dump())
    assert "testing:testing" not in manifest_json


def test_a_lease_takes_what_it_asks_for_however_the_keys_hash(make_store):
    """Rows go to shards by key hash, so a trainer step's few keys may all sit on one shard;
    a lease of 4 must still return 4 (an even share per shard returned 2)."""
    from rollout_recovery.data_plane.shard import shard_of

    store = make_store(2)
    keys = [k for k in (f"s0001-p000/{i:03d}" for i in range(64)) if shard_of(k, 2) == 0][:4]
    store.put("replay", replay_table(keys))
    for _ in range(2):  # whichever shard is asked first
        lease = store.lease("replay", "trainer", 4, ttl_s=30)
        assert sorted(lease.rows.column("key").to_pylist()) == keys
        store.put("replay", replay_table(keys))  # again, to lease again
        assert store.ack(lease.lease_id) == 0  # the put took them out of the lease
    store.put("rollout_staging", chunk_table(_keys("x", 3)))
    half = store.lease("replay", "trainer", 2, ttl_s=30)
    rest = store.lease("replay", "trainer", 5, ttl_s=30)
    assert half.rows.num_rows == 2 and rest.rows.num_rows == 2
    assert store.ack(half.lease_id) + store.ack(rest.lease_id) == 4
