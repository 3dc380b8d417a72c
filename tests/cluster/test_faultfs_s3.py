"""The fault-injecting filesystem over S3 (a local moto server): a completed upload survives a
power loss, one still open does not, and a snapshot attempt that fails before publication
leaves the previous snapshot the latest."""

from __future__ import annotations

import errno

import pyarrow.fs as pafs
import pytest

from rollout_recovery.data_plane import StagingStore
from rollout_recovery.data_plane.filesystem import resolve, sync_file
from rollout_recovery.testing.faultfs import FaultFs, fault_filesystem
from tests.cluster.store_helpers import chunk_table, local_s3, replay_table

pytestmark = pytest.mark.cluster
BUCKET = "rr-faults"


@pytest.fixture(scope="module")
def s3_root():
    with local_s3("rr-faults", "snaps") as uri:
        resolve(uri)[0].create_dir(BUCKET)
        yield uri


@pytest.fixture
def ffs(s3_root, tmp_path) -> pafs.PyFileSystem:
    return fault_filesystem(resolve(s3_root)[0], tmp_path / "faultfs")


def _h(fs: pafs.PyFileSystem) -> FaultFs:
    return fs.handler


def test_power_loss_on_s3_drops_only_unfinished_uploads(ffs):
    assert _h(ffs).object_store
    with ffs.open_output_stream(f"{BUCKET}/obj/done") as out:
        out.write(b"complete")
    sync_file(ffs, f"{BUCKET}/obj/done")  # recorded; nothing to do on an object store
    pending = ffs.open_output_stream(f"{BUCKET}/obj/pending")
    pending.write(b"never completed")
    _h(ffs).power_loss()
    with pytest.raises(OSError) as err:
        pending.close()
    assert err.value.errno == errno.EIO
    with ffs.open_input_stream(f"{BUCKET}/obj/done") as f:
        assert f.read() == b"complete"
    assert ffs.get_file_info(f"{BUCKET}/obj/pending").type == pafs.FileType.NotFound
    assert [o.op for o in _h(ffs).ops()][:3] == ["write", "close", "fsync"]


def test_a_failed_s3_attempt_leaves_the_previous_snapshot(make_store, s3_root, ffs):
    store = make_store(2)
    store.put("rollout_staging", chunk_table([f"a/{i:03d}" for i in range(10)]))
    first = store.snapshot(s3_root, sidecars={"ledger.json": b"{}"}, filesystem=ffs).uri
    expected = store.list("rollout_staging")
    store.put("replay", replay_table(["r/000"]))
    _h(ffs).fail("move", "*/MANIFEST.json")
    with pytest.raises(OSError):
        store.snapshot(s3_root, sidecars={"ledger.json": b"{}"}, filesystem=ffs)
    _h(ffs).power_loss()
    assert StagingStore.latest(s3_root, filesystem=ffs) == first
    StagingStore.verify(first, use_cache=False, filesystem=ffs)
    fresh = make_store(1)
    fresh.restore(first, filesystem=ffs)
    assert fresh.list("rollout_staging") == expected and fresh.list("replay") == []
