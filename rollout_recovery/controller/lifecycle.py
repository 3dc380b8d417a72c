"""Starting the job behind a RolloutRecovery and stopping it again. Each part is set on the
facade as soon as it runs, so `close` after a failed start stops what did start; `close` stops
them in reverse and gives the placement back last, once its actors are gone (placement.py)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from typing import TYPE_CHECKING

from rollout_recovery.controller.coordinator import CheckpointCoordinator
from rollout_recovery.controller.evidence import EvidenceLog
from rollout_recovery.controller.selection import DATA_PLANE
from rollout_recovery.controller.supervisor import WorkerSupervisor
from rollout_recovery.data_plane import StagingStore
from rollout_recovery.data_plane.ownership import Fence, Owner
from rollout_recovery.environment.client import EnvironmentClient
from rollout_recovery.errors import RecoveryError
from rollout_recovery.generation.pool import WorkerPool
from rollout_recovery.placement import place_job
from rollout_recovery.runtime import init_ray
from rollout_recovery.storage import RunStorage

if TYPE_CHECKING:  # the facade calls in; this module never imports it at load time
    from rollout_recovery.api import RolloutRecovery


def claim_snapshot_root(storage: RunStorage) -> Owner:
    """Claim the run's snapshot root for this controller: from here on an older one that still
    runs cannot publish (data_plane/ownership.py)."""
    return StagingStore.claim(storage.child_uri(DATA_PLANE))


def start_job(
    rr: RolloutRecovery, standalone_gateway: bool, kept: WorkerPool | None = None
) -> None:
    """Start the store, workers and environment, the gateway (`gateway.enabled`, unless
    `standalone_gateway`: `serve_rollouts` starts it), the metrics and the supervision.
    `kept`: the workers of the job before, reset to serve this one instead of new engines
    (`rr.placement` is then that job's, where they run)."""
    cfg = rr.cfg
    actors = cfg.placement.environment.actors
    if standalone_gateway and actors > 1:  # refused before anything starts
        raise RecoveryError(
            f"the rollout gateway serves the episodes of one environment actor, and "
            f"placement.environment.actors={actors}; set placement.environment.actors=1"
        )
    if rr.owner is None:
        rr.owner = claim_snapshot_root(rr.storage)
    # From here on every write under the run's location checks the claim first (storage.py).
    fence = Fence.of(rr.storage.child_uri(DATA_PLANE), rr.owner)
    rr.storage = rr.storage.fenced(fence)
    if cfg.token_capture.log_uri:
        cfg = rr.cfg = cfg.model_copy(deep=True)
        cfg.token_capture.log_fence = fence
    init_ray(rr.ray_address, log_to_driver=False)
    place = cfg.placement
    if kept is None:
        rr.placement = place_job(cfg)
    placed = rr.placement
    rr.store = StagingStore.create(num_shards=place.store.shards, num_cpus=place.store.num_cpus,
                                   shard_options=placed.store.options)  # fmt: skip
    if kept is None:
        rr.workers = WorkerPool.start(cfg, store=rr.store, slot_options=placed.workers.options)
    else:
        kept.reset(cfg, rr.store)
        rr.workers = kept
    scratch = rr.storage.local_path("scratch")
    rr.env = EnvironmentClient.start(cfg.environment_config(), rr.workers, rr.store,
                                     str(scratch) if scratch else None,
                                     count=place.environment.actors,
                                     actor_options=placed.environment.options)  # fmt: skip
    rr.coordinator = CheckpointCoordinator(cfg.checkpoint_config(), rr.state, rr.store,
                                           rr.workers, rr.env, rr.storage, rr.metrics,
                                           rr.owner)  # fmt: skip
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
