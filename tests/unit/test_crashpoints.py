"""Crash points: the registry matches the code, arming is validated, and each action does what
it says to a real job of several processes in its own session (kill: all gone; exit: only the
process that reached it; freeze: all stopped; pause: all stopped at each qualifying arrival,
resumed by the check that watches), leaving a mark that names the point and its facts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rollout_recovery import crashpoints

REPO = Path(__file__).resolve().parents[2]

# A parent that starts a child (another process of the job, as Ray workers are) and then
# reaches the point twice; the child only sleeps.
JOB = textwrap.dedent(
    """
    import subprocess, sys, time
    from rollout_recovery.crashpoints import crash_point
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         stdout=subprocess.DEVNULL)
    print(child.pid, flush=True)
    time.sleep(0.5)
    crash_point("manifest_written")
    crash_point("manifest_written")
    print("survived", flush=True)
    child.kill()
    """
)


def _start(tmp_path: Path, armed: str | None, trace: bool = False) -> subprocess.Popen:
    env = os.environ | {crashpoints.MARK_ENV: str(tmp_path / "mark.jsonl")}
    if armed:
        env[crashpoints.ENV] = armed
    if trace:
        env[crashpoints.TRACE_ENV] = str(tmp_path / "trace.jsonl")
    return subprocess.Popen([sys.executable, "-c", JOB], stdout=subprocess.PIPE, text=True,
                            env=env, cwd=REPO, start_new_session=True)  # fmt: skip


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return None


def _marks(tmp_path: Path) -> list[dict]:
    path = tmp_path / "mark.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_every_registered_point_is_reached_somewhere_in_the_code_and_only_those():
    called = set()
    for path in (REPO / "rollout_recovery").rglob("*.py"):
        called |= set(re.findall(r'crash_point\("([a-z_]+)"[,)]', path.read_text()))
    assert called == set(crashpoints.POINTS)


@pytest.mark.parametrize(
    "armed, needle",
    [("nowhere", "unknown crash point"), ("manifest_written:explode", "unknown action"),
     ("manifest_written@0", "number >= 1"), ("manifest_written@x", "number >= 1")],
)  # fmt: skip
def test_a_bad_setting_is_refused_naming_the_variable(armed, needle):
    with pytest.raises(ValueError, match=needle) as err:
        crashpoints.parse(armed)
    assert crashpoints.ENV in str(err.value)


def test_parse_defaults_to_the_first_arrival_and_a_kill():
    assert crashpoints.parse("fence_held") == ("fence_held", 1, "kill")
    assert crashpoints.parse("fence_held@3:freeze") == ("fence_held", 3, "freeze")


def test_kill_at_the_second_arrival_kills_every_process_of_the_session(tmp_path):
    proc = _start(tmp_path, "manifest_written@2")
    child = int(proc.stdout.readline())
    out = proc.communicate(timeout=30)[0]
    assert proc.returncode == -signal.SIGKILL and "survived" not in out
    deadline = time.monotonic() + 10
    while _state(child) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _state(child) in (None, "Z")  # the other process of the job died too
    [mark] = _marks(tmp_path)
    assert (mark["point"], mark["arrival"], mark["action"]) == ("manifest_written", 2, "kill")


def test_exit_ends_only_the_process_that_reached_the_point(tmp_path):
    proc = _start(tmp_path, "manifest_written:exit")
    child = int(proc.stdout.readline())
    proc.communicate(timeout=30)
    try:
        assert proc.returncode == 137
        assert _state(child) not in (None, "Z")  # still running
    finally:
        os.kill(child, signal.SIGKILL)
    assert [m["point"] for m in _marks(tmp_path)] == ["manifest_written"]


def test_freeze_stops_every_process_of_the_session_until_it_is_killed(tmp_path):
    proc = _start(tmp_path, "manifest_written:freeze")
    child = int(proc.stdout.readline())
    try:
        deadline = time.monotonic() + 20
        while {_state(proc.pid), _state(child)} != {"T"} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _state(proc.pid) == "T" and _state(child) == "T"
        assert [m["action"] for m in _marks(tmp_path)] == ["freeze"]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        os.kill(child, signal.SIGKILL)
        proc.wait(timeout=30)


ANCHORED = textwrap.dedent(
    """
    from rollout_recovery.crashpoints import crash_point
    for name in ("manifest_written", "after_trainer_snapshot", "manifest_written"):
        print(name, flush=True)
        crash_point(name)
    print("survived", flush=True)
    """
)


def test_an_anchored_point_counts_arrivals_only_after_the_anchor(tmp_path):
    env = os.environ | {crashpoints.ENV: "manifest_written@1",
                        crashpoints.AFTER_ENV: "after_trainer_snapshot@1",
                        crashpoints.MARK_ENV: str(tmp_path / "mark.jsonl")}  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", ANCHORED], capture_output=True, text=True,
                          env=env, cwd=REPO, start_new_session=True, timeout=30)  # fmt: skip
    assert proc.returncode == -signal.SIGKILL
    assert proc.stdout.split() == ["manifest_written", "after_trainer_snapshot",
                                   "manifest_written"]  # fmt: skip
    [mark] = _marks(tmp_path)
    assert mark["after"] == "after_trainer_snapshot@1" and mark["arrival"] == 1


def test_trace_records_every_arrival_and_does_not_act(tmp_path):
    proc = _start(tmp_path, None, trace=True)
    child = int(proc.stdout.readline())
    out = proc.communicate(timeout=30)[0]
    os.kill(child, signal.SIGKILL) if _state(child) not in (None, "Z") else None
    assert proc.returncode == 0 and "survived" in out
    trace = [json.loads(x) for x in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert [(t["point"], t["arrival"]) for t in trace] == [("manifest_written", 1),
                                                           ("manifest_written", 2)]  # fmt: skip
    assert _marks(tmp_path) == []


def test_an_unarmed_point_costs_no_file_and_no_count(tmp_path, monkeypatch):
    for var in (crashpoints.ENV, crashpoints.TRACE_ENV):
        monkeypatch.delenv(var, raising=False)
    before = dict(crashpoints._reached)
    crashpoints.crash_point("fence_held")
    assert crashpoints._reached == before
    with pytest.raises(ValueError, match="unknown crash point"):
        crashpoints.crash_point("nowhere")


def test_the_crash_consistency_page_lists_every_point_in_the_registry_order():
    page = (REPO / "docs" / "crash_consistency.md").read_text()
    listed = re.findall(r"^\| `([a-z_]+)` \|", page, flags=re.M)
    assert listed == list(crashpoints.POINTS)


# Five snapshots of steps 0, 1, 1, 2, 2 (facts as the coordinator passes them), then done.
SNAPSHOTS = textwrap.dedent(
    """
    from rollout_recovery.crashpoints import crash_point
    for i, step in enumerate([0, 1, 1, 2, 2]):
        crash_point("snapshot_taken", step=step, snapshot=f"snapshot-{i}", cut_calls=i % 2)
        print("published", i, flush=True)
    print("survived", flush=True)
    """
)


def _snapshots(tmp_path: Path, armed: str, when: str) -> subprocess.Popen:
    env = os.environ | {crashpoints.ENV: armed, crashpoints.WHEN_ENV: when,
                        crashpoints.MARK_ENV: str(tmp_path / "mark.jsonl")}  # fmt: skip
    return subprocess.Popen([sys.executable, "-c", SNAPSHOTS], stdout=subprocess.PIPE, text=True,
                            env=env, cwd=REPO, start_new_session=True)  # fmt: skip


def test_kill_at_the_nth_arrival_whose_facts_qualify(tmp_path):
    """`@2` with `step>=1,cut_calls==1` is the second snapshot of a step >= 1 holding a cut
    call (snapshot-3), not the second arrival."""
    proc = _snapshots(tmp_path, "snapshot_taken@2", "step>=1,cut_calls==1")
    out = proc.communicate(timeout=30)[0]
    assert proc.returncode == -signal.SIGKILL
    assert out.split("\n")[:-1] == [f"published {i}" for i in range(3)]
    [mark] = _marks(tmp_path)
    assert mark["arrival"] == 2 and mark["facts"]["snapshot"] == "snapshot-3"


def test_pause_holds_the_job_at_every_qualifying_arrival_until_it_is_resumed(tmp_path):
    """The job stops itself (every process) right after each qualifying snapshot and goes on
    only when resumed: whatever the watcher's speed, it judges every one."""
    proc = _snapshots(tmp_path, "snapshot_taken:pause", "step>=1,step<2")
    held = []
    try:
        while len(held) < 2:
            deadline = time.monotonic() + 20
            while len(_marks(tmp_path)) <= len(held) or _state(proc.pid) != "T":
                assert time.monotonic() < deadline, "no pause"
                time.sleep(0.01)
            held.append(_marks(tmp_path)[-1])
            time.sleep(0.3)  # a slow watcher: the job waits, stopped
            assert _state(proc.pid) == "T"
            os.killpg(proc.pid, signal.SIGCONT)
        out = proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0 and "survived" in out
    assert [m["facts"]["snapshot"] for m in held] == ["snapshot-1", "snapshot-2"]
    assert [m["action"] for m in held] == ["pause", "pause"]


@pytest.mark.parametrize("when", ["step", "step>=x", "step=>1", ">=1", "step>=1,,cuts<"])
def test_a_bad_condition_is_refused_naming_the_variable(when):
    with pytest.raises(ValueError) as err:
        crashpoints.parse_when(when)
    assert crashpoints.WHEN_ENV in str(err.value)


def test_a_condition_on_a_missing_fact_is_not_met():
    assert crashpoints._meets({"step": 2}, "step>=2,step<3")
    assert not crashpoints._meets({"step": 2}, "cut_calls>=0")
    assert not crashpoints._meets({}, "step>=0")
