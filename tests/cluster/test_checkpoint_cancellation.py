"""A checkpoint attempt cancelled part-way (the cadence is cancelled when generation ends)
still ends its checkpoint: admission reopens and the fences lift before the cancellation
goes on, so the next attempt succeeds. Real coordinator, store and environment actor; no
engines."""

from __future__ import annotations

import asyncio

import pytest

from rollout_recovery.data_plane import StagingStore

pytestmark = pytest.mark.cluster


async def test_an_attempt_cancelled_while_releasing_still_reopens_admission(make_store, tmp_path):
    from rollout_recovery.config import load_config
    from rollout_recovery.controller.coordinator import CheckpointCoordinator, RunState
    from rollout_recovery.controller.metrics import RunMetrics
    from rollout_recovery.controller.selection import DATA_PLANE
    from rollout_recovery.environment.client import EnvironmentClient
    from rollout_recovery.generation.pool import WorkerPool
    from rollout_recovery.storage import RunStorage

    cfg = load_config(None, [f"checkpointing.checkpoint_dir={tmp_path / 'run'}"])
    storage = RunStorage(cfg.checkpointing.checkpoint_dir)
    store = make_store(1)
    env = EnvironmentClient.start(cfg.environment_config(), WorkerPool([]), store)
    try:
        owner = StagingStore.claim(storage.child_uri(DATA_PLANE))
        coordinator = CheckpointCoordinator(
            cfg.checkpoint_config(), RunState({"path": "tiny://default"}), store,
            WorkerPool([]), env, storage, RunMetrics(), owner,
        )  # fmt: skip
        entered, go = asyncio.Event(), asyncio.Event()
        real_resume = env.resume

        async def held_resume(ckpt: str) -> None:
            entered.set()
            await go.wait()
            await real_resume(ckpt)

        env.resume = held_resume
        attempt = asyncio.ensure_future(coordinator.attempt("cadence"))
        await asyncio.wait_for(entered.wait(), 60)  # the snapshot is published; releasing
        attempt.cancel()
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await attempt
        env.resume = real_resume
        after = await coordinator.counted("trainer_checkpoint")
        assert after is not None, storage.read_lines("checkpoints.jsonl")[-1:]
        assert coordinator.failures_in_a_row == 0
    finally:
        env.close()
