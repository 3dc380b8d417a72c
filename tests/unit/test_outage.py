"""The soak's storage outage: writes fail with EIO while it lasts, reads go on, and the
production seam puts a run's local paths behind it."""

from __future__ import annotations

import errno
import time

import pyarrow.fs as pafs
import pytest

from rollout_recovery import faults
from rollout_recovery.testing import outage


def test_writes_fail_while_the_outage_lasts_and_reads_go_on(tmp_path, monkeypatch) -> None:
    state, data = tmp_path / "state", tmp_path / "data"
    data.mkdir()
    for key, value in outage.armed_env(state).items():
        monkeypatch.setenv(key, value)
    fs = faults.local_filesystem(pafs.LocalFileSystem())
    assert fs.type_name == "py::outage"
    with fs.open_output_stream(str(data / "before")) as f:
        f.write(b"kept")
    outage.begin(state, 600)  # ended below, once the writes were seen to fail
    time.sleep(0.1)  # past the filesystem's look at the outage (every 0.05 s)
    with pytest.raises(OSError) as err:
        fs.open_output_stream(str(data / "during"))
    assert err.value.errno == errno.EIO
    with pytest.raises(OSError):
        fs.move(str(data / "before"), str(data / "moved"))
    with fs.open_input_stream(str(data / "before")) as f:
        assert f.read() == b"kept"
    outage.begin(state, 0)
    time.sleep(0.1)
    with fs.open_output_stream(str(data / "after")) as f:
        f.write(b"ok")
    assert (data / "after").read_bytes() == b"ok"
    assert not (data / "during").exists()


def test_a_runs_writes_wait_out_a_short_outage(tmp_path, monkeypatch) -> None:
    """RunStorage tries a write, a log line and a delete again until the outage is over: each
    lands once."""
    from rollout_recovery.storage import RunStorage

    state = tmp_path / "state"
    for key, value in outage.armed_env(state).items():
        monkeypatch.setenv(key, value)
    run = RunStorage(str(tmp_path / "run"))
    run.append_line("steps.jsonl", "one")
    end = outage.begin(state, 0.5)
    time.sleep(0.1)  # past the filesystem's look at the outage (every 0.05 s)
    run.append_line("steps.jsonl", "two")
    run.write_bytes("batches/step-000001.arrow", b"batch")
    assert time.time() >= end  # it waited for the outage to end (whatever the load)
    assert run.read_lines("steps.jsonl") == ["one", "two"]
    assert run.read_bytes("batches/step-000001.arrow") == b"batch"
    outage.begin(state, 0.5)  # a trainer checkpoint's old meta.json is deleted first
    time.sleep(0.1)
    run.delete_file("batches/step-000001.arrow")
    assert not run.exists("batches/step-000001.arrow")
