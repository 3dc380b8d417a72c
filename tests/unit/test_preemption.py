"""Preemption notices (preemption.py) and TrainingRun's final checkpoint on one, without
engines: a SIGTERM ends a guarded wait at once and is only noted elsewhere, Ctrl-C stays
Ctrl-C, a notice file counts as a SIGTERM, and the run's exit takes the final checkpoint in the
controller's `control` group, ends the controller at once and says in one line what was
saved. The real run is killed by
SIGTERM in tests/engine/test_preemption_engine.py."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from rollout_recovery.config import PreemptionConfig, load_config
from rollout_recovery.controller.selection import DATA_PLANE
from rollout_recovery.data_plane import StagingStore
from rollout_recovery.data_plane.ownership import Fence
from rollout_recovery.errors import Preempted
from rollout_recovery.preemption import NoticeWatch
from rollout_recovery.run import TrainingRun
from rollout_recovery.storage import RunStorage
from rollout_recovery.trainer.held_job import HeldJob


@pytest.fixture
def watch():
    w = NoticeWatch(PreemptionConfig(grace_s=10.0))
    assert w.start()
    yield w
    w.stop()


def _sigterm_in(seconds: float) -> None:
    threading.Timer(seconds, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()


def test_a_sigterm_ends_a_guarded_wait_at_once(watch):
    _sigterm_in(0.2)
    t0 = time.monotonic()
    with pytest.raises(Preempted) as info, watch.interruptible():
        time.sleep(30)
    assert time.monotonic() - t0 < 5
    assert info.value.notice == "SIGTERM" and info.value.code == 0
    assert 0 < watch.time_left() <= 10.0


def test_a_sigterm_elsewhere_is_noted_and_raised_at_the_next_safe_point(watch):
    _sigterm_in(0.1)
    time.sleep(0.5)  # e.g. the optimizer step: not interrupted
    assert watch.notice == "SIGTERM"
    with pytest.raises(Preempted):
        watch.check()
    with pytest.raises(Preempted), watch.interruptible():  # a guarded wait after it: not begun
        pytest.fail("the wait ran although a notice had come")


def test_ctrl_c_without_a_notice_stays_a_keyboard_interrupt(watch):
    with pytest.raises(KeyboardInterrupt), watch.interruptible():
        raise KeyboardInterrupt
    assert watch.notice is None
    watch.check()  # no notice: nothing raised


def test_a_notice_file_counts_as_a_sigterm(tmp_path):
    notice = tmp_path / "preempt-now"
    w = NoticeWatch(PreemptionConfig(notice_file=str(notice)))
    assert w.start()
    try:
        threading.Timer(0.3, notice.touch).start()
        t0 = time.monotonic()
        with pytest.raises(Preempted) as info, w.interruptible():
            time.sleep(30)
        assert time.monotonic() - t0 < 5
        assert info.value.notice == f"notice file {notice}"
    finally:
        w.stop()


def test_off_or_off_the_main_thread_nothing_is_watched():
    before = signal.getsignal(signal.SIGTERM)
    assert not NoticeWatch(PreemptionConfig(enabled=False)).start()
    result = []
    t = threading.Thread(target=lambda: result.append(NoticeWatch(PreemptionConfig()).start()))
    t.start()
    t.join()
    assert result == [False] and signal.getsignal(signal.SIGTERM) is before


def test_stop_gives_sigterm_back_to_its_earlier_handler():
    before = signal.getsignal(signal.SIGTERM)
    w = NoticeWatch(PreemptionConfig())
    w.start()
    assert signal.getsignal(signal.SIGTERM) is not before
    w.stop()
    assert signal.getsignal(signal.SIGTERM) is before


class FakeController:
    """The controller as TrainingRun calls it on a preemption; `answer` is preempt's."""

    def __init__(self, answer: dict) -> None:
        self.answer, self.calls = answer, []

    def call_in(self, group: str, name: str, *args, timeout=None):
        self.calls.append((group, name, args))
        return self.answer

    def kill(self):
        self.calls.append((None, "kill", ()))


def _run(tmp_path, answer: dict, *overrides: str) -> tuple[TrainingRun, FakeController]:
    storage = RunStorage(str(tmp_path / "run"))
    root = storage.child_uri(DATA_PLANE)
    owner = StagingStore.claim(root, first=True)
    cfg = load_config(None, [f"checkpointing.checkpoint_dir={tmp_path / 'run'}",
                             "policy.model_path=hf://org/tiny", *overrides])  # fmt: skip
    run = TrainingRun(cfg, storage.fenced(Fence.of(root, owner)), owner, None)
    ctl = FakeController(answer)
    run.job = HeldJob(ctl, None, "local")
    run._notices.start()
    return run, ctl


def _events(tmp_path) -> list[dict]:
    lines = (tmp_path / "run" / "steps.jsonl").read_text().splitlines()
    return [json.loads(ln) for ln in lines]


def test_a_preempted_run_checkpoints_beside_the_interrupted_call_and_says_what_it_saved(
    tmp_path, capsys
):
    answer = {"held": 4, "calls_cut": 4, "checkpoint": "file:///x/snapshot-000003",
              "save_s": 0.4}  # fmt: skip
    run, ctl = _run(tmp_path, answer)
    run._last_step = 2
    _sigterm_in(0.1)
    with pytest.raises(Preempted), run, run._notices.interruptible():
        time.sleep(30)
    assert [c[:2] for c in ctl.calls] == [("control", "preempt"), (None, "kill")]
    timeout, step = ctl.calls[0][2]
    assert 0 < timeout <= 25.0 - 5.0 and step == 3
    out = capsys.readouterr().out
    assert out == ("preempted (SIGTERM): 4 calls in flight held, 4 cut; snapshot "
                   "file:///x/snapshot-000003 published in 0.4 s; continue with "
                   "`train --restore`\n")  # fmt: skip
    [event] = _events(tmp_path)
    assert event["event"] == "preempted" and event["checkpoint"] == answer["checkpoint"]


def test_a_final_checkpoint_that_fails_says_what_still_holds_the_run(tmp_path, capsys):
    run, _ = _run(tmp_path, {"held": 2, "failed": "took longer than the 3.0 s it was given"},
                  "token_capture.enabled=true", "token_capture.log_interval_tokens=8")  # fmt: skip
    _sigterm_in(0.1)
    with pytest.raises(Preempted), run, run._notices.interruptible():
        time.sleep(30)
    out = capsys.readouterr().out
    assert out.startswith(
        "preempted (SIGTERM): the final checkpoint did not finish within "
        "preemption.grace_s=25 (took longer than the 3.0 s it was given)"
    )
    assert "the last published snapshot and the token log hold the run (none published" in out
    assert "starts again from step 0): continue it with `train --restore`" in out
    assert out.count("\n") == 1 and _events(tmp_path)[0]["failed"]


def test_a_notice_outside_a_guarded_wait_still_ends_the_run_as_preempted(tmp_path):
    """The notice came while the loop trained (noted only); the loop's next call raises."""
    run, ctl = _run(tmp_path, {"held": 0, "calls_cut": 0, "checkpoint": "s", "save_s": 0.1})
    _sigterm_in(0.05)
    with pytest.raises(Preempted), run:
        time.sleep(0.4)
        run.begin_step(0)
    assert [c[1] for c in ctl.calls] == ["preempt", "kill"]
