"""Starting the job behind a RolloutRecovery and stopping it again. Each part is set on the
facade as soon as it runs, so `close` after a failed start stops what did start; `close` stops
them in reverse and gives the placement back last, once its actors are gone (placement.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray

from rollout_recovery.config import RolloutRecoveryConfig
from rollout_recovery.controller import run_settings
from rollout_recovery.controller.coordinator import CheckpointCoordinator
from rollout_recovery.controller.evidence import EvidenceLog
from rollout_recovery.controller.selection import DATA_PLANE
from rollout_recovery.controller.supervisor import WorkerSupervisor
from rollout_recovery.data_plane import StagingStore
from rollout_recovery.data_plane.ownership import Fence, Owner
from rollout_recovery.environment.client import EnvironmentClient
from rollout_recovery.errors import RecoveryError, one_line
from rollout_recovery.generation.pool import WorkerPool
from rollout_recovery.placement import JobPlacement, place_job
from rollout_recovery.runtime import init_ray
from rollout_recovery.storage import RunStorage

if TYPE_CHECKING:  # the facade calls in; this module never imports it at load time
    from rollout_recovery.api import RolloutRecovery

log = logging.getLogger("rollout_recovery")


def claim_snapshot_root(storage: RunStorage) -> Owner:
    """Claim the run's snapshot root for this controller: from here on an older one that still
    runs cannot publish (data_plane/ownership.py)."""
    return StagingStore.claim(storage.child_uri(DATA_PLANE))


@dataclass
class Engines:
    """The workers of a job, where its actors run, and the store the workers first write to.
    When the controller is a Ray actor, the trainer's process starts them (`start_engines`)
    and hands them in: Ray ends an actor with its owner, and these then outlive the
    controller, so a restore after its death keeps them (run.py)."""

    placement: JobPlacement
    workers: WorkerPool
    store: StagingStore | None = None  # None: the job starts its own, the workers are reset

    def stop(self) -> None:
        """End the workers and the store at once (what they hold is in the run's location or
        not needed: a graceful stop is the controller's `close`), then give the placement
        back, once its actors are gone."""
        for worker in self.workers:
            with contextlib.suppress(Exception):
                ray.kill(worker.actor)
        self.drop_store()
        self.placement.remove()

    def drop_store(self) -> None:
        """End the store the workers wrote to (a restore starts a new one in its place)."""
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.shutdown()
            self.store = None


def job_config(
    cfg: RolloutRecoveryConfig, storage: RunStorage, owner: Owner
) -> tuple[RolloutRecoveryConfig, RunStorage]:
    """The config and the storage of `owner`'s job: every write under the run's location checks
    the claim first (storage.py), the workers' token log writes too."""
    fence = Fence.of(storage.child_uri(DATA_PLANE), owner)
    if cfg.token_capture.log_uri:
        cfg = cfg.model_copy(deep=True)
        cfg.token_capture.log_fence = fence
    return cfg, storage.fenced(fence)


def start_engines(cfg: RolloutRecoveryConfig) -> Engines:
    """Reserve the job's placement and start its store and workers (`cfg` from `job_config`);
    a failure gives back whatever did start."""
    placed = place_job(cfg)
    store = None
    try:
        place = cfg.placement
        store = StagingStore.create(num_shards=place.store.shards, num_cpus=place.store.num_cpus,
                                    shard_options=placed.store.options)  # fmt: skip
        workers = WorkerPool.start(cfg, store=store, slot_options=placed.workers.options)
    except BaseException:
        if store is not None:
            store.shutdown()
        placed.remove()
        raise
    return Engines(placed, workers, store)


def start_job(
    rr: RolloutRecovery, standalone_gateway: bool, engines: Engines | None = None
) -> None:
    """Start the store, workers and environment, the gateway (`gateway.enabled`, unless
    `standalone_gateway`: `serve_rollouts` starts it), the metrics and the supervision.
    `engines`: the store and workers started already (`start_engines`); without a store they
    are the workers of a job before, reset to serve this one (WorkerPool.reset) instead of new
    engines; where a reset fails they are stopped and new ones start."""
    cfg = rr.cfg
    actors = cfg.placement.environment.actors
    if standalone_gateway and actors > 1:  # refused before anything starts
        raise RecoveryError(
            f"the rollout gateway serves the episodes of one environment actor, and "
            f"placement.environment.actors={actors}; set placement.environment.actors=1"
        )
    if rr.owner is None:
        rr.owner = claim_snapshot_root(rr.storage)
    rr.cfg, rr.storage = job_config(rr.cfg, rr.storage, rr.owner)
    cfg = rr.cfg
    init_ray(rr.ray_address, log_to_driver=False)
    if engines is not None and engines.store is None:
        engines = _reset_engines(rr, engines)
    if engines is None:
        engines = start_engines(cfg)
    rr.placement, rr.store, rr.workers = engines.placement, engines.store, engines.workers
    if rr.env is None:
        rr.env = _start_environment(rr)
    rr.coordinator = CheckpointCoordinator(cfg.checkpoint_config(), rr.state, rr.store,
                                           rr.workers, rr.env, rr.storage, rr.metrics,
                                           rr.owner, run_settings.of(cfg))  # fmt: skip
    if cfg.gateway.enabled and not standalone_gateway:
        rr.gateway_token = secrets.token_urlsafe(24)
        rr.gateway_url = rr.env.start_gateway(rr.gateway_token)
        print(f"rollout gateway at {rr.gateway_url}/rollouts/<rollout_id>/v1", flush=True)
    rr.evidence = EvidenceLog(rr.storage, rr.workers)
    metrics_url = rr.metrics.serve(rr.counters, cfg.vllm_cfg.host)
    rr.evidence.write_workers(metrics_url)
    if cfg.failover.enabled:
        rr.supervisor = WorkerSupervisor(
            cfg.failover, rr.workers, rr.env, rr.metrics, rr.coordinator.between_attempts,
            on_replaced=lambda: rr.evidence.write_workers(metrics_url),
        )  # fmt: skip
        rr._supervision = asyncio.run_coroutine_threadsafe(rr.supervisor.run(), rr._loop.loop)


def _start_environment(rr: RolloutRecovery) -> EnvironmentClient:
    scratch = rr.storage.local_path("scratch")
    return EnvironmentClient.start(rr.cfg.environment_config(), rr.workers, rr.store,
                                   str(scratch) if scratch else None,
                                   count=rr.cfg.placement.environment.actors,
                                   actor_options=rr.placement.environment.options)  # fmt: skip


def _reset_engines(rr: RolloutRecovery, engines: Engines) -> Engines | None:
    """The engines of a job before, reset to serve `rr`'s (WorkerPool.reset), its store and
    environment actors starting beside the reset; or None, with what did start stopped and
    the engines ended, where they cannot be kept (a worker lost or dead): new ones start."""
    cfg, place = rr.cfg, rr.cfg.placement
    rr.placement, rr.workers = engines.placement, engines.workers
    store = rr.store = StagingStore.create(num_shards=place.store.shards,
                                           num_cpus=place.store.num_cpus,
                                           shard_options=engines.placement.store.options,
                                           wait=False)  # fmt: skip
    try:
        resetting = engines.workers.begin_reset(cfg, store)
        rr.env = _start_environment(rr)
        engines.workers.end_reset(resetting)
        store.ready()
    except Exception as err:
        log.warning("the engines could not be kept (%s): starting new ones", one_line(err))
        if rr.env is not None:
            with contextlib.suppress(Exception):
                rr.env.close(timeout_s=5)
        store.shutdown()
        engines.stop()
        rr.env, rr.store, rr.placement, rr.workers = None, None, None, WorkerPool([])
        return None
    engines.store, rr.engines_reset = store, True
    return engines


def close_job(rr: RolloutRecovery, keep_engines: bool = False) -> None:
    """Stop whatever `start_job` started, also after it failed part way; the supervisor's and
    the environment's errors are swallowed, so the rest still stops. `keep_engines`: the
    workers and the placement they run in are left running, for `start_job(kept=...)`."""
    if rr._supervision is not None:
        rr._supervision.cancel()
        with contextlib.suppress(Exception):
            rr._loop.run(rr.supervisor.stop(), timeout=10)
    if rr.stream is not None:  # its groups stop, then its cadence (after a snapshot under way)
        with contextlib.suppress(Exception):
            rr._loop.run(rr.stream.close(), timeout=rr.cfg.rollout_checkpointing.attempt_timeout_s
                         + 30)  # fmt: skip
        rr.stream = None
    rr.metrics.stop()
    if rr.env is not None:
        with contextlib.suppress(Exception):
            rr.env.close()
    rr._loop.stop()
    if not keep_engines:
        rr.workers.stop()
    if rr.store is not None:
        rr.store.shutdown()
    if rr.placement is not None and not keep_engines:  # after their actors are gone
        rr.placement.remove()
        rr.placement = None
    rr.store, rr.env = None, None
