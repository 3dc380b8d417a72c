"""A checkpoint attempt releases the real workers' fences whatever the environment raises when
admission is reopened (not only the protocol error of a lapsed lease)."""

from __future__ import annotations

import asyncio

import pytest
import ray

from rollout_recovery.controller.coordinator import CheckpointCoordinator, RunState
from rollout_recovery.controller.metrics import RunMetrics
from rollout_recovery.environment.client import EnvironmentClient
from rollout_recovery.environment.rollout_env import RolloutEnvironment
from rollout_recovery.generation.pool import WorkerPool
from rollout_recovery.storage import RunStorage

pytestmark = pytest.mark.engine


class EnvLostOnResume(RolloutEnvironment):
    """Fault injection: the environment's release step fails with an arbitrary error."""

    def reopen(self, ckpt: str) -> None:
        raise RuntimeError("environment lost its loop")


def test_fences_are_released_when_reopening_admission_fails(capture_worker, tiny_cfg, tmp_path):
    worker, store = capture_worker
    cfg = tiny_cfg.model_copy(deep=True)
    cfg.token_capture.enabled = True
    cfg.rollout_recovery.target_level = "prefix"
    cfg.checkpointing.save_data_plane = True
    cfg.checkpointing.checkpoint_dir = str(tmp_path / "run")
    workers = WorkerPool([worker])
    env = EnvironmentClient(
        ray.remote(EnvLostOnResume)
        .options(num_cpus=0, max_concurrency=4)
        .remote(cfg, workers, store)
    )
    storage = RunStorage(cfg.checkpointing.checkpoint_dir)
    rr = CheckpointCoordinator(cfg, RunState(model={}), store, workers, env, storage, RunMetrics())
    rr.epochs = iter(range(worker.fence_state()["highest_epoch"] + 1, 10**6))
    try:
        metrics = asyncio.run(rr.attempt("cadence"))  # published; the release step failed
        assert metrics["checkpoint"].startswith(str(tmp_path / "run"))
        state = worker.fence_state()
        assert not state["held"] and state["epoch"] is None
        assert rr.metrics.controller["release_errors"] == 1
    finally:
        ray.kill(env.actor)
