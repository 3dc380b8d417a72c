"""Snapshots of a real store written through the fault-injecting filesystem (shard actors
included): the stated durability order, power loss, bit flips, and injected I/O errors."""

from __future__ import annotations

import errno
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from rollout_recovery.data_plane import SnapshotCorruptError, StagingStore
from rollout_recovery.data_plane.snapshot_io import MANIFEST_NAME, published_uris
from rollout_recovery.testing.faultfs import FaultFs, Op, fault_filesystem
from tests.cluster.store_helpers import chunk_table, replay_table

pytestmark = pytest.mark.cluster
PARTITIONS = ("rollout_staging", "replay")


@pytest.fixture
def ffs(tmp_path: Path) -> pafs.PyFileSystem:
    return fault_filesystem(pafs.LocalFileSystem(), tmp_path / "faultfs")


def _h(fs: pafs.PyFileSystem) -> FaultFs:
    return fs.handler


def _contents(store: StagingStore) -> dict[str, pa.Table]:
    return {p: store.get(p, store.list(p))[0] for p in PARTITIONS}


def _snapshot(store: StagingStore, root: str, fs: pafs.FileSystem, gen: int) -> str:
    store.put("replay", replay_table([f"gen{gen}/{j:03d}" for j in range(4)]))
    ledger = b'{"gen": %d}' % gen
    return store.snapshot(root, sidecars={"ledger.json": ledger}, filesystem=fs).uri


def _first(make_store, tmp_path: Path, fs: pafs.FileSystem):
    """A store, its root, its first published snapshot and the contents that snapshot holds."""
    store = make_store(2)
    store.put("rollout_staging", chunk_table([f"a/{i:03d}" for i in range(12)]))
    root = str(tmp_path / "snaps")
    first = _snapshot(store, root, fs, 1)
    return store, root, first, _contents(store)


def _assert_restores_exactly(make_store, uri: str, fs: pafs.FileSystem, expected) -> None:
    fresh = make_store(1)
    fresh.restore(uri, filesystem=fs)
    got = _contents(fresh)
    for p in PARTITIONS:
        assert got[p].equals(expected[p]), p


def _newest_restorable(root: str, fs: pafs.FileSystem) -> str | None:
    """What a restart restores: the newest published snapshot that verifies."""
    for uri in reversed(published_uris(root, fs)):
        try:
            StagingStore.verify(uri, use_cache=False, filesystem=fs)
        except SnapshotCorruptError:
            continue
        return uri
    return None


def _errno(err: BaseException) -> int | None:
    """The errno of an OSError, raised here or in a shard actor (Ray wraps it)."""
    return getattr(getattr(err, "cause", None) or err, "errno", None)


def _index(ops: list[Op], op: str, pred) -> list[int]:
    return [i for i, o in enumerate(ops) if o.op == op and not o.error and pred(o)]


def test_the_durability_order(make_store, tmp_path, ffs):
    """Data files and their directories, then sidecars, are durable before the manifest is
    written; the manifest is synced before the move; the move is synced after it."""
    _, root, uri, _ = _first(make_store, tmp_path, ffs)
    snap = uri.rstrip("/")
    j = _h(ffs).ops()

    def under(sub: str):
        return lambda o: o.path.startswith(f"{snap}/{sub}")

    data_fsyncs = _index(j, "fsync", lambda o: o.path.endswith(".arrow"))
    side_writes = _index(j, "write", under("sidecars/"))
    side_file_syncs = _index(j, "fsync", under("sidecars/"))
    side_syncs = side_file_syncs + _index(j, "fsync_dir", lambda o: o.path == f"{snap}/sidecars")
    tmp_write = _index(j, "write", under(f".{MANIFEST_NAME}.tmp-"))
    tmp_sync = _index(j, "fsync", under(f".{MANIFEST_NAME}.tmp-"))
    [move] = _index(j, "move", lambda o: o.dest == f"{snap}/{MANIFEST_NAME}")
    snap_syncs = _index(j, "fsync_dir", lambda o: o.path == snap)
    root_syncs = _index(j, "fsync_dir", lambda o: o.path == root)
    new_root_syncs = _index(j, "fsync_dir", lambda o: o.path == str(tmp_path))

    assert len(data_fsyncs) >= 2 and len(side_writes) == len(side_file_syncs) == 1
    for i in data_fsyncs:  # each data file's bytes, then its name, before any sidecar
        parent = j[i].path.rsplit("/", 1)[0]
        assert [k for k in _index(j, "fsync_dir", lambda o, p=parent: o.path == p) if k > i]
        assert i < min(side_writes)
    last_data_dir_sync = max(_index(j, "fsync_dir", lambda o: "/shard-" in o.path))
    assert last_data_dir_sync < min(side_writes)
    assert max(side_writes) < min(side_syncs) and max(side_syncs) < min(tmp_write)
    assert max(tmp_write) < min(tmp_sync) < min(snap_syncs) < move
    assert max(snap_syncs) > move and max(root_syncs) > move
    assert new_root_syncs and max(new_root_syncs) < min(data_fsyncs), "a new root is durable"


def test_power_loss_after_publication_keeps_the_snapshot(make_store, tmp_path, ffs):
    store, root, _, _ = _first(make_store, tmp_path, ffs)
    second = _snapshot(store, root, ffs, 2)
    expected = _contents(store)
    store.put("replay", replay_table(["after/000"]))  # in memory only
    _h(ffs).power_loss()
    assert StagingStore.latest(root, filesystem=ffs) == second
    StagingStore.verify(second, use_cache=False, filesystem=ffs)
    _assert_restores_exactly(make_store, second, ffs, expected)


CRASH_POINTS = {
    "data file fsync": ("fsync", "*.arrow"),
    "data dir fsync": ("fsync", "*/shard-001"),
    "sidecar fsync": ("fsync", "*/sidecars/ledger.json"),
    "sidecars dir fsync": ("fsync", "*/sidecars"),
    "sidecar write": ("write", "*/sidecars/ledger.json"),
    "manifest fsync": ("fsync", f"*/.{MANIFEST_NAME}.tmp-*"),
    "manifest move": ("move", f"*/{MANIFEST_NAME}"),
}


@pytest.mark.parametrize("lose_power", [False, True], ids=["error", "error+power_loss"])
@pytest.mark.parametrize("point", list(CRASH_POINTS))
def test_a_failed_attempt_publishes_nothing(make_store, tmp_path, ffs, point, lose_power):
    """An I/O error (EIO) at any step before publication ends the attempt there: it raises,
    nothing is retried, nothing is published; with a power loss on top, the previous snapshot
    is still the latest and restores exactly."""
    store, root, first, expected = _first(make_store, tmp_path, ffs)
    kind, pattern = CRASH_POINTS[point]
    _h(ffs).fail(kind, pattern, error=errno.EIO)
    before = len(_h(ffs).ops())
    with pytest.raises(OSError) as err:
        _snapshot(store, root, ffs, 2)
    assert _errno(err.value) == errno.EIO
    after = _h(ffs).ops()[before:]
    [failed] = [o for o in after if o.error]
    assert failed.error == errno.EIO
    assert not [o for o in after if o.op == "move" and not o.error], "nothing was published"
    assert not [o for o in after if o.op == failed.op and o.path == failed.path and not o.error]
    if lose_power:
        _h(ffs).power_loss()
    assert StagingStore.latest(root, filesystem=ffs) == first
    assert len(list(Path(root).rglob(MANIFEST_NAME))) == 1
    _assert_restores_exactly(make_store, first, ffs, expected)


def _manifest(snap: Path) -> Path:
    return snap / MANIFEST_NAME


def _sidecar(snap: Path) -> Path:
    return snap / "sidecars" / "ledger.json"


def _data_file(snap: Path) -> Path:
    return sorted(snap.rglob("replay.*.arrow"))[0]


@pytest.mark.parametrize("target", [_manifest, _sidecar, _data_file])
def test_a_flipped_bit_is_refused_and_restore_falls_back(make_store, tmp_path, ffs, target):
    store, root, first, expected = _first(make_store, tmp_path, ffs)
    second = _snapshot(store, root, ffs, 2)
    StagingStore.verify(second, filesystem=ffs)
    victim = target(Path(second))
    _h(ffs).flip_bit(str(victim), offset=victim.stat().st_size // 2)
    with pytest.raises(SnapshotCorruptError, match=victim.name.replace(".", r"\.")):
        StagingStore.verify(second, use_cache=False, filesystem=ffs)
    assert StagingStore.latest(root, filesystem=ffs) == second  # published, but not restorable
    if target is not _sidecar:  # a restore reads the manifest and the data, never the sidecars
        with pytest.raises(SnapshotCorruptError):
            make_store(1).restore(second, filesystem=ffs)
    assert _newest_restorable(root, ffs) == first
    _assert_restores_exactly(make_store, first, ffs, expected)


def test_enospc_on_a_data_file_fails_the_attempt_cleanly(make_store, tmp_path, ffs):
    store, root, first, expected = _first(make_store, tmp_path, ffs)
    _h(ffs).fail("write", "*/replay.*.arrow", error=errno.ENOSPC)
    with pytest.raises(OSError) as err:
        _snapshot(store, root, ffs, 2)
    assert _errno(err.value) == errno.ENOSPC
    assert StagingStore.latest(root, filesystem=ffs) == first
    _assert_restores_exactly(make_store, first, ffs, expected)
    third = _snapshot(store, root, ffs, 3)  # the store is unharmed; the next attempt works
    failed = [p for p in Path(root).glob("snapshot-*") if not (p / MANIFEST_NAME).exists()]
    assert len(failed) == 1
    assert StagingStore.gc(root, keep_latest_k=1, filesystem=ffs) == [first, str(failed[0])]
    assert StagingStore.latest(root, filesystem=ffs) == third


def test_a_torn_data_file_is_refused_by_verify(make_store, tmp_path, ffs):
    store, root, first, _ = _first(make_store, tmp_path, ffs)
    _h(ffs).tear("*/replay.*.arrow", at_byte=100)
    second = _snapshot(store, root, ffs, 2)  # the writer never learns
    with pytest.raises(SnapshotCorruptError, match=r"replay\.0000\.arrow has 100 bytes"):
        StagingStore.verify(second, use_cache=False, filesystem=ffs)
    assert _newest_restorable(root, ffs) == first
