"""`rollout-recovery train` the way users break it: a crash between a step's snapshot and its
log line, a restore of a finished run, with another model, with every snapshot damaged, a
fresh run over an old one, a read-only and a full disk. Each expected failure ends in one line
naming the cause and the fix, a non-zero exit, and nothing deleted or changed.

Real runs (real engine, real files, real tmpfs mounts for the full and read-only disks); the
refusals that need no engine happen before any worker starts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout_recovery.testing.campaign.crash_points import (
    JOB,
)

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.engine
SMALL = [
    "grpo.steps=2",
    "grpo.prompts_per_step=1",
    "grpo.generations_per_prompt=2",
    "policy.generation.max_new_tokens=32",
    "rollout_checkpointing.snapshot_attempt_interval_s=0.5",
]


def _train(run_dir: Path | str, *extra: str, restore: bool = False, env: dict | None = None):
    cmd = [sys.executable, "-m", "rollout_recovery.cli", "train", "--config",
           str(REPO / "configs" / "prefix_recovery.yaml"),
           f"checkpointing.checkpoint_dir={run_dir}", *SMALL, *extra]  # fmt: skip
    if restore:
        cmd.insert(4, "--restore")
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, **(env or {})}, start_new_session=True,
                          check=False)  # fmt: skip
    return proc, time.monotonic() - t0


def _tree(root: Path) -> dict[str, str]:
    """Every file under root with its sha256: a check that nothing was deleted or changed."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip


def _one_line_refusal(proc, *needles: str) -> str:
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("rollout-recovery: ")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _steps(run_dir: Path) -> list[dict]:
    lines = (run_dir / "steps.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "event" not in r]


@pytest.fixture(scope="module")
def finished_run(crash_chain) -> Path:
    """A 3-step run killed three times in a row (the reduced crash campaign's run, shared
    through tests/conftest.py), the last time right after step 2's snapshot was published and
    before step 2 reached the step log; then restored to the end."""
    work, result = crash_chain
    [case] = result.cases
    assert case.violations == [] and case.crashes[-1] == "after_trainer_snapshot@1"
    return work / case.case / "run"


def test_a_step_whose_log_line_was_lost_is_logged_after_the_restore(finished_run):
    records = _steps(finished_run)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[1]["logged_from"] == "trainer_checkpoint" and records[1]["loss"] is not None
    assert all("logged_from" not in r for r in (records[0], records[2]))
    events = [json.loads(x) for x in (finished_run / "steps.jsonl").read_text().splitlines()
              if "event" in x]  # fmt: skip
    assert [e["event"] for e in events] == ["restore"] * 3 and events[-1]["step"] == 2


def test_restoring_a_finished_run_is_refused(finished_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    before = _tree(run_dir)
    proc, took = _train(run_dir, *JOB, restore=True)
    _one_line_refusal(proc, "already finished its 3 steps", "grpo.steps")
    assert _tree(run_dir) == before and took < 60


def test_a_crash_after_the_last_snapshot_loses_no_log_line(finished_run, tmp_path):
    """Killed after the last step's snapshot and before its log line: the restore finds the
    run finished, says so, and writes the lost line from the trainer checkpoint."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    lines = (run_dir / "steps.jsonl").read_text().splitlines()
    (run_dir / "steps.jsonl").write_text("\n".join(lines[:-1]) + "\n")  # step 3's line lost
    proc, took = _train(run_dir, *JOB, restore=True)
    _one_line_refusal(proc, "already finished its 3 steps", "step 3's log line")
    assert [r["step"] for r in _steps(run_dir)] == [1, 2, 3] and took < 60
    assert _steps(run_dir)[-1]["logged_from"] == "trainer_checkpoint"


def test_a_fresh_run_over_an_existing_one_is_refused(finished_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    before = _tree(run_dir)
    proc, _ = _train(run_dir)
    _one_line_refusal(proc, "already holds a run", "--restore")
    assert _tree(run_dir) == before


def test_a_restore_with_another_model_is_refused_before_loading_anything(finished_run, tmp_path):
    """Same shape, other weights: the snapshot's calls would be continued by another model."""
    import torch
    from safetensors.torch import load_file, save_file

    from rollout_recovery.tiny_model import ensure_tiny_model

    other = tmp_path / "other-model"
    shutil.copytree(ensure_tiny_model(), other)
    tensors = load_file(str(other / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + torch.full_like(tensors[name], 1e-3)
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    before = _tree(run_dir)
    proc, _ = _train(run_dir, *JOB, f"policy.model_path={other}", "grpo.steps=4", restore=True)
    _one_line_refusal(proc, "continued by other weights", "policy.model_path")
    assert _tree(run_dir) == before
    assert "Started a local Ray instance" not in proc.stderr  # refused before anything started


def test_when_every_snapshot_is_unusable_nothing_restarts_and_nothing_is_deleted(
    finished_run, tmp_path
):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    snapshots = sorted((run_dir / "data_plane").glob("snapshot-*"))
    assert snapshots
    for snap in snapshots:
        manifest = snap / "MANIFEST.json"
        manifest.write_bytes(manifest.read_bytes()[:-40])  # torn
    before = _tree(run_dir)
    proc, _ = _train(run_dir, *JOB, "grpo.steps=4", restore=True)
    line = _one_line_refusal(proc, "no usable snapshot", "nothing was deleted", "checkpoint_dir")
    assert all(snap.name in line for snap in snapshots)
    assert "starting from step 0" not in proc.stdout
    assert _tree(run_dir) == before


@contextlib.contextmanager
def _tmpfs(path: Path, size: str):
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_read_only_checkpoint_location_is_refused_at_once(finished_run, tmp_path):
    with _tmpfs(tmp_path / "ro", "64m") as mnt:
        shutil.copytree(finished_run, mnt / "run")
        before = _tree(mnt / "run")
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        proc, took = _train(mnt / "run", *JOB, "grpo.steps=4", restore=True)
        _one_line_refusal(proc, "Read-only file system", "checkpointing.checkpoint_dir")
        assert _tree(mnt / "run") == before and took < 60


def test_a_full_disk_ends_the_run_in_one_line_and_keeps_what_was_written(tmp_path):
    """12 MB hold the weights pushed to the workers (6 MB) and the snapshots, not the trainer
    checkpoint (17 MB with the optimizer): step 1's checkpoint hits ENOSPC."""
    with _tmpfs(tmp_path / "full", "12m") as mnt:
        proc, _ = _train(mnt / "run", "grpo.steps=1", "policy.generation.max_new_tokens=384")
        _one_line_refusal(proc, "trainer checkpoint of step 1", "No space left on device",
                          "train --restore")  # fmt: skip
        snapshots = [p for p in (mnt / "run" / "data_plane").glob("snapshot-*")
                     if (p / "MANIFEST.json").exists()]  # fmt: skip
        assert snapshots, "the cadence snapshots of step 0 were kept"
        assert not (mnt / "run" / "trainer" / "step-000001" / "meta.json").exists()


def test_a_damaged_newest_snapshot_is_skipped_on_the_terminal_and_in_the_step_log(
    finished_run, tmp_path, capsys
):
    from rollout_recovery.config import load_config
    from rollout_recovery.storage import RunStorage
    from rollout_recovery.trainer.run_plan import announce as _announce
    from rollout_recovery.trainer.run_plan import plan_restore

    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    newest = sorted((run_dir / "data_plane").glob("snapshot-*"))[-1]
    arrow = next(newest.rglob("*.arrow"))
    data = bytearray(arrow.read_bytes())
    data[len(data) // 2] ^= 0x40  # one flipped bit
    arrow.write_bytes(bytes(data))
    overrides = [f"checkpointing.checkpoint_dir={run_dir}", *SMALL, *JOB, "grpo.steps=4"]
    cfg = load_config(REPO / "configs" / "prefix_recovery.yaml", overrides)
    storage = RunStorage(str(run_dir))
    plan = plan_restore(cfg, storage)
    [(skipped, reason)] = plan.choice.skipped
    assert skipped == str(newest) and "sha256" in reason and plan.choice.snapshot != skipped
    _announce(storage, plan)
    out = capsys.readouterr().out
    assert f"Snapshot {newest} is unusable" in out and "falling back" in out
    event = json.loads((run_dir / "steps.jsonl").read_text().splitlines()[-1])
    assert event["event"] == "restore" and event["skipped"][0]["snapshot"] == str(newest)


def test_a_dead_worker_with_failover_off_ends_the_run_in_one_line(tmp_path):
    """The worker exits during a checkpoint's cut while its calls decode (failover off): the
    call it dropped ends `train` in one line naming the worker, the call and the fix, not
    with the `EpisodeFailed ... RemoteProtocolError` traceback it ended with before."""
    crash = {"ROLLOUT_RECOVERY_CRASH_AT": "cut_rows_staged@1:exit"}  # the worker process only
    proc, _ = _train(tmp_path / "run", "failover.enabled=false", "grpo.steps=1",
                     "policy.generation.max_new_tokens=384", env=crash)  # fmt: skip
    line = _one_line_refusal(proc, "worker 0 dropped model call s0000-p000-g",
                             "failover.enabled=false", "Set failover.enabled=true",
                             "`train --restore`")  # fmt: skip
    assert "EpisodeFailed" not in proc.stderr and "RayTaskError" not in proc.stderr, line


def test_an_error_in_the_users_effect_ends_the_run_naming_it_with_its_own_frames(tmp_path):
    """Raised in the environment actor (its loop thread, then Ray), shown in the driver as one
    line naming the effect function, the episode and the fix, and the user's frames only."""
    proc, _ = _train(tmp_path / "run", "grpo.steps=1",
                     "environment.episode=tests.engine.user_episodes:divides_by_zero",
                     env={"PYTHONPATH": str(REPO)})  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    [at] = [i for i, ln in enumerate(lines) if ln.startswith("rollout-recovery: ")]
    assert lines[at].startswith(
        "rollout-recovery: effect 'divide' (tests.engine.user_episodes:divide) raised "
        "ZeroDivisionError: division by zero in episode s0000-p000-g"
    ), lines[at]
    assert "of environment.episode=tests.engine.user_episodes:divides_by_zero" in lines[at]
    assert "fix the effect function" in lines[at] and "`train --restore`" in lines[at]
    shown = lines[at + 1 :]
    assert shown[0] == "  your code (most recent call last):", proc.stderr[-3000:]
    files = [ln.strip() for ln in shown if ln.lstrip().startswith('File "')]
    assert [f.rsplit(" in ", 1)[1] for f in files] == ["divides_by_zero", "divide"], shown
    assert all("tests/engine/user_episodes.py" in f for f in files), shown
    assert shown[-1] == "  ZeroDivisionError: division by zero", shown
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for internal in ("runtime.py", "runner.py", "concurrent/futures", "RayTaskError"):
        assert internal not in "\n".join(shown), shown
