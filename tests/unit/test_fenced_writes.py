"""Every write under a run's location is fenced by its owner's claim (storage.py, run.py,
docs/ownership.md): once a newer owner claimed the run, a stale owner's next write or delete
raises OwnerFenced in one line naming the newer owner, and lands nothing. Checked on real
files here and on the local S3 server in tests/cluster/test_fenced_writes_s3.py."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
import pytest

from rollout_recovery.config import TokenCaptureConfig
from rollout_recovery.controller.selection import DATA_PLANE
from rollout_recovery.data_plane import StagingStore
from rollout_recovery.data_plane.errors import OwnerFenced
from rollout_recovery.data_plane.ownership import Fence
from rollout_recovery.data_plane.token_log_segments import TokenLogSegments
from rollout_recovery.storage import RunStorage
from rollout_recovery.trainer import step_log, trainer_checkpoints


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip


def owners(uri: str) -> tuple[RunStorage, RunStorage]:
    """(A, B): storages of the location fenced by A's claim, then by B's newer one."""
    storage = RunStorage(uri)
    root = storage.child_uri(DATA_PLANE)
    a = storage.fenced(Fence.of(root, StagingStore.claim(root, first=True)))
    a.write_bytes("trainer/step-000002/state.bin", b"A's step 2")
    step_log.append(a, {"step": 2, "by": "A"})
    b = storage.fenced(Fence.of(root, StagingStore.claim(root)))  # B restores the run
    b.write_bytes("trainer/step-000002/state.bin", b"B's step 2")
    step_log.append(b, {"step": 2, "by": "B"})
    return a, b


WRITES = {
    "write_bytes": lambda s: s.write_bytes("trainer/step-000002/state.bin", b"A again"),
    "append_line": lambda s: step_log.append(s, {"step": 3, "by": "A"}),
    "delete_file": lambda s: s.delete_file("trainer/step-000002/state.bin"),
    "delete_dir": lambda s: s.delete_dir("trainer"),
    "trainer_checkpoint": lambda s: trainer_checkpoints.save(s, 2, {"w": b"A"}, {}, None),
}


@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_stale_owner_writes_nothing_and_stops_in_one_line(tmp_path, write):
    a, _ = owners(str(tmp_path / "run"))
    before = tree(tmp_path / "run")
    with pytest.raises(OwnerFenced) as info:
        WRITES[write](a)
    msg = str(info.value)
    assert "\n" not in msg and "a newer controller owns it: epoch 2" in msg, msg
    assert "epoch 1" in msg and "It stops without" in msg
    assert tree(tmp_path / "run") == before


def test_the_current_owner_writes_and_an_unfenced_storage_is_not_checked(tmp_path):
    _, b = owners(str(tmp_path / "run"))
    b.write_bytes("batches/step-000003.arrow", b"B's batch")
    RunStorage(str(tmp_path / "run")).write_bytes("notes.txt", b"a tool's, not the run's")
    assert (tmp_path / "run" / "batches" / "step-000003.arrow").read_bytes() == b"B's batch"


def test_without_the_fence_a_stale_owner_overwrites_the_newer_owners_files(tmp_path, monkeypatch):
    """Broken on purpose (`fencing_disabled`): the stale write lands; the check above fails."""
    a, _ = owners(str(tmp_path / "run"))
    monkeypatch.setenv("ROLLOUT_RECOVERY_FAULTS", "fencing_disabled")
    WRITES["write_bytes"](a)
    state = tmp_path / "run" / "trainer" / "step-000002" / "state.bin"
    assert state.read_bytes() == b"A again"


def test_a_write_paused_before_its_rename_is_told_it_no_longer_owns_the_run(tmp_path, monkeypatch):
    """A owns the run and writes; between its temporary file and the rename that makes it
    visible, B claims the run and its restore removes A's temporary file (seen in the two-owner
    check). A is told it no longer owns the run, not that its rename failed, and the target
    stays B's."""
    import rollout_recovery.storage as storage_mod

    storage = RunStorage(str(tmp_path / "run"))
    root = storage.child_uri(DATA_PLANE)
    a = storage.fenced(Fence.of(root, StagingStore.claim(root, first=True)))
    a.write_bytes("batches/step-000003.arrow", b"A's first")
    sync = storage_mod.sync_file

    def paused(fs, path):  # A stops here; B takes the run over meanwhile
        sync(fs, path)
        monkeypatch.setattr(storage_mod, "sync_file", sync)
        b = storage.fenced(Fence.of(root, StagingStore.claim(root)))
        for rel in b.leftover_temporaries():
            b.delete_file(rel)
        b.write_bytes("batches/step-000003.arrow", b"B's")

    monkeypatch.setattr(storage_mod, "sync_file", paused)
    with pytest.raises(OwnerFenced, match="no longer owns"):
        a.write_bytes("batches/step-000003.arrow", b"A's second")
    assert (tmp_path / "run" / "batches" / "step-000003.arrow").read_bytes() == b"B's"
    assert not list((tmp_path / "run" / "batches").glob("*.tmp-*"))


def test_a_stale_owners_workers_write_no_token_log_segment(tmp_path):
    """The fence crosses into the workers inside their config, and their segment writer
    checks it before each segment."""
    a, _ = owners(str(tmp_path / "run"))
    tc = TokenCaptureConfig.model_validate(
        TokenCaptureConfig(log_uri=a.child_uri("token_log"), log_fence=a.fence).model_dump(
            mode="json"
        )
    )
    assert tc.log_fence == a.fence
    segments = TokenLogSegments(tc.log_uri, "worker-0", tc.log_fence)
    with pytest.raises(OwnerFenced):
        segments.append(pa.table({"x": [1]}))
    assert not (tmp_path / "run" / "token_log").exists()


def test_each_check_reads_only_entries_it_has_not_seen(tmp_path):
    """Entries are created once: the watch keeps those it read, so a check per write costs a
    listing, not a read of the whole log."""
    from rollout_recovery.data_plane import ownership

    _, b = owners(str(tmp_path / "run"))
    reads: list[str] = []
    fs = b._watch.fs
    real = fs.open_input_stream

    class Counting:
        def __getattr__(self, name):
            return getattr(fs, name)

        def open_input_stream(self, path):
            reads.append(path)
            return real(path)

    b._watch.fs = Counting()
    b._watch._seen.clear()
    b.check_owner("writing")
    first = len(reads)
    b.check_owner("writing")
    assert first == 2 and len(reads) == first  # A's and B's claims, read once
    root = b.child_uri(DATA_PLANE)
    ownership.claim(*ownership.filesystem.resolve(root))  # C takes over
    with pytest.raises(OwnerFenced):
        b.check_owner("writing")
    assert len(reads) == first + 1
