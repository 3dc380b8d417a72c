"""A run's checkpoint location through pyarrow.fs: local paths and s3:// URIs alike (the local
moto server), never turned into a local path by path joining."""

from __future__ import annotations

import pytest

from rollout_recovery.storage import RunStorage, StorageError
from tests.cluster.store_helpers import local_s3

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def s3_uri():
    with local_s3("rr-storage", "runs/a") as uri:
        yield uri


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path, s3_uri) -> RunStorage:
    return RunStorage(str(tmp_path / "run") if request.param == "local" else s3_uri)


def test_files_logs_and_children_on_any_filesystem(storage):
    storage.check_writable()
    storage.write_bytes("trainer/step-000001/meta.json", b'{"a": 1}')
    storage.write_bytes("trainer/step-000001/meta.json", b'{"a": 2}')  # replaced whole
    assert storage.read_bytes("trainer/step-000001/meta.json") == b'{"a": 2}'
    for i in range(3):
        storage.append_line("steps.jsonl", f'{{"step": {i}}}')
    assert storage.read_lines("steps.jsonl") == ['{"step": 0}', '{"step": 1}', '{"step": 2}']
    assert storage.list_dir("trainer") == ["step-000001"]
    assert [n for n in storage.list_dir("") if n.startswith(".write-probe")] == []
    child = storage.child_uri("data_plane")
    if not storage.local:
        assert child.startswith("s3://") and "s3:/r" not in child
        assert "endpoint_override=" in child  # the URI's options reach every child
        assert storage.display() == "s3://rr-storage/runs/a"  # no credentials in messages
    storage.delete_dir("trainer")
    assert storage.list_dir("trainer") == []
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("missing.json")


def test_a_read_only_location_fails_the_write_probe(tmp_path):
    import subprocess

    mnt = tmp_path / "ro"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(mnt)], check=True)
    try:
        with pytest.raises(StorageError, match="Read-only file system"):
            RunStorage(str(mnt)).check_writable()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
