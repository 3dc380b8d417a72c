"""A checkpoint attempt releases the real workers' fences whatever the environment raises when
admission is reopened (not only the protocol error of a lapsed lease)."""

from __future__ import annotations

import asyncio

import pytest
import ray

from rollout_recovery.api import RolloutRecovery
from rollout_recovery.environment.rollout_env import RolloutEnvironmentActor

pytestmark = pytest.mark.engine


class EnvLostOnResume(RolloutEnvironmentActor):
    """Fault injection: the environment's release step fails with an arbitrary error."""

    def resume(self, ckpt: str) -> None:
        raise RuntimeError("environment lost its loop")


def test_fences_are_released_when_reopening_admission_fails(capture_worker, tiny_cfg, tmp_path):
    worker, store = capture_worker
    cfg = tiny_cfg.model_copy(deep=True)
    cfg.token_capture.enabled = True
    cfg.rollout_recovery.target_level = "prefix"
    cfg.checkpointing.save_data_plane = True
    cfg.checkpointing.checkpoint_dir = str(tmp_path / "run")
    rr = RolloutRecovery(cfg)
    rr.workers, rr.store = [worker], store
    rr.env = (
        ray.remote(EnvLostOnResume)
        .options(num_cpus=0, max_concurrency=4)
        .remote(cfg, [worker], store)
    )
    rr._epoch = iter(range(ray.get(worker.actor.fence_state.remote())["highest_epoch"] + 1, 10**6))
    try:
        metrics = asyncio.run(rr.checkpoint("cadence"))  # published; the release step failed
        assert metrics["checkpoint"].startswith(str(tmp_path / "run"))
        state = ray.get(worker.actor.fence_state.remote())
        assert not state["held"] and state["epoch"] is None
        assert rr.stats["release_errors"] == 1
    finally:
        ray.kill(rr.env)
