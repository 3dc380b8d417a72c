"""WorkerPool: the one client of the GenerationWorker actors.

Every remote call to a worker is made here, so one import shows who drives the workers, and
a change to a worker's methods touches one file. `WorkerHandle` is one worker (its actor,
what it reported, the control token) with each call in a synchronous form and an `a`-prefixed
async form, as `StagingStore` has for its shards; `WorkerPool` fans a call out over every
worker (start, stop, fences, cuts by inventory, weight pushes, metrics, call records).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from rollout_recovery.config import RolloutRecoveryConfig, WorkerConfig
from rollout_recovery.generation.engine_setup import engine_env
from rollout_recovery.generation.worker import GenerationWorker, WorkerHealth, WorkerInfo
from rollout_recovery.protocol import CutInventory
from rollout_recovery.runtime import actor_class


@dataclass
class WorkerHandle:
    """A started worker: its actor, what it reported, and its control routes' token."""

    actor: ray.actor.ActorHandle
    info: WorkerInfo
    control_token: str | None = None

    def _ref(self, method: str, *args: Any) -> ray.ObjectRef:
        return getattr(self.actor, method).remote(*args)

    def _get(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        return ray.get(self._ref(method, *args), timeout=timeout)

    # ---------------------------------------------------------------- checkpoint protocol

    async def acut(self, inventory: CutInventory | dict) -> dict[str, Any]:
        """Cut the listed in-flight calls into durable chunk rows; a `CutReceipt` as a dict."""
        return await self._ref("cut", _plain(inventory))

    def cut(self, inventory: CutInventory | dict, timeout: float | None = None) -> dict[str, Any]:
        return self._get("cut", _plain(inventory), timeout=timeout)

    async def abegin_fence(self, epoch: int, lease_s: float) -> dict[str, Any]:
        return await self._ref("begin_fence", epoch, lease_s)

    def begin_fence(self, epoch: int, lease_s: float) -> dict[str, Any]:
        return self._get("begin_fence", epoch, lease_s)

    async def aend_fence(self, epoch: int) -> bool:
        return await self._ref("end_fence", epoch)

    def end_fence(self, epoch: int) -> bool:
        return self._get("end_fence", epoch)

    def fence_state(self) -> dict[str, Any]:
        return self._get("fence_state")

    async def adrain(self) -> None:
        await self._ref("drain")

    def drain(self, timeout: float | None = None) -> None:
        """Wait until the worker's background terminal-row writes are done."""
        self._get("drain", timeout=timeout)

    # ---------------------------------------------------------------- weights

    async def apush_weights(self, weights_dir: str, weight_version: int) -> int:
        return await self._ref("push_weights", weights_dir, weight_version)

    def push_weights(self, weights_dir: str, weight_version: int) -> int:
        return self._get("push_weights", weights_dir, weight_version)

    # ---------------------------------------------------------------- evidence and health

    async def acall_attempts(self, since: int = 0, limit: int | None = None) -> dict[str, Any]:
        return await self._ref("call_attempts", since, limit)

    def call_attempts(self, since: int = 0, limit: int | None = None) -> dict[str, Any]:
        """What the engine did per call attempt since cursor `since` (an `AttemptPage`)."""
        return self._get("call_attempts", since, limit)

    async def acapture_metrics(self) -> dict[str, float]:
        return await self._ref("capture_metrics")

    def capture_metrics(self) -> dict[str, float]:
        return self._get("capture_metrics")

    def lock_hold_samples(self) -> list[float]:
        return self._get("lock_hold_samples")

    def health(self, timeout: float | None = None) -> WorkerHealth:
        return self._get("health", timeout=timeout)

    def run_inside(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(worker, *args)` run inside the actor on its event loop's thread, for tests and
        benchmarks that inject faults or read internals (Ray's `__ray_call__`)."""
        return self._get("__ray_call__", fn, *args)

    def refresh_info(self) -> WorkerInfo:
        """What the worker reports now (its engine pids may have changed)."""
        return self._get("info")


class WorkerPool:
    """The started workers of a run, in worker-index order."""

    def __init__(self, workers: Sequence[WorkerHandle]) -> None:
        self.workers = list(workers)

    @classmethod
    def start(
        cls, cfg: RolloutRecoveryConfig, num_workers: int | None = None, store=None
    ) -> WorkerPool:
        """Start `num_workers` (default `vllm_cfg.num_workers`) workers concurrently.

        With token capture on, `store` (a StagingStore) receives the chunk and terminal rows,
        and a control token is minted for the run unless the config names one. A worker that
        fails to start takes every other one down with it.
        """
        n = cfg.vllm_cfg.num_workers if num_workers is None else num_workers
        if cfg.token_capture.enabled and not cfg.token_capture.control_auth_token:
            cfg = cfg.model_copy(deep=True)
            cfg.token_capture.control_auth_token = secrets.token_urlsafe(24)
        worker_cfg = cfg.worker_config()  # a worker receives only the blocks it reads
        actor_cls = actor_class(GenerationWorker, **worker_actor_options(worker_cfg))
        config = worker_cfg.model_dump(mode="json")
        actors = [actor_cls.remote(config, i, store) for i in range(n)]
        try:
            infos = ray.get(
                [a.start.remote() for a in actors], timeout=cfg.vllm_cfg.startup_timeout_s
            )
        except BaseException:
            for a in actors:
                ray.kill(a)
            raise
        token = cfg.token_capture.control_auth_token
        return cls([WorkerHandle(a, i, token) for a, i in zip(actors, infos, strict=True)])

    def stop(self, timeout_s: float = 60.0) -> None:
        """Graceful shutdown of every worker, then kill the actors (even if shutdown failed)."""
        if not self.workers:
            return
        refs = [w.actor.shutdown.remote() for w in self.workers]
        try:
            ray.get(refs, timeout=timeout_s)
        finally:
            for w in self.workers:
                ray.kill(w.actor)
            self.workers = []

    def __len__(self) -> int:
        return len(self.workers)

    def __getitem__(self, index: int) -> WorkerHandle:
        return self.workers[index]

    def __iter__(self) -> Iterator[WorkerHandle]:
        return iter(self.workers)

    @property
    def urls(self) -> list[str]:
        return [w.info.url for w in self.workers]

    # ---------------------------------------------------------------- checkpoint protocol

    async def begin_fences(self, epoch: int, lease_s: float) -> list[dict[str, Any]]:
        return await asyncio.gather(*(w.abegin_fence(epoch, lease_s) for w in self.workers))

    async def end_fences(self, epoch: int) -> list[bool | BaseException]:
        """Release every fence; each worker's failure is returned in its place, not raised
        (a fence left held would stop terminal rows and chunk deletes until its lease ran
        out, so one failure must not skip the others)."""
        steps = (w.aend_fence(epoch) for w in self.workers)
        return await asyncio.gather(*steps, return_exceptions=True)

    async def cut(self, inventories: dict[int, CutInventory]) -> list[dict[str, Any]]:
        """Cut each worker's inventory (by worker index) concurrently; the receipts."""
        return await asyncio.gather(*(self.workers[i].acut(inv) for i, inv in inventories.items()))

    # ---------------------------------------------------------------- weights and evidence

    def push_weights(self, weights_dir: str, weight_version: int) -> None:
        ray.get([w._ref("push_weights", weights_dir, weight_version) for w in self.workers])

    def capture_metrics(self) -> list[dict[str, float]]:
        return ray.get([w._ref("capture_metrics") for w in self.workers])

    def call_attempts(self, cursors: Sequence[int]) -> list[dict[str, Any]]:
        """Each worker's call-attempt records after its cursor."""
        pairs = zip(self.workers, cursors, strict=True)
        return ray.get([w._ref("call_attempts", c, None) for w, c in pairs])

    def describe(self) -> list[dict[str, Any]]:
        """Where each worker serves (URL, pids); never the control token."""
        return [{"index": w.info.worker_index, "url": w.info.url, "pid": w.info.pid,
                 "engine_pids": w.info.engine_pids} for w in self.workers]  # fmt: skip


def worker_actor_options(cfg: WorkerConfig) -> dict[str, Any]:
    """Ray options for a GenerationWorker: resources, no restarts, and the engine environment."""
    return {
        "num_cpus": cfg.vllm_cfg.worker_num_cpus,
        "num_gpus": 1 if cfg.vllm_cfg.device == "cuda" else 0,
        "max_restarts": 0,
        "resources": dict(cfg.vllm_cfg.worker_resources),
        "runtime_env": {"env_vars": engine_env(cfg)},
    }


def _plain(inventory: CutInventory | dict) -> dict[str, Any]:
    return inventory.model_dump() if isinstance(inventory, CutInventory) else inventory
