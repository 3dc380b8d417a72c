"""The fault-injecting filesystem on a tmp dir through the LocalFileSystem: the operation log, torn
writes, power loss against the durable state, bit flips, injected errors, the snapshot
layer's one fsync seam, and the seam that puts a whole run behind it."""

from __future__ import annotations

import errno
import pickle
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from rollout_recovery import faults
from rollout_recovery.data_plane import filesystem
from rollout_recovery.testing.faultfs import HOOK, FaultFs, Op, armed_env, fault_filesystem


@pytest.fixture
def ffs(tmp_path: Path) -> pafs.PyFileSystem:
    (tmp_path / "d").mkdir()
    return fault_filesystem(pafs.LocalFileSystem(), tmp_path / "state")


@pytest.fixture
def d(tmp_path: Path) -> Path:
    return tmp_path / "d"


def _h(fs: pafs.PyFileSystem) -> FaultFs:
    return fs.handler


def _write(fs: pafs.FileSystem, path: Path, data: bytes) -> None:
    with fs.open_output_stream(str(path)) as out:
        out.write(data)


def _durable_write(fs: pafs.PyFileSystem, path: Path, data: bytes) -> None:
    _write(fs, path, data)
    _h(fs).fsync(str(path))
    _h(fs).fsync(str(path.parent), directory=True)


def test_the_operation_log_records_every_operation(ffs, d):
    _write(ffs, d / "a", b"x")
    filesystem.sync_file(ffs, str(d / "a"))
    ffs.create_dir(str(d / "sub"))
    filesystem.sync_dir(ffs, str(d))
    ffs.move(str(d / "a"), str(d / "sub" / "b"))
    ffs.delete_file(str(d / "sub" / "b"))
    ffs.delete_dir(str(d / "sub"))
    assert [(o.op, o.path, o.dest) for o in _h(ffs).ops()] == [
        ("write", f"{d}/a", ""),
        ("close", f"{d}/a", ""),
        ("fsync", f"{d}/a", ""),
        ("create_dir", f"{d}/sub", ""),
        ("fsync_dir", f"{d}", ""),
        ("move", f"{d}/a", f"{d}/sub/b"),
        ("delete_file", f"{d}/sub/b", ""),
        ("delete_dir", f"{d}/sub", ""),
    ]


def test_a_torn_write_lands_only_the_bytes_before_the_cut(ffs, d):
    _h(ffs).tear("*/victim", at_byte=5, nth=2)
    for _ in range(2):
        with ffs.open_output_stream(str(d / "victim")) as out:
            out.write(b"01234")
            out.write(b"56789")  # the writer sees success
        assert (d / "victim").read_bytes() == (b"01234" if _ else b"0123456789")
    _write(ffs, d / "victim", b"0123456789")
    assert (d / "victim").read_bytes() == b"0123456789", "only the chosen write is torn"


def test_power_loss_drops_what_was_never_fsynced(ffs, d):
    _write(ffs, d / "never", b"lost")  # neither the bytes nor the name were synced
    _h(ffs).power_loss()
    assert not (d / "never").exists()
    _write(ffs, d / "named", b"lost")
    _h(ffs).fsync(str(d), directory=True)  # the name is durable, the bytes are not
    _h(ffs).power_loss()
    assert (d / "named").read_bytes() == b""


def test_power_loss_truncates_to_the_last_fsynced_bytes(ffs, d):
    _durable_write(ffs, d / "f", b"abcd")
    _write(ffs, d / "f", b"abcdefgh")
    _h(ffs).power_loss()
    assert (d / "f").read_bytes() == b"abcd"


@pytest.mark.parametrize("synced", [False, True])
def test_a_rename_is_durable_only_once_its_directory_is_fsynced(ffs, d, synced):
    _durable_write(ffs, d / "x.tmp", b"manifest")
    ffs.move(str(d / "x.tmp"), str(d / "x"))
    if synced:
        _h(ffs).fsync(str(d), directory=True)
    _h(ffs).power_loss()
    assert sorted(p.name for p in d.iterdir()) == (["x"] if synced else ["x.tmp"])
    assert (d / ("x" if synced else "x.tmp")).read_bytes() == b"manifest"


def test_unsynced_deletes_come_back(ffs, d):
    (d / "old").write_bytes(b"was here before the wrapper")
    (d / "tree" / "sub").mkdir(parents=True)
    (d / "tree" / "sub" / "leaf").write_bytes(b"leaf")
    ffs.delete_file(str(d / "old"))
    ffs.delete_dir(str(d / "tree"))
    assert not (d / "old").exists() and not (d / "tree").exists()
    _h(ffs).power_loss()
    assert (d / "old").read_bytes() == b"was here before the wrapper"
    assert (d / "tree" / "sub" / "leaf").read_bytes() == b"leaf"


def test_a_directory_never_made_durable_takes_its_files_with_it(ffs, d):
    ffs.create_dir(str(d / "new" / "deeper"), recursive=True)
    _durable_write(ffs, d / "new" / "deeper" / "f", b"synced, but its directories are not")
    _h(ffs).power_loss()
    assert not (d / "new").exists()
    ffs.create_dir(str(d / "new"))
    _h(ffs).fsync(str(d), directory=True)
    _durable_write(ffs, d / "new" / "f", b"kept")
    _h(ffs).power_loss()
    assert (d / "new" / "f").read_bytes() == b"kept"


def test_a_stream_open_across_a_power_loss_never_lands(ffs, d):
    out = ffs.open_output_stream(str(d / "late"))
    out.write(b"x")
    _h(ffs).power_loss()
    with pytest.raises(OSError) as err:
        out.close()
    assert err.value.errno == errno.EIO


def test_flip_bit_changes_exactly_one_bit(ffs, d):
    _durable_write(ffs, d / "f", b"\x00" * 8)
    _h(ffs).flip_bit(str(d / "f"), offset=3, bit=2)
    assert (d / "f").read_bytes() == b"\x00\x00\x00\x04\x00\x00\x00\x00"
    _h(ffs).power_loss()
    assert (d / "f").read_bytes()[3] == 4, "the flip is in the stored (durable) bytes too"


def _op(kind: str, ffs: pafs.PyFileSystem, d: Path, i: int) -> None:
    path = d / f"f{i}"
    if kind == "write":
        _write(ffs, path, b"data")
        return
    (d / f"f{i}").write_bytes(b"data")
    if kind == "fsync":
        filesystem.sync_file(ffs, str(path))
    elif kind == "move":
        ffs.move(str(path), str(d / f"g{i}"))
    else:
        ffs.delete_file(str(path))


@pytest.mark.parametrize("kind", ["write", "fsync", "move", "delete"])
@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_an_injected_error_hits_only_the_chosen_occurrence(ffs, d, kind, code):
    _h(ffs).fail(kind, "*/f*", nth=2, error=code)
    _op(kind, ffs, d, 1)
    with pytest.raises(OSError) as err:
        _op(kind, ffs, d, 2)
    assert err.value.errno == code
    _op(kind, ffs, d, 3)
    failed = [o for o in _h(ffs).ops() if o.error]
    assert len(failed) == 1 and failed[0].error == code and failed[0].path == f"{d}/f2"


def test_an_injected_fsync_error_leaves_the_bytes_undurable(ffs, d):
    _write(ffs, d / "f", b"data")
    _h(ffs).fsync(str(d), directory=True)
    _h(ffs).fail("fsync", "*/f")
    with pytest.raises(OSError):
        filesystem.sync_file(ffs, str(d / "f"))
    _h(ffs).power_loss()
    assert (d / "f").read_bytes() == b""


def test_copies_share_one_state(ffs, d):
    """A handler pickled into another process (a Ray actor) records into the same state."""
    twin = pickle.loads(pickle.dumps(ffs))
    _write(twin, d / "f", b"from the twin")
    assert Op("close", f"{d}/f") in _h(ffs).ops()
    _h(ffs).power_loss()
    assert not (d / "f").exists()


def test_the_fsync_seam(tmp_path, monkeypatch):
    synced: list[tuple[str, bool]] = []
    monkeypatch.setattr(
        filesystem, "_fsync_path", lambda p, directory=False: synced.append((p, directory))
    )
    local = pafs.LocalFileSystem()
    filesystem.sync_file(local, "/x/f")
    filesystem.sync_dir(local, "/x")
    assert synced == [("/x/f", False), ("/x", True)]
    remote = pafs.SubTreeFileSystem(str(tmp_path), local)  # stands for an object store
    filesystem.sync_file(remote, "f")
    assert len(synced) == 2, "nothing to fsync on an object store"


def test_the_run_seam_takes_the_wrapper_the_environment_names(tmp_path, monkeypatch):
    """Production never imports the testing wing: an armed run resolves its local paths
    through the hook that the environment names (faults.local_filesystem), and refuses an
    armed fault filesystem without one rather than run unfaulted."""
    for name in (faults.FAULTFS_ENV, faults.FAULTFS_HOOK_ENV):
        monkeypatch.delenv(name, raising=False)
    local = pafs.LocalFileSystem()
    assert faults.local_filesystem(local) is local
    monkeypatch.setenv(faults.FAULTFS_ENV, str(tmp_path / "state"))
    with pytest.raises(ValueError, match="names no <module>:<function>"):
        filesystem.resolve(str(tmp_path / "run"))
    monkeypatch.setenv(faults.FAULTFS_HOOK_ENV, "rollout_recovery.faults:no_such_hook")
    with pytest.raises(ValueError, match="does not load"):
        filesystem.resolve(str(tmp_path / "run"))
    for name, value in armed_env(tmp_path / "state").items():
        monkeypatch.setenv(name, value)
    fs, path = filesystem.resolve(str(tmp_path / "run"))
    assert isinstance(fs.handler, FaultFs) and not fs.handler.object_store
    assert path == str(tmp_path / "run")
    assert faults.actor_env_vars()[faults.FAULTFS_HOOK_ENV] == HOOK
