"""EnvironmentClient: the one client of the rollout environment actors.

Every remote call to a `RolloutEnvironment` actor is made here. The calls a checkpoint or a
run waits on are async (the controller awaits them on its loop); restore and reporting calls
are synchronous.

A job runs `placement.environment.actors` environments; each owns the episodes whose rollout
id hashes to it (`protocol.environment_of`). The client fans every call out to all of them
and merges the answers, so its callers see one environment:

- `run_groups`: every actor gets all groups and seeds and runs its own episodes; the
  outcomes are put back in the order of one environment (group order, then index order);
- `prepare`, `commit`: concurrently on all; cut counts summed, episode records and
  continuations joined, swept rows summed;
- `end_restore`: each actor gets the records of its own rollouts; the unfinished counts are
  summed; `counters`: summed by name; `progress`: summed (controller/liveness.py);
- `reopen`, `begin_restore`, `worker_lost`, `worker_replaced`, `close`: on all, and a failure
  of one is raised only after every actor was called;
- `start_gateway`: one actor only (the gateway serves one environment's episodes).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Sequence
from typing import Any

import ray

from rollout_recovery.config import EnvironmentActorConfig
from rollout_recovery.environment.participant import ProtocolError
from rollout_recovery.environment.rollout_env import RolloutEnvironment
from rollout_recovery.errors import RecoveryError
from rollout_recovery.generation.pool import WorkerHandle, WorkerPool
from rollout_recovery.protocol import (
    CheckpointRecords,
    EnvironmentProgress,
    EpisodeOutcome,
    EpisodeRecord,
    environment_of,
    rollout_id,
)
from rollout_recovery.runtime import actor_class, remote_result


class EnvironmentClient:
    def __init__(self, *actors: Any) -> None:
        """The client of `actors`, actor i hosting environment i of `len(actors)`."""
        if not actors:
            raise ValueError("an EnvironmentClient needs at least one environment actor")
        self.actors = list(actors)

    @property
    def actor(self) -> Any:
        """The first (with one environment: the only) environment actor."""
        return self.actors[0]

    @classmethod
    def start(
        cls,
        cfg: EnvironmentActorConfig,
        workers: WorkerPool,
        store,
        scratch_root: str | None = None,
        max_concurrency: int = 16,
        count: int = 1,
        actor_options: Sequence[dict[str, Any]] | None = None,
    ) -> EnvironmentClient:
        """Host `count` `RolloutEnvironment`s as threaded actors and wait until they are
        constructed; `actor_options[i]` (placement.py) are added to actor i's Ray options."""
        if actor_options is not None and len(actor_options) != count:
            raise ValueError(f"actor_options has {len(actor_options)} entries, not {count}")
        actors = []
        try:
            for i in range(count):
                options = {"num_cpus": 0, "max_concurrency": max_concurrency}
                options |= dict(actor_options[i]) if actor_options is not None else {}
                actor = actor_class(RolloutEnvironment, **options)
                actors.append(actor.remote(cfg, workers, store, scratch_root, i, count))
            client = cls(*actors)
            client.counters()
        except BaseException:
            for actor in actors:
                ray.kill(actor)
            raise
        return client

    def __len__(self) -> int:
        return len(self.actors)

    # ---------------------------------------------------------------- fan-out

    def _refs(self, method: str, *args: Any) -> list:
        return [getattr(a, method).remote(*args) for a in self.actors]

    async def _all(self, awaitables: Sequence[Awaitable]) -> list:
        """Wait for every call; then raise the first failure (an error other than a protocol
        error first: a lapsed lease is the mild one), if any."""
        results = await asyncio.gather(*awaitables, return_exceptions=True)
        _raise_first(results)
        return results

    def _get_all(self, refs: list, timeout: float | None = None) -> list:
        """Wait for every call (all within `timeout`); then raise the first failure, if any."""
        deadline = None if timeout is None else time.monotonic() + timeout
        results = []
        for ref in refs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                results.append(ray.get(ref, timeout=left))
            except Exception as err:
                results.append(err)
        _raise_first(results)
        return results

    # ---------------------------------------------------------------- episodes

    async def run_groups(
        self, groups: list[tuple[str, dict]], seeds: list[list[int]], weight_version: int
    ) -> list[EpisodeOutcome]:
        # An episode's expected failure (a user code error, a dead worker) is raised as itself.
        if len(self.actors) == 1:
            return await remote_result(self.actor.run_groups.remote(groups, seeds, weight_version))
        refs = self._refs("run_groups", groups, seeds, weight_version)
        parts = await self._all([remote_result(ref) for ref in refs])
        # Each actor answered its own episodes in group order, then index order.
        answers = [iter(part) for part in parts]
        n = len(self.actors)
        return [next(answers[environment_of(rollout_id(gid, i), n)])
                for (gid, _), group_seeds in zip(groups, seeds, strict=True)
                for i in range(len(group_seeds))]  # fmt: skip

    def start_gateway(self, token: str, standalone_weight_version: int | None = None) -> str:
        if len(self.actors) != 1:
            raise RecoveryError(
                f"the rollout gateway serves the episodes of one environment actor, and this "
                f"job runs {len(self.actors)}; set placement.environment.actors=1"
            )
        return ray.get(self.actor.start_gateway.remote(token, standalone_weight_version))

    # ---------------------------------------------------------------- checkpoints

    async def prepare(self, ckpt: str, lease_s: float) -> dict:
        results = await self._all(self._refs("prepare", ckpt, lease_s))
        not_cut: Counter[str] = Counter()
        for r in results:
            not_cut.update(r["calls_not_cut"])
        return {"calls_cut": sum(r["calls_cut"] for r in results),
                "calls_not_cut": dict(not_cut)}  # fmt: skip

    async def commit(self, ckpt: str) -> CheckpointRecords:
        parts = await self._all(self._refs("commit", ckpt))
        if len(parts) == 1:
            return parts[0]
        out = CheckpointRecords()
        for part in parts:
            out.episodes.extend(part.episodes)
            out.continuations.update(part.continuations)
            out.chunk_rows_swept += part.chunk_rows_swept
        return out

    async def reopen(self, ckpt: str) -> None:
        await self._all(self._refs("reopen", ckpt))

    def begin_restore(self, restore_id: str) -> None:
        self._get_all(self._refs("begin_restore", restore_id))

    def end_restore(self, restore_id: str, records: list[EpisodeRecord], step: int = 1) -> int:
        """Each actor takes the records of its own rollouts, to go on as attempt + `step`; how
        many episodes are unfinished, over all actors."""
        n = len(self.actors)
        mine: list[list[EpisodeRecord]] = [[] for _ in range(n)]
        for rec in records:
            mine[environment_of(rec.rollout_id, n)].append(rec)
        pairs = zip(self.actors, mine, strict=True)
        refs = [actor.end_restore.remote(restore_id, recs, step) for actor, recs in pairs]
        return sum(self._get_all(refs))

    # ---------------------------------------------------------------- workers

    async def worker_lost(self, index: int, cause: str) -> None:
        await self._all(self._refs("worker_lost", index, cause))

    async def worker_replaced(self, index: int, handle: WorkerHandle) -> None:
        await self._all(self._refs("worker_replaced", index, handle))

    # ---------------------------------------------------------------- reporting, shutdown

    async def progress(self) -> EnvironmentProgress:
        """What every environment's episodes are doing now, as one."""
        return sum(await self._all(self._refs("progress")), EnvironmentProgress())

    def counters(self) -> dict[str, int]:
        total: Counter[str] = Counter()
        for counts in self._get_all(self._refs("counters")):
            total.update(counts)
        return dict(total)

    def close(self, timeout_s: float = 30.0) -> None:
        """Close every environment's clients, then kill the actors (even if closing failed)."""
        try:
            self._get_all(self._refs("close"), timeout=timeout_s)
        finally:
            for actor in self.actors:
                ray.kill(actor)


def _raise_first(results: list) -> None:
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise next((e for e in errors if not isinstance(e, ProtocolError)), errors[0])
