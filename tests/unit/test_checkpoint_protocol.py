"""The controller's checkpoint attempt: fences are always released, failures are bounded.

Fault injection with fake worker actors and a failing store (the real path is covered by the
functional recovery test)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from rollout_recovery.config import load_config
from rollout_recovery.controller import steps
from rollout_recovery.controller.coordinator import CheckpointCoordinator, RunState
from rollout_recovery.controller.job import Job
from rollout_recovery.controller.metrics import RunMetrics
from rollout_recovery.environment.client import EnvironmentClient
from rollout_recovery.environment.rollout_env import RolloutEnvironment
from rollout_recovery.errors import CheckpointWriteError, RunStalled
from rollout_recovery.generation.pool import WorkerHandle, WorkerPool
from rollout_recovery.runtime import LoopThread
from rollout_recovery.storage import RunStorage


class _Method:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        async def call():
            return self.fn(*args)

        return call()


class FakeWorker:
    def __init__(self) -> None:
        self.held: set[int] = set()
        self.begun: list[int] = []
        self.begin_fence = _Method(
            lambda epoch, lease: (self.held.add(epoch), self.begun.append(epoch))
        )
        self.end_fence = _Method(lambda epoch: self.held.discard(epoch))
        self.cut = _Method(lambda inv: {"calls": []})


class LocalActor:
    """An in-process object called the way the controller calls an actor (`.remote`)."""

    def __init__(self, obj) -> None:
        self.obj = obj

    def __getattr__(self, name):
        return _Method(getattr(self.obj, name))


class FailingStore:
    """Captures (inside the fences), then fails writing the files (after them)."""

    async def afreeze(self, *args, **kwargs):
        return "frozen"

    async def awrite(self, *args, **kwargs):
        raise OSError("disk full")


class HangingStore(FailingStore):
    """Hangs freezing (`stage="freeze"`, inside the fences) or writing (after them)."""

    def __init__(self, stage: str) -> None:
        self.stage = stage

    async def afreeze(self, *args, **kwargs):
        if self.stage == "freeze":
            await asyncio.sleep(3600)
        return "frozen"

    async def awrite(self, *args, **kwargs):
        await asyncio.sleep(3600)


def _rr(tmp_path, failures: int = 2, *extra: str) -> tuple[CheckpointCoordinator, list[FakeWorker]]:
    cfg = load_config(
        None,
        [
            f"checkpointing.checkpoint_dir={tmp_path}",
            "token_capture.enabled=true",
            "rollout_checkpointing.snapshot_attempt_interval_s=0.01",
            f"rollout_checkpointing.max_consecutive_failures={failures}",
            *extra,
        ],
    )
    fakes = [FakeWorker(), FakeWorker()]
    info = SimpleNamespace(url="http://127.0.0.1:9", served_model_name="policy", eos_token_id=2)
    workers = WorkerPool([WorkerHandle(f, info) for f in fakes])
    env = EnvironmentClient(LocalActor(RolloutEnvironment(cfg, workers, None)))
    state = RunState(model={"path": "tiny://default", "sha256": None})
    rr = CheckpointCoordinator(
        cfg, state, FailingStore(), workers, env, RunStorage(str(tmp_path)), RunMetrics()
    )
    return rr, fakes


def job_of(cfg, coordinator: CheckpointCoordinator, env: EnvironmentClient | None = None) -> Job:
    """A job made of these parts (no placement, no evidence log): its step calls run on its own
    loop, which the caller stops."""
    return Job(cfg, coordinator.storage, None, coordinator.state, coordinator.metrics,
               LoopThread("test-job"), None, coordinator.store, coordinator.workers,
               env or coordinator.env, coordinator, None)  # fmt: skip


def test_a_failed_checkpoint_releases_every_fence_and_publishes_nothing(tmp_path):
    rr, fakes = _rr(tmp_path)
    with pytest.raises(OSError, match="disk full"):
        asyncio.run(rr.attempt("cadence"))
    assert all(f.begun == [1] and not f.held for f in fakes)
    assert (
        rr.env.actor.obj.runner.participant.state == "idle"
    )  # admission reopened after the failure
    assert not (tmp_path / "checkpoints.jsonl").exists()
    assert not (tmp_path / "data_plane").exists()


def test_the_cadence_gives_up_after_max_consecutive_failures(tmp_path):
    rr, fakes = _rr(tmp_path, failures=3)
    calls = []
    orig = rr.attempt

    async def counted(reason, timeout_s=None):
        calls.append(reason)
        return await orig(reason, timeout_s)

    rr.attempt = counted

    async def cadence():
        async with asyncio.timeout(10):
            await rr.cadence()

    with pytest.raises(CheckpointWriteError, match=r"3 rollout checkpoint attempts failed"):
        asyncio.run(cadence())
    assert len(calls) == 3 and all(not f.held for f in fakes)
    failed = (tmp_path / "checkpoints.jsonl").read_text().splitlines()
    assert len(failed) == 3 and all("disk full" in line for line in failed)


def test_a_failed_snapshot_after_a_trainer_checkpoint_counts_like_any_other(tmp_path):
    """It does not stop the run by itself; it adds to the same count as cadence attempts."""
    rr, fakes = _rr(tmp_path, 3, "checkpointing.save_data_plane=true")
    job = job_of(rr.cfg, rr)  # the full config stands in for the coordinator's
    try:
        assert steps.notify_trainer_checkpoint(job, 1, None) == {"snapshot_s": None, "failed": 1}
        assert steps.notify_trainer_checkpoint(job, 2, None) == {"snapshot_s": None, "failed": 2}
        with pytest.raises(CheckpointWriteError, match="max_consecutive_failures=3"):
            steps.notify_trainer_checkpoint(job, 3, None)
    finally:
        job.loop.stop()
    assert all(not f.held for f in fakes)


class RaisingEnv(LocalActor):
    """An environment whose release step raises something other than a protocol error."""

    def __getattr__(self, name):
        if name == "reopen":
            return _Method(lambda ckpt: (_ for _ in ()).throw(RuntimeError("env lost")))
        return super().__getattr__(name)


def test_fences_are_released_whatever_the_environment_raises_on_release(tmp_path):
    rr, fakes = _rr(tmp_path)
    rr.env = EnvironmentClient(RaisingEnv(rr.env.actor.obj))
    with pytest.raises(OSError, match="disk full"):
        asyncio.run(rr.attempt("cadence"))
    assert all(f.begun == [1] and not f.held for f in fakes)
    assert rr.metrics.controller["release_errors"] == 1


@pytest.mark.parametrize("stage", ["freeze", "write"])
def test_an_attempt_past_its_timeout_is_aborted_and_releases_everything(tmp_path, stage):
    rr, fakes = _rr(tmp_path, 2, "rollout_checkpointing.attempt_timeout_s=0.3")
    rr.store = HangingStore(stage)
    with pytest.raises(TimeoutError, match=r"attempt_timeout_s=0\.3; aborted, nothing published"):
        asyncio.run(rr.attempt("cadence"))
    assert all(f.begun == [1] and not f.held for f in fakes)
    assert rr.env.actor.obj.runner.participant.state == "idle"
    assert (
        rr.metrics.controller["checkpoint_failures"] == 1
        and rr.metrics.controller["checkpoints"] == 0
    )
    assert not (tmp_path / "data_plane").exists()


class FinishingStore(FailingStore):
    """Finishes the step's work (`work`) in the same loop iteration as the freeze it answers:
    the ordering under which the cadence, cancelled as the work ended, kept going (Python
    3.11's `asyncio.wait_for` returns the result of an inner task that is already done and
    drops the cancellation). Counts the attempts begun after the work had finished."""

    def __init__(self) -> None:
        self.work: asyncio.Future | None = None
        self.late_attempts = 0

    async def afreeze(self, *args, **kwargs):
        if self.work.done():
            self.late_attempts += 1
        else:
            self.work.set_result("step done")
        return "frozen"


def test_the_cadence_stops_when_the_work_ends_in_the_same_moment_as_a_capture(tmp_path):
    """The restore hang of 2026-12-01: a step's episodes all finished, yet its submit never
    returned and checkpoints went on every interval, each recording no episode."""
    rr, fakes = _rr(tmp_path, 1000, "rollout_recovery.target_level=turn",
                    "checkpointing.save_data_plane=true")  # fmt: skip
    store = rr.store = FinishingStore()

    async def main():
        store.work = asyncio.get_running_loop().create_future()
        async with asyncio.timeout(10):
            return await rr.alongside(store.work)

    assert asyncio.run(main()) == "step done"
    assert store.late_attempts == 0
    assert all(not f.held for f in fakes)
    assert rr.env.actor.obj.runner.participant.state == "idle"


class StuckEnv(LocalActor):
    """An environment whose release (reopening admission) never answers."""

    def __getattr__(self, name):
        if name == "reopen":

            class Stuck:
                def remote(self, ckpt):
                    return asyncio.Event().wait()

            return Stuck()
        return super().__getattr__(name)


def test_a_cadence_that_cannot_stop_fails_the_step_with_a_named_reason(tmp_path):
    rr, _ = _rr(tmp_path, 1000, "rollout_recovery.target_level=turn",
                "checkpointing.save_data_plane=true",
                "rollout_checkpointing.attempt_timeout_s=0.2")  # fmt: skip
    rr.env = EnvironmentClient(StuckEnv(rr.env.actor.obj))
    rr.stop_grace_s = 0.3

    async def main():
        async with asyncio.timeout(10):
            return await rr.alongside(asyncio.sleep(0.1, "step done"))

    with pytest.raises(RunStalled) as err:
        asyncio.run(main())
    assert err.value.reason == "checkpoint_stuck"
    assert "run_stalled.checkpoint_stuck" in str(err.value) and "train --restore" in str(err.value)
