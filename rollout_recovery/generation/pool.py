"""WorkerPool: the one client of the GenerationWorker actors.

Every remote call to a worker is made here, so one import shows who drives the workers, and
a change to a worker's methods touches one file. `WorkerHandle` is one worker (its actor,
what it reported, the control token) with each call in a synchronous form and an `a`-prefixed
async form, as `StagingStore` has for its shards; `WorkerPool` fans a call out over every
worker (start, stop, fences, cuts by inventory, weight pushes, metrics, call records).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from rollout_recovery.config import RolloutRecoveryConfig, WorkerConfig
from rollout_recovery.generation.engine_setup import engine_env
from rollout_recovery.generation.worker import GenerationWorker, WorkerHealth, WorkerInfo
from rollout_recovery.protocol import CallReceipt, CutInventory
from rollout_recovery.runtime import actor_class


@dataclass
class WorkerHandle:
    """A started worker: its actor, what it reported, and its control routes' token."""

    actor: ray.actor.ActorHandle
    info: WorkerInfo
    control_token: str | None = None
    weight_version: int = 0  # what a replacement was loaded with before it joined

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

    def push_weights(self, weights_dir: str, weight_version: int, in_flight: bool = True) -> int:
        return self._get("push_weights", weights_dir, weight_version, in_flight)

    # ---------------------------------------------------------------- evidence and health

    async def acall_attempts(self, since: int = 0, limit: int | None = None) -> dict[str, Any]:
        return await self._ref("call_attempts", since, limit)

    def call_attempts(self, since: int = 0, limit: int | None = None) -> dict[str, Any]:
        """What the engine did per call attempt since cursor `since` (an `AttemptPage`)."""
        return self._get("call_attempts", since, limit)

    def capture_metrics(self) -> dict[str, float]:
        return self._get("capture_metrics")

    def lock_hold_samples(self) -> list[float]:
        return self._get("lock_hold_samples")

    def health(self, timeout: float | None = None) -> WorkerHealth:
        return self._get("health", timeout=timeout)

    async def ahealth(self) -> WorkerHealth:
        return await self._ref("health")

    def run_inside(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(worker, *args)` run inside the actor on its event loop's thread, for tests and
        benchmarks that inject faults or read internals (Ray's `__ray_call__`)."""
        return self._get("__ray_call__", fn, *args)


# What a worker actor raises once it is gone (killed, its node lost, its process dead).
WORKER_GONE = (ray.exceptions.RayActorError,)


@dataclass
class WorkerSpec:
    """What starting one more worker like the pool's others takes (a replacement)."""

    config: dict[str, Any]  # the WorkerConfig view, as sent to each worker
    store: Any
    startup_timeout_s: float
    control_token: str | None
    # Ray options of each worker slot (placement.py: its bundle, its node), added to
    # `worker_actor_options`; a replacement for slot i is placed like worker i was.
    slot_options: list[dict[str, Any]] = field(default_factory=list)


class WorkerPool:
    """The started workers of a run, in worker-index order.

    A worker found dead is marked `lost` (index -> cause) and skipped by every fan-out until
    `replace` puts a started worker, loaded with the current weights, in its place.
    """

    def __init__(self, workers: Sequence[WorkerHandle], spec: WorkerSpec | None = None) -> None:
        self.workers = list(workers)
        self.spec = spec
        self.lost: dict[int, str] = {}
        self.weights: tuple[str, int] | None = None  # the last pushed (directory, version)
        self.startup_s: float | None = None  # how long `start` waited for the engines
        self._lock = threading.Lock()  # weights and swaps: the caller's thread and the loop's

    def __getstate__(self) -> dict[str, Any]:
        """Sent to the environment actor as its own copy: without the lock."""
        return {k: v for k, v in vars(self).items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        self._lock = threading.Lock()

    @classmethod
    def start(
        cls,
        cfg: RolloutRecoveryConfig,
        num_workers: int | None = None,
        store=None,
        slot_options: Sequence[dict[str, Any]] | None = None,
    ) -> WorkerPool:
        """Start `num_workers` (default `vllm_cfg.num_workers`) workers concurrently.

        With token capture on, `store` (a StagingStore) receives the chunk and terminal rows,
        and a control token is minted for the run unless the config names one. A worker that
        fails to start takes every other one down with it. `slot_options[i]` (placement.py)
        are added to worker i's Ray options, and to those of any replacement for it.
        """
        n = cfg.vllm_cfg.num_workers if num_workers is None else num_workers
        if slot_options is not None and len(slot_options) != n:
            raise ValueError(f"slot_options has {len(slot_options)} entries, not {n} workers")
        if cfg.token_capture.enabled and not cfg.token_capture.control_auth_token:
            cfg = cfg.model_copy(deep=True)
            cfg.token_capture.control_auth_token = secrets.token_urlsafe(24)
        worker_cfg = cfg.worker_config()  # a worker receives only the blocks it reads
        spec = WorkerSpec(worker_cfg.model_dump(mode="json"), store,
                          cfg.vllm_cfg.startup_timeout_s,
                          cfg.token_capture.control_auth_token,
                          [dict(o) for o in slot_options or []])  # fmt: skip
        t0 = time.monotonic()
        actors = [_spawn(spec, i) for i in range(n)]
        try:
            infos = ray.get([a.start.remote() for a in actors], timeout=spec.startup_timeout_s)
        except BaseException:
            for a in actors:
                ray.kill(a)
            raise
        pairs = zip(actors, infos, strict=True)
        pool = cls([WorkerHandle(a, i, spec.control_token) for a, i in pairs], spec)
        pool.startup_s = time.monotonic() - t0
        return pool

    def reset(self, cfg: RolloutRecoveryConfig, store) -> list[dict[str, int]]:
        """Keep these engines for a restored job (controller/job.py): each worker aborts its
        requests, forgets its calls, serves `store` and the token log of `cfg` (the new
        controller's claim), and is back on the model's own weights as version 0. Every
        worker must be live and reset, or this raises and the caller starts new engines."""
        return self.end_reset(self.begin_reset(cfg, store))

    def begin_reset(self, cfg: RolloutRecoveryConfig, store) -> list[ray.ObjectRef]:
        """`reset` started: the workers reset while the caller starts other actors;
        `end_reset` waits for them."""
        if self.spec is None or self.lost or not self.workers:
            raise RuntimeError(f"cannot keep the engines: workers lost {sorted(self.lost)}")
        config = cfg.worker_config().model_dump(mode="json")
        config["token_capture"]["control_auth_token"] = self.spec.control_token
        fence = config["token_capture"].get("log_fence")
        self.spec.config, self.spec.store = config, store
        with self._lock:
            self.weights = None
            for w in self.workers:
                w.weight_version = 0
        return [w.actor.reset.remote(store, fence) for w in self.workers]

    def end_reset(self, refs: list[ray.ObjectRef]) -> list[dict[str, int]]:
        return ray.get(refs, timeout=self.spec.startup_timeout_s)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Graceful shutdown of every worker, then kill the actors (even if shutdown failed)."""
        if not self.workers:
            return
        live = self.live()
        refs = [w.actor.shutdown.remote() for _, w in live]
        try:
            ray.get(refs, timeout=timeout_s)
        except WORKER_GONE:
            pass  # one died meanwhile: the others were asked to shut down all the same
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

    # ---------------------------------------------------------------- failures

    def live(self) -> list[tuple[int, WorkerHandle]]:
        """(index, worker) of every worker not marked lost."""
        with self._lock:
            return [(i, w) for i, w in enumerate(self.workers) if i not in self.lost]

    def mark_lost(self, index: int, cause: str) -> bool:
        """Mark worker `index` lost; False if it already was."""
        with self._lock:
            if index in self.lost:
                return False
            self.lost[index] = cause
            return True

    async def start_replacement(self, index: int) -> WorkerHandle:
        """Kill lost worker `index` (for good: a hung one must drop its connections) and start a
        new worker for its slot, loaded with the current weights; `join` puts it in."""
        if self.spec is None:
            raise RuntimeError("this pool cannot start workers (no WorkerSpec)")
        with contextlib.suppress(Exception):
            ray.kill(self.workers[index].actor)
        actor = _spawn(self.spec, index)
        try:
            async with asyncio.timeout(self.spec.startup_timeout_s):
                info = await actor.start.remote()
            handle = WorkerHandle(actor, info, self.spec.control_token)
            if self.weights is not None:
                weights_dir, version = self.weights
                await handle.apush_weights(weights_dir, version)
                handle.weight_version = version
            return handle
        except BaseException:
            ray.kill(actor)
            raise

    def join(self, index: int, handle: WorkerHandle, weight_version: int) -> bool:
        """Put a started replacement (on `weight_version`) into slot `index`; False, leaving
        it out, when newer weights were pushed meanwhile (push them, then join again)."""
        with self._lock:
            if self.weights is not None and self.weights[1] != weight_version:
                return False
            self.workers[index] = handle
            self.lost.pop(index, None)
            return True

    async def _each(self, method: str, *args: Any) -> list[tuple[int, Any]]:
        """`method(*args)` on every live worker; a worker found gone is marked lost and left
        out, any other failure is returned in its place."""
        live = self.live()
        results = await asyncio.gather(
            *(getattr(w, method)(*args) for _, w in live), return_exceptions=True
        )
        out = []
        for (i, _), r in zip(live, results, strict=True):
            if isinstance(r, WORKER_GONE):
                self.mark_lost(i, "actor_dead")
                continue
            out.append((i, r))
        return out

    # ---------------------------------------------------------------- checkpoint protocol

    async def begin_fences(self, epoch: int, lease_s: float) -> list[dict[str, Any]]:
        """Fence every live worker (a dead one deletes nothing: it needs no fence); any other
        failure raises."""
        out = []
        for _, r in await self._each("abegin_fence", epoch, lease_s):
            if isinstance(r, BaseException):
                raise r
            out.append(r)
        return out

    async def end_fences(self, epoch: int) -> list[bool | BaseException]:
        """Release every fence; each worker's failure is returned in its place, not raised
        (a fence left held would stop terminal rows and chunk deletes until its lease ran
        out, so one failure must not skip the others)."""
        return [r for _, r in await self._each("aend_fence", epoch)]

    async def cut(self, inventories: dict[int, CutInventory]) -> list[dict[str, Any]]:
        """Cut each worker's inventory (by worker index) concurrently; the receipts. The calls
        of a worker that is lost or fails are `durable_failure` with reason
        `worker_unavailable` (they go on from their token log or from scratch)."""
        items = list(inventories.items())

        async def one(index: int, inv: CutInventory) -> dict[str, Any]:
            if index not in self.lost:
                try:
                    return await self.workers[index].acut(inv)
                except WORKER_GONE:
                    self.mark_lost(index, "actor_dead")
                except Exception:  # each call's receipt names the failure
                    pass
            calls = [CallReceipt(**ref.model_dump(), disposition="durable_failure",
                                 reason="worker_unavailable").model_dump()
                     for ref in inv.calls]  # fmt: skip
            return {"checkpoint_id": inv.checkpoint_id, "calls": calls}

        return list(await asyncio.gather(*(one(i, inv) for i, inv in items)))

    # ---------------------------------------------------------------- weights and evidence

    async def ahold_generation(self) -> int:
        """Stop decoding on every live worker, keeping the calls in flight (a preemption);
        returns the calls held. A worker gone meanwhile is marked lost and holds nothing."""
        with self._lock:
            live = [(i, w) for i, w in enumerate(self.workers) if i not in self.lost]
        answers = await asyncio.gather(*(w._ref("hold_generation") for _, w in live),
                                       return_exceptions=True)  # fmt: skip
        held = 0
        for (i, _), answer in zip(live, answers, strict=True):
            if isinstance(answer, WORKER_GONE):
                self.mark_lost(i, "actor_dead")
            elif isinstance(answer, BaseException):
                raise answer
            else:
                held += answer
        return held

    def push_weights(self, weights_dir: str, weight_version: int, in_flight: bool = True) -> None:
        """Load new weights into every live worker (into its calls in flight, or once they
        ended); a replacement being started gets them before it joins."""
        with self._lock:
            self.weights = (weights_dir, weight_version)
            live = [(i, w) for i, w in enumerate(self.workers) if i not in self.lost]
        refs = [w._ref("push_weights", weights_dir, weight_version, in_flight) for _, w in live]
        for (i, _), ref in zip(live, refs, strict=True):
            try:
                ray.get(ref)
            except WORKER_GONE:
                self.mark_lost(i, "actor_dead")

    def capture_metrics(self) -> list[dict[str, float]]:
        """Each live worker's tallies (a lost worker's counts went with it)."""
        return [m for _, m in self._gather_live("capture_metrics")]

    def call_attempts(self, cursors: dict[str, int]) -> dict[int, tuple[str, dict[str, Any]]]:
        """Each live worker's call-attempt records after its cursor: by worker index, (its
        actor name, the page). Cursors are by actor name: a replacement starts its own log."""

        def args(i: int) -> tuple:
            return cursors.get(self.workers[i].info.actor_name or str(i), 0), None

        pages = self._gather_live("call_attempts", args)
        return {i: (self.workers[i].info.actor_name or str(i), page) for i, page in pages}

    def _gather_live(self, method: str, args=lambda i: ()) -> list[tuple[int, Any]]:
        out = []
        live = self.live()
        refs = [w._ref(method, *args(i)) for i, w in live]
        for (i, _), ref in zip(live, refs, strict=True):
            try:
                out.append((i, ray.get(ref)))
            except WORKER_GONE:
                self.mark_lost(i, "actor_dead")
        return out

    def describe(self) -> list[dict[str, Any]]:
        """Where each worker serves (URL, pids, actor name); never the control token."""
        return [{"index": w.info.worker_index, "url": w.info.url, "pid": w.info.pid,
                 "engine_pids": w.info.engine_pids, "actor_name": w.info.actor_name,
                 "lost": self.lost.get(i)}
                for i, w in enumerate(self.workers)]  # fmt: skip


def _spawn(spec: WorkerSpec, index: int) -> ray.actor.ActorHandle:
    """A new worker actor (not started) for slot `index`, placed as the slot is (its
    `slot_options`), named so an operator (or a failover check) can find it:
    `rollout-worker-<pid>-<index>-<n>` in namespace `rollout_recovery`."""
    cfg = WorkerConfig.from_dict(spec.config)
    name = f"rollout-worker-{os.getpid()}-{index}-{next(_SPAWNED)}"
    slot = spec.slot_options[index] if index < len(spec.slot_options) else {}
    options = worker_actor_options(cfg) | slot | {"name": name, "namespace": ACTOR_NAMESPACE}
    return actor_class(GenerationWorker, **options).remote(spec.config, index, spec.store, name)


ACTOR_NAMESPACE = "rollout_recovery"
_SPAWNED = itertools.count()


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
