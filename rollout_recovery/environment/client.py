"""EnvironmentClient: the one client of the rollout environment actor.

Every remote call to the `RolloutEnvironment` actor is made here. The calls a checkpoint or a
run waits on are async (the controller awaits them on its loop); restore and reporting calls
are synchronous.
"""

from __future__ import annotations

from typing import Any

import ray

from rollout_recovery.config import EnvironmentActorConfig
from rollout_recovery.environment.rollout_env import RolloutEnvironment
from rollout_recovery.generation.pool import WorkerHandle, WorkerPool
from rollout_recovery.protocol import CheckpointRecords, EpisodeOutcome, EpisodeRecord
from rollout_recovery.runtime import actor_class


class EnvironmentClient:
    def __init__(self, actor: Any) -> None:
        self.actor = actor

    @classmethod
    def start(
        cls,
        cfg: EnvironmentActorConfig,
        workers: WorkerPool,
        store,
        scratch_root: str | None = None,
        max_concurrency: int = 16,
    ) -> EnvironmentClient:
        """Host a `RolloutEnvironment` as a threaded actor and wait until it is constructed."""
        options = {"num_cpus": 0, "max_concurrency": max_concurrency}
        actor = actor_class(RolloutEnvironment, **options)
        client = cls(actor.remote(cfg, workers, store, scratch_root))
        client.counters()
        return client

    async def run_groups(
        self, groups: list[tuple[str, dict]], seeds: list[list[int]], weight_version: int
    ) -> list[EpisodeOutcome]:
        return await self.actor.run_groups.remote(groups, seeds, weight_version)

    def start_gateway(self, token: str, standalone_weight_version: int | None = None) -> str:
        return ray.get(self.actor.start_gateway.remote(token, standalone_weight_version))

    async def prepare(self, ckpt: str, lease_s: float) -> dict:
        return await self.actor.prepare.remote(ckpt, lease_s)

    async def commit(self, ckpt: str) -> CheckpointRecords:
        return await self.actor.commit.remote(ckpt)

    async def resume(self, ckpt: str) -> None:
        await self.actor.resume.remote(ckpt)

    def begin_restore(self, restore_id: str) -> None:
        ray.get(self.actor.begin_restore.remote(restore_id))

    def end_restore(self, restore_id: str, records: list[EpisodeRecord]) -> int:
        return ray.get(self.actor.end_restore.remote(restore_id, records))

    async def worker_lost(self, index: int, cause: str) -> None:
        await self.actor.worker_lost.remote(index, cause)

    async def worker_replaced(self, index: int, handle: WorkerHandle) -> None:
        await self.actor.worker_replaced.remote(index, handle)

    def counters(self) -> dict[str, int]:
        return ray.get(self.actor.counters.remote())

    def close(self, timeout_s: float = 30.0) -> None:
        """Close the environment's clients, then kill the actor (even if closing failed)."""
        try:
            ray.get(self.actor.close.remote(), timeout=timeout_s)
        finally:
            ray.kill(self.actor)
