"""The liveness watch (controller/liveness.py): a step whose episodes make no progress stops
with a named reason instead of waiting forever; one that moves, or waits on calls in flight or
effects, goes on. Fakes for the environment's answers; the real path (a `train` whose episode
waits on nothing) is tests/engine/test_train_failures.py."""

from __future__ import annotations

import asyncio
import pickle
import threading
import time
from types import SimpleNamespace

import pytest

from rollout_recovery.config import LivenessConfig, load_config
from rollout_recovery.controller import steps
from rollout_recovery.controller.liveness import watch_step
from rollout_recovery.environment.client import EnvironmentClient
from rollout_recovery.environment.rollout_env import RolloutEnvironment
from rollout_recovery.errors import RunStalled
from rollout_recovery.protocol import EnvironmentProgress
from tests.unit.test_checkpoint_protocol import _rr, job_of

FAST = LivenessConfig(stall_timeout_s=0.3, check_interval_s=0.05)


def _run(work, progress, cfg=FAST, step=3):
    async def main():
        async with asyncio.timeout(10):
            return await watch_step(work(), progress, cfg, step)

    return asyncio.run(main())


async def _forever():
    await asyncio.Event().wait()


async def _after(seconds: float, value="done"):
    await asyncio.sleep(seconds)
    return value


def _constant(**fields):
    async def progress():
        return EnvironmentProgress(**fields)

    return progress


def test_a_step_with_nothing_moving_stops_with_no_progress():
    t0 = time.monotonic()
    with pytest.raises(RunStalled) as err:
        _run(_forever, _constant(episodes_running=4, events=7))
    assert err.value.reason == "no_progress"
    assert "step 3 stalled (run_stalled.no_progress" in str(err.value)
    assert "4 episodes unfinished" in str(err.value) and "train --restore" in str(err.value)
    assert 0.3 <= time.monotonic() - t0 < 2


def test_growing_events_keep_a_step_alive_until_its_work_ends():
    events = iter(range(1000))

    async def progress():
        return EnvironmentProgress(episodes_running=1, events=next(events))

    assert _run(lambda: _after(1.0), progress) == "done"


@pytest.mark.parametrize("busy", ["calls_in_flight", "calls_moving", "effects_running"])
def test_a_call_in_flight_or_moving_or_a_running_effect_is_progress(busy):
    assert _run(lambda: _after(1.0), _constant(episodes_running=1, **{busy: 1})) == "done"


def test_an_environment_that_does_not_answer_is_named():
    async def progress():
        await asyncio.Event().wait()

    with pytest.raises(RunStalled) as err:
        _run(_forever, progress)
    assert err.value.reason == "environment_unresponsive"


def test_restored_episodes_no_step_takes_are_named_even_while_others_move():
    events = iter(range(1000))

    async def progress():
        return EnvironmentProgress(episodes_running=2, calls_in_flight=2, events=next(events),
                                   restored_waiting=3, restored_waiting_s=0.5,
                                   restored_example="s0000-p001-g0")  # fmt: skip

    with pytest.raises(RunStalled) as err:
        _run(_forever, progress)
    assert err.value.reason == "restored_unclaimed"
    assert "3 restored episodes (e.g. s0000-p001-g0)" in str(err.value)


def test_the_watch_can_be_turned_off():
    off = LivenessConfig(stall_timeout_s=None, check_interval_s=0.05)
    assert _run(lambda: _after(0.5), _constant(), off) == "done"


def test_the_stalled_work_is_cancelled():
    cancelled = asyncio.Event()

    async def work():
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def main():
        with pytest.raises(RunStalled):
            async with asyncio.timeout(10):
                await watch_step(work(), _constant(), FAST, 0)
        assert cancelled.is_set()

    asyncio.run(main())


def test_run_stalled_crosses_a_process_with_its_reason():
    err = pickle.loads(pickle.dumps(RunStalled("no_progress", "step 1 stalled")))
    assert isinstance(err, RunStalled) and err.reason == "no_progress"
    assert str(err) == "step 1 stalled"


def test_progress_of_several_environments_adds_up():
    a = EnvironmentProgress(episodes_running=1, events=5, restored_waiting=1,
                            restored_waiting_s=2.0, restored_example="x")  # fmt: skip
    b = EnvironmentProgress(calls_in_flight=2, events=3, restored_waiting_s=1.0)
    total = sum([a, b], EnvironmentProgress())
    assert (total.episodes_running, total.calls_in_flight, total.events) == (1, 2, 8)
    assert (total.restored_waiting, total.restored_waiting_s, total.restored_example) == (
        1, 2.0, "x")  # fmt: skip


class ThreadedActor:
    """An in-process object called like a threaded actor: each call on a daemon thread of its
    own (a call that never returns does not hold the test process at exit)."""

    def __init__(self, obj) -> None:
        self.obj = obj

    def __getattr__(self, name):
        fn = getattr(self.obj, name)

        def remote(*args):
            loop = asyncio.get_running_loop()
            future = loop.create_future()

            def settle(ok: bool, value) -> None:
                if not future.done():
                    (future.set_result if ok else future.set_exception)(value)

            def run() -> None:
                try:
                    value, ok = fn(*args), True
                except Exception as err:
                    value, ok = err, False
                loop.call_soon_threadsafe(settle, ok, value)

            threading.Thread(target=run, daemon=True).start()
            return future

        return SimpleNamespace(remote=remote)


class EmptyStore:
    """No finished episodes: every submitted episode runs."""

    async def alist(self, partition, prefix=None):
        return []


async def waits_on_nothing(ctx, task):
    """An episode stuck outside any model call or effect."""
    await asyncio.Event().wait()


def test_submit_groups_fails_in_one_line_and_counts_the_stall(tmp_path):
    """The API path: a real environment object (in process) whose episodes wait on nothing."""
    cfg = load_config(None, [
        f"checkpointing.checkpoint_dir={tmp_path}",
        f"environment.episode={__name__}:waits_on_nothing",
        "liveness.stall_timeout_s=0.5", "liveness.check_interval_s=0.05",
    ])  # fmt: skip
    coordinator, _ = _rr(tmp_path)
    env = RolloutEnvironment(cfg.environment_config(), coordinator.workers, EmptyStore())
    rr = job_of(cfg, coordinator, EnvironmentClient(ThreadedActor(env)))
    rr.state.step = 2
    outcome: dict = {}

    def submit() -> None:
        try:
            steps.submit_groups(rr, [("s0002-p000", {"messages": []})], lambda g, i: i)
        except Exception as err:
            outcome["error"] = err

    try:
        thread = threading.Thread(target=submit, daemon=True)
        thread.start()
        thread.join(20)
        assert not thread.is_alive(), "submit_groups waited on episodes that do nothing"
        assert isinstance(outcome.get("error"), RunStalled), outcome
        assert "step 2 stalled (run_stalled.no_progress" in str(outcome["error"])
        assert rr.metrics.controller["run_stalled.no_progress"] == 1
        progress = asyncio.run(rr.env.progress())
        assert progress.episodes_running == 4 and progress.calls_in_flight == 0
    finally:
        rr.env.actor.obj.close()
        rr.loop.stop()
