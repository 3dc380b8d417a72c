"""Ctrl-C, a preemption notice while the job starts, and an immutable-entry conflict end a
command in one line with the documented exit code; Ray's start keeps the run's SIGTERM
handler (issue: restore contracts, items 9 and 10)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rollout_recovery import cli
from rollout_recovery.environment.token_sink import ConflictingEntryError
from rollout_recovery.errors import RecoveryError

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "prefix_recovery.yaml")


def _train_raising(monkeypatch, err: BaseException) -> None:
    from rollout_recovery.training import driver

    def train(*_a, **_k):
        raise err

    monkeypatch.setattr(driver, "train", train)


def test_ctrl_c_in_train_is_one_line_and_exit_130(monkeypatch, capsys, tmp_path):
    _train_raising(monkeypatch, KeyboardInterrupt())
    before = signal.getsignal(signal.SIGINT)
    try:
        code = cli.main(["train", "--config", CONFIG, f"checkpointing.checkpoint_dir={tmp_path}"])
    finally:
        signal.signal(signal.SIGINT, before)
    err = capsys.readouterr().err
    assert code == 130
    assert err.splitlines() == [
        "rollout-recovery: interrupted (Ctrl-C): the job stopped; its location keeps every "
        "published snapshot: continue it with `train --restore`"
    ]


def test_a_conflicting_token_entry_that_reaches_the_user_is_one_line(monkeypatch, capsys, tmp_path):
    from rollout_recovery.environment.token_sink import _conflict

    assert issubclass(ConflictingEntryError, RecoveryError)
    assert issubclass(ConflictingEntryError, ValueError)  # what callers caught before
    _train_raising(monkeypatch, _conflict("s0001-p000-g0/c0/a0"))
    code = cli.main(["train", "--config", CONFIG, f"checkpointing.checkpoint_dir={tmp_path}"])
    [line] = capsys.readouterr().err.splitlines()
    assert code == 1 and "s0001-p000-g0/c0/a0" in line and "`train --restore`" in line


KEPT = textwrap.dedent(
    """
    import os, signal, sys
    from rollout_recovery.runtime import _sigterm_kept
    got = []
    signal.signal(signal.SIGTERM, lambda s, f: got.append("ours"))
    with _sigterm_kept():
        # What Ray's start does: its own handler, then a notice arrives mid-start.
        signal.signal(signal.SIGTERM, lambda s, f: got.append("ray"))
        os.kill(os.getpid(), signal.SIGTERM)
        assert got == [], got  # blocked: not delivered during the start
    assert got == ["ours"], got
    print("kept")
    """
)


def test_ray_start_keeps_the_runs_sigterm_handler_and_delivers_a_notice_after_it():
    """A SIGTERM during Ray's start reaches the run's preemption watch once the start ends,
    never Ray's handler (exit 15) or its core's (SIGABRT)."""
    out = subprocess.run([sys.executable, "-c", KEPT], capture_output=True, text=True,
                         cwd=REPO, timeout=60)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "kept", out.stderr


def test_without_a_handler_of_its_own_rays_python_handler_stays_in_force():
    code = textwrap.dedent(
        """
        import signal
        from rollout_recovery.runtime import _sigterm_kept
        ray_handler = lambda s, f: None
        with _sigterm_kept():
            signal.signal(signal.SIGTERM, ray_handler)
        assert signal.getsignal(signal.SIGTERM) is ray_handler
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=60)  # fmt: skip
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("command", ["snapshots", "config"])
def test_ctrl_c_elsewhere_is_one_line_too(command):
    assert cli._after_interrupt(command) == ""
    assert "`gateway --restore`" in cli._after_interrupt("gateway")
