"""WorkerSupervisor: the controller notices a dead worker, replaces it, and tells the
environment, while the run goes on (docs/failover.md).

Every `failover.health_interval_s` each live worker is asked for its health (concurrently).
A worker is lost when
- its actor is gone (killed, its process or node died): `actor_dead`;
- its engine or HTTP server stopped: `engine_dead` / `http_server_stopped`;
- its health check fails or does not answer for `failover.unhealthy_after_s`: `health_timeout`.

A lost worker is marked in the pool (no fan-out reaches it) and in the environment (no new
call goes to it), then killed for good, so a hung one drops its connections and its calls
fail over at once. A replacement starts in its slot, is loaded with the current weights, and
joins between checkpoint attempts (never inside one, whose fences it would not hold). The
environment's own calls find a dead worker too, the moment a call to it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import ray

from rollout_recovery.config import FailoverConfig
from rollout_recovery.controller.metrics import RunMetrics
from rollout_recovery.errors import one_line
from rollout_recovery.generation.pool import WORKER_GONE, WorkerHandle, WorkerPool

log = logging.getLogger("rollout_recovery")
STOPPED_REASONS = ("engine_dead", "http_server_stopped", "not_started")


class WorkerSupervisor:
    def __init__(
        self,
        cfg: FailoverConfig,
        pool: WorkerPool,
        env,
        metrics: RunMetrics,
        between_checkpoints: asyncio.Lock,
        on_replaced: Callable[[], None] = lambda: None,
    ) -> None:
        self.cfg, self.pool, self.env, self.metrics = cfg, pool, env, metrics
        self.between_checkpoints = between_checkpoints
        self.on_replaced = on_replaced
        self._failing_since: dict[int, float] = {}
        self._replacing: dict[int, asyncio.Task] = {}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            await self.check_once()

    async def check_once(self) -> None:
        """One round: check every live worker, then start a replacement for each lost one."""
        live = self.pool.live()
        causes = await asyncio.gather(*(self._check(i, w) for i, w in live))
        for (i, _), cause in zip(live, causes, strict=True):
            if cause is not None:
                await self.lost(i, cause)
        for i in list(self.pool.lost):
            task = self._replacing.get(i)
            if task is None or task.done():
                self._replacing[i] = asyncio.ensure_future(self._replace(i))

    async def _check(self, index: int, worker: WorkerHandle) -> str | None:
        timeout = min(self.cfg.unhealthy_after_s, 10.0)
        try:
            async with asyncio.timeout(timeout):
                health = await worker.ahealth()
        except WORKER_GONE:
            return "actor_dead"
        except Exception:  # no answer: failing until unhealthy_after_s
            reason = "health_timeout"
        else:
            if health.healthy:
                self._failing_since.pop(index, None)
                return None
            reason = (health.reason or "unhealthy").split(":")[0]
            if reason in STOPPED_REASONS:
                return reason
            reason = "health_timeout"
        since = self._failing_since.setdefault(index, time.monotonic())
        return reason if time.monotonic() - since >= self.cfg.unhealthy_after_s else None

    async def lost(self, index: int, cause: str) -> None:
        """Mark worker `index` lost (pool, environment) and kill it."""
        self._failing_since.pop(index, None)
        if not self.pool.mark_lost(index, cause):
            return
        self.metrics.add(f"worker_failures.{cause}")
        log.warning("worker %d lost (%s): its calls move to live workers", index, cause)
        with contextlib.suppress(Exception):
            await self.env.worker_lost(index, cause)
        with contextlib.suppress(Exception):
            ray.kill(self.pool[index].actor)

    async def _replace(self, index: int) -> None:
        t0 = time.monotonic()
        try:
            handle = await self.pool.start_replacement(index)
            async with self.between_checkpoints:
                while not self.pool.join(index, handle, handle.weight_version):
                    weights_dir, version = self.pool.weights
                    await handle.apush_weights(weights_dir, version)
                    handle.weight_version = version
                await self.env.worker_replaced(index, handle)
        except Exception as err:  # counted; the next round tries again
            self.metrics.add("worker_replacement_failures")
            log.warning("replacing worker %d failed: %s", index, one_line(err))
            return
        self.metrics.add("workers_replaced")
        self.metrics.add("worker_replacement_s", time.monotonic() - t0)
        self.on_replaced()

    async def stop(self) -> None:
        for task in self._replacing.values():
            task.cancel()
        await asyncio.gather(*self._replacing.values(), return_exceptions=True)
