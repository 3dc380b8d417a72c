"""RunStorage (trainer checkpoints, logs, batches) is durable once a call returns: checked by
losing power in the fault-injecting filesystem the run is put behind, as the crash campaign
does. A break-it test shows the check notices a missing directory sync."""

from __future__ import annotations

import errno

import pyarrow.fs as pafs
import pytest

from rollout_recovery import storage
from rollout_recovery.storage import RunStorage, StorageError
from rollout_recovery.testing.faultfs import armed_env, fault_filesystem


@pytest.fixture
def faulty(tmp_path, monkeypatch):
    """A run directory behind the fault filesystem (as ROLLOUT_RECOVERY_FAULTFS arms it)."""
    for name, value in armed_env(tmp_path / "state").items():
        monkeypatch.setenv(name, value)
    run = RunStorage(str(tmp_path / "run"))
    handler = fault_filesystem(pafs.LocalFileSystem(), tmp_path / "state").handler
    assert run.fs.handler.get_type_name() == "faultfs" and run.local and not run.object_store
    return run, handler, tmp_path / "run"


def test_what_returned_survives_a_power_loss(faulty):
    run, handler, root = faulty
    run.write_bytes("trainer/step-000001/meta.json", b'{"step": 1}')
    run.append_line("steps.jsonl", "one")
    run.append_line("steps.jsonl", "two")
    run.write_bytes("trainer/step-000001/meta.json", b'{"step": 1, "again": true}')
    handler.power_loss()
    assert (root / "trainer/step-000001/meta.json").read_bytes() == b'{"step": 1, "again": true}'
    assert run.read_lines("steps.jsonl") == ["one", "two"]


def test_a_delete_that_returned_stays_deleted(faulty):
    run, handler, root = faulty
    run.write_bytes("trainer/step-000001/meta.json", b"{}")
    run.delete_file("trainer/step-000001/meta.json")
    run.write_bytes("trainer/step-000002/meta.json", b"{}")
    run.delete_dir("trainer/step-000002")
    handler.power_loss()
    assert not (root / "trainer/step-000001/meta.json").exists()
    assert not (root / "trainer/step-000002").exists()


def test_the_check_catches_a_write_whose_directory_was_not_synced(faulty, monkeypatch):
    """Break it on purpose: without the directory syncs the new checkpoint is lost."""
    run, handler, root = faulty
    monkeypatch.setattr(storage, "sync_dir", lambda fs, path: None)
    monkeypatch.setattr(storage, "make_dirs", lambda fs, path: fs.create_dir(path))
    run.write_bytes("trainer/step-000001/meta.json", b"{}")
    handler.power_loss()
    assert not (root / "trainer/step-000001/meta.json").exists()


def test_a_failed_move_keeps_the_old_file_and_leaves_no_temporary(faulty):
    run, handler, _ = faulty
    run.write_bytes("batches/step-000001.arrow", b"old")
    handler.fail("move", "*step-000001.arrow*", error=errno.EACCES)  # not tried again
    with pytest.raises(StorageError, match="cannot write"):
        run.write_bytes("batches/step-000001.arrow", b"new")
    assert run.leftover_temporaries() == []  # removed by the write, not by the power loss
    handler.power_loss()
    assert run.read_bytes("batches/step-000001.arrow") == b"old"
    assert run.leftover_temporaries() == []


def test_temporaries_a_crash_left_are_found(tmp_path):
    run = RunStorage(str(tmp_path / "run"))
    run.write_bytes("trainer/step-000001/state.safetensors", b"x")
    (tmp_path / "run/trainer/step-000001/state.safetensors.tmp-0a1b2c3d").write_bytes(b"half")
    assert run.leftover_temporaries() == ["trainer/step-000001/state.safetensors.tmp-0a1b2c3d"]
    run.delete_file(run.leftover_temporaries()[0])
    assert run.leftover_temporaries() == []


def test_a_new_run_directory_made_by_the_writability_check_survives_a_power_loss(faulty):
    """The check creates the run's root; its name must be durable before anything under it
    counts (the campaign found a whole run lost to a power loss when it was not)."""
    run, handler, root = faulty
    run.check_writable()
    run.write_bytes("trainer/step-000001/meta.json", b"{}")
    handler.power_loss()
    assert (root / "trainer/step-000001/meta.json").read_bytes() == b"{}"


def test_a_write_that_fails_like_an_outage_is_tried_again(faulty):
    """EIO on the first try of the move: the file lands on the next try, durably, and no
    temporary file is left (tests/unit/test_outage.py: a log line across an outage)."""
    run, handler, _ = faulty
    handler.fail("move", "*step-000001.arrow*", error=errno.EIO)
    run.write_bytes("batches/step-000001.arrow", b"new")
    handler.power_loss()
    assert run.read_bytes("batches/step-000001.arrow") == b"new"
    assert run.leftover_temporaries() == []


def test_an_outage_that_lasts_fails_in_one_line_saying_what_to_run(faulty, monkeypatch):
    run, handler, _ = faulty
    monkeypatch.setattr(storage, "TRANSIENT_RETRY_S", 0.3)
    for _ in range(30):  # each armed fault fires on the first move it has not yet seen
        handler.fail("move", "*step-000002.arrow*", error=errno.EIO)
    with pytest.raises(StorageError) as err:
        run.write_bytes("batches/step-000002.arrow", b"x")
    assert "(tried for 0.3 s)" in str(err.value) and "continue the run with `--restore`" in str(
        err.value
    )


def test_a_log_line_that_may_be_partly_written_is_not_tried_again(faulty):
    """A failed fsync after the append: trying again could write the line twice."""
    run, handler, _ = faulty
    run.append_line("steps.jsonl", "one")
    handler.fail("fsync", "*steps.jsonl", error=errno.EIO)
    with pytest.raises(StorageError, match="cannot append"):
        run.append_line("steps.jsonl", "two")
    assert run.read_lines("steps.jsonl") == ["one", "two"]
