"""Snapshot integrity on a real store and real files: an aborted attempt is never published,
and retention never deletes the newest snapshot that verifies."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from rollout_recovery.data_plane import (
    PublishGate,
    SnapshotAborted,
    SnapshotCorruptError,
    StagingStore,
    filesystem,
    snapshot_io,
)
from rollout_recovery.data_plane import store as store_module
from rollout_recovery.data_plane.snapshot_io import MANIFEST_NAME
from tests.cluster.store_helpers import chunk_table, replay_table

pytestmark = pytest.mark.cluster
ATTEMPT_S = 2.0  # the checkpoint attempt's timeout; the writer reaches the publish step well before


class _StallingFs(pafs.FileSystemHandler):
    """The local filesystem, except that one publish operation stalls until `release_at`
    (time.monotonic()), as a slow disk or object store would."""

    def __init__(self, stall: Callable[[str, str], bool]) -> None:
        self.local = pafs.LocalFileSystem()
        self.stall = stall
        self.release_at = 0.0
        self.entered = threading.Event()

    def _maybe_stall(self, op: str, path: str) -> None:
        if self.stall(op, path):
            self.entered.set()
            while time.monotonic() < self.release_at:
                time.sleep(0.01)

    def get_type_name(self) -> str:
        return "stalling-local"

    def normalize_path(self, path):
        return self.local.normalize_path(path)

    def get_file_info(self, paths):
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.local.get_file_info(selector)

    def create_dir(self, path, recursive):
        self.local.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.local.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.local.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise NotImplementedError

    def delete_file(self, path):
        self.local.delete_file(path)

    def move(self, src, dest):
        self._maybe_stall("move", dest)
        self.local.move(src, dest)

    def copy_file(self, src, dest):
        self.local.copy_file(src, dest)

    def create_only(self, path, data):  # the ownership log's create-only write
        return filesystem.create_only(self.local, path, data)

    def open_input_stream(self, path):
        return self.local.open_input_stream(path)

    def open_input_file(self, path):
        return self.local.open_input_file(path)

    def open_output_stream(self, path, metadata):
        self._maybe_stall("write", path)
        return self.local.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path, metadata):
        return self.local.open_append_stream(path, metadata=metadata)


@pytest.fixture
def stall_publish(monkeypatch):
    """Route the driver's snapshot writes (sidecars, manifest) through a stalling filesystem;
    the shard actors write their data files to the local disk as usual. Teardown releases
    the stall so a failed test leaves no writer thread behind."""
    handlers: list[_StallingFs] = []

    def install(stall: Callable[[str, str], bool]) -> _StallingFs:
        handler = _StallingFs(stall)
        handlers.append(handler)

        def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
            _, path = filesystem.resolve(uri)
            return pafs.PyFileSystem(handler), path

        monkeypatch.setattr(store_module, "resolve", resolve)
        return handler

    yield install
    for handler in handlers:
        handler.release_at = 0.0


def _manifest_tmp_write(op: str, path: str) -> bool:
    return op == "write" and f".{MANIFEST_NAME}.tmp-" in path


def _manifest_rename(op: str, path: str) -> bool:
    return op == "move" and path.endswith(MANIFEST_NAME)


async def _until(event: threading.Event, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not event.is_set():
        assert time.monotonic() < deadline, "the snapshot writer never reached the publish step"
        await asyncio.sleep(0.01)


def _filled_store(make_store) -> StagingStore:
    store = make_store(1)
    store.put("rollout_staging", chunk_table([f"a/{i:03d}" for i in range(20)]))
    store.put("replay", replay_table([f"r/{i:03d}" for i in range(6)]))
    return store


def _assert_nothing_published(root: Path) -> None:
    assert StagingStore.latest(str(root)) is None
    assert not list(root.rglob(MANIFEST_NAME))
    assert list(root.rglob("*.arrow")), "the attempt wrote its data files before it was aborted"


# ---------------------------------------------------------------- A: publication gate


@pytest.mark.parametrize("guard", ["gate", "deadline"])
async def test_a_timed_out_attempt_is_never_published(make_store, tmp_path, stall_publish, guard):
    """The controller times out while the manifest is still being written: nothing may appear,
    neither after gate.abort() nor when only the attempt's deadline has passed."""
    store = _filled_store(make_store)
    root = tmp_path / "snaps"
    slow = stall_publish(_manifest_tmp_write)
    t0 = time.monotonic()
    slow.release_at = t0 + ATTEMPT_S + 1.0
    gate = PublishGate() if guard == "gate" else None
    deadline = t0 + ATTEMPT_S if guard == "deadline" else None
    task = asyncio.ensure_future(
        store.asnapshot(str(root), sidecars={"ledger.json": b"{}"}, deadline=deadline, gate=gate)
    )
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(ATTEMPT_S):
            await asyncio.shield(task)
    assert slow.entered.is_set(), "the writer was inside the publish step at the timeout"
    if gate is not None:
        assert gate.abort()
    with pytest.raises(SnapshotAborted, match="it was not published"):
        await task
    _assert_nothing_published(root)


async def test_cancelling_asnapshot_aborts_its_publication(
    make_store, tmp_path, monkeypatch, stall_publish
):
    """The controller's plain timeout around `store.asnapshot(...)`: the cancellation itself
    aborts."""
    store = _filled_store(make_store)
    root = tmp_path / "snaps"
    slow = stall_publish(_manifest_tmp_write)
    slow.release_at = time.monotonic() + ATTEMPT_S + 1.0
    finished = threading.Event()
    errors: list[BaseException] = []
    original = StagingStore.snapshot

    def snapshot(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except BaseException as err:
            errors.append(err)
            raise
        finally:
            finished.set()

    monkeypatch.setattr(StagingStore, "snapshot", snapshot)
    gate = PublishGate()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(ATTEMPT_S):
            await store.asnapshot(str(root), gate=gate)
    assert gate.abort()  # already aborted by the cancellation; still not published
    await _until(finished)
    assert [type(e) for e in errors] == [SnapshotAborted]
    _assert_nothing_published(root)


async def test_abort_during_the_rename_waits_and_reports_published(
    make_store, tmp_path, stall_publish
):
    """An abort that races the rename waits for it and says the snapshot is published."""
    store = _filled_store(make_store)
    root = tmp_path / "snaps"
    slow = stall_publish(_manifest_rename)
    slow.release_at = time.monotonic() + 60
    gate = PublishGate()
    task = asyncio.ensure_future(store.asnapshot(str(root), gate=gate))
    await _until(slow.entered)
    aborting = asyncio.ensure_future(asyncio.to_thread(gate.abort))
    await asyncio.sleep(0.3)
    assert not aborting.done(), "abort waits for the rename in progress"
    slow.release_at = time.monotonic()
    assert await aborting is False
    snap = await task
    assert StagingStore.latest(str(root)) == snap.uri
    assert StagingStore.verify(snap.uri).sha256 == snap.manifest.sha256


async def test_abort_after_publication_returns_false(make_store, tmp_path):
    store = _filled_store(make_store)
    root = str(tmp_path / "snaps")
    gate = PublishGate()
    snap = await store.asnapshot(root, gate=gate)
    assert gate.abort() is False
    assert gate.abort() is False
    assert StagingStore.latest(root) == snap.uri
    restored = make_store(1)
    restored.restore(snap.uri)
    assert len(restored.list("rollout_staging")) == 20


def test_an_aborted_gate_publishes_nothing_and_writes_nothing(make_store, tmp_path):
    store = _filled_store(make_store)
    root = tmp_path / "snaps"
    gate = PublishGate()
    assert gate.abort()
    with pytest.raises(SnapshotAborted, match="aborted; it was not published"):
        store.snapshot(str(root), gate=gate)
    assert StagingStore.latest(str(root)) is None
    assert not root.exists() or not list(root.rglob("*"))


# ---------------------------------------------------------------- B: verified retention


def _snapshots(store: StagingStore, root: Path, n: int) -> list[str]:
    uris = []
    for i in range(n):
        store.put("replay", replay_table([f"gen{i}/{j:03d}" for j in range(4)]))
        uris.append(store.snapshot(str(root), sidecars={"ledger.json": b'{"n": %d}' % i}).uri)
    return uris


def _tear_manifest(snap: Path) -> str:
    manifest = snap / MANIFEST_NAME
    manifest.write_bytes(manifest.read_bytes()[: manifest.stat().st_size // 2])
    return MANIFEST_NAME


def _flip_data_byte(snap: Path) -> str:
    victim = sorted(snap.rglob("replay.*.arrow"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    return victim.name


def _drop_sidecar(snap: Path) -> str:
    (snap / "sidecars" / "ledger.json").unlink()
    return "ledger.json"


@pytest.mark.parametrize("corrupt", [_tear_manifest, _flip_data_byte, _drop_sidecar])
def test_gc_keeps_the_newest_snapshot_that_verifies(make_store, tmp_path, corrupt):
    store = _filled_store(make_store)
    root = tmp_path / "snaps"
    oldest, good, newest = _snapshots(store, root, 3)
    bad_file = corrupt(Path(newest))
    with pytest.raises(SnapshotCorruptError, match=bad_file.replace(".", r"\.")):
        StagingStore.verify(newest)
    assert StagingStore.gc(str(root), keep_latest_k=1) == [oldest]
    assert StagingStore.verify(good).body.seq == 2
    assert Path(newest).exists(), "a corrupt snapshot newer than the kept one is left alone"
    restored = make_store(1)
    restored.restore(good)
    replay = restored.list("replay")
    assert "gen1/003" in replay and "gen2/000" not in replay


def test_gc_deletes_nothing_when_no_snapshot_verifies(make_store, tmp_path):
    store = _filled_store(make_store)
    root = tmp_path / "snaps"
    uris = _snapshots(store, root, 3)
    for uri, corrupt in zip(uris, [_flip_data_byte, _tear_manifest, _drop_sidecar], strict=True):
        corrupt(Path(uri))
    (root / "snapshot-0000000000-0badf00d").mkdir()  # an abandoned unpublished attempt
    before = sorted(p.name for p in root.glob("snapshot-*"))
    assert StagingStore.gc(str(root), keep_latest_k=1) == []
    assert sorted(p.name for p in root.glob("snapshot-*")) == before


def test_gc_deletes_old_verified_and_abandoned_snapshots(make_store, tmp_path):
    store = _filled_store(make_store)
    root = tmp_path / "snaps"
    s1, s2, abandoned, torn, s5, s6 = _snapshots(store, root, 6)
    (Path(abandoned) / MANIFEST_NAME).unlink()  # what a crash before publication leaves
    _tear_manifest(Path(torn))
    in_progress = root / "snapshot-0000000099-deadbeef"
    (in_progress / "shard-000").mkdir(parents=True)
    # Kept: s2, s5, s6. The abandoned attempt predates a published snapshot: it is over.
    assert sorted(StagingStore.gc(str(root), keep_latest_k=3)) == sorted([s1, abandoned])
    assert Path(torn).exists(), "a corrupt snapshot among the kept ones stays"
    assert sorted(StagingStore.gc(str(root), keep_latest_k=2)) == sorted([s2, torn])
    assert sorted(p.name for p in root.glob("snapshot-*")) == sorted(
        [Path(s5).name, Path(s6).name, in_progress.name]
    )
    assert StagingStore.latest(str(root)) == s6
    assert StagingStore.gc(str(root), keep_latest_k=2) == []


def test_each_snapshot_is_hashed_once_per_process(make_store, tmp_path, monkeypatch):
    store = _filled_store(make_store)
    root = tmp_path / "snaps"
    uris = _snapshots(store, root, 2)
    hashed: list[str] = []
    digest = snapshot_io._file_digest

    def counting(fs: pafs.FileSystem, path: str) -> tuple[str, int]:
        hashed.append(path)
        return digest(fs, path)

    monkeypatch.setattr(snapshot_io, "_file_digest", counting)
    manifest = StagingStore.verify(uris[-1])
    per_snapshot = len(manifest.body.files)
    assert len(hashed) == per_snapshot
    StagingStore.verify(uris[-1])
    StagingStore.gc(str(root), keep_latest_k=2)
    StagingStore.gc(str(root), keep_latest_k=2)
    assert len(hashed) == 2 * per_snapshot
