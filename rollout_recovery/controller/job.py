"""The job behind a RolloutRecovery: one value with one lifetime.

`build_job` starts every part (placement, workers and their first store, or the engines of a job
before reset to serve this one; the environment actors, the checkpoint coordinator, the gateway,
the metrics, the evidence log, the supervision) and hands back a `Job`; a failure part way stops
what did start, in reverse. `Job.close` stops it once, in reverse, and gives the placement back
last, once its actors are gone (placement.py). "Rebuild around kept engines" is
`Job.close(keep_engines=True)` returning the `Engines`, and `build_job(..., engines=those)`.
Nothing outside this module assigns a job's fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import ray

from rollout_recovery import components, model_identity
from rollout_recovery.config import RolloutRecoveryConfig
from rollout_recovery.controller import run_settings
from rollout_recovery.controller.coordinator import CheckpointCoordinator, RunState
from rollout_recovery.controller.evidence import EvidenceLog
from rollout_recovery.controller.metrics import RunMetrics
from rollout_recovery.controller.restore import with_token_log_uri
from rollout_recovery.controller.selection import DATA_PLANE
from rollout_recovery.controller.stream import RolloutStream
from rollout_recovery.controller.supervisor import WorkerSupervisor
from rollout_recovery.data_plane import StagingStore
from rollout_recovery.data_plane.ownership import Fence, Owner
from rollout_recovery.environment.client import EnvironmentClient
from rollout_recovery.errors import ComponentLost, RecoveryError, one_line
from rollout_recovery.generation.pool import WorkerPool
from rollout_recovery.healing import Action, Circumstances, Fault, Phase, decide
from rollout_recovery.placement import JobPlacement, place_job
from rollout_recovery.runtime import LoopThread, init_ray
from rollout_recovery.storage import RunStorage

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
        not needed: a graceful stop is `Job.close`), then give the placement back, once its
        actors are gone."""
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


@dataclass(frozen=True)
class Gateway:
    """Where the rollout gateway listens and the token its callers present."""

    url: str
    token: str


@dataclass
class Supervision:
    """The worker supervisor (failover.enabled) and its task on the job's loop."""

    supervisor: WorkerSupervisor
    task: Future

    def stop(self, loop: LoopThread) -> None:
        self.task.cancel()
        with contextlib.suppress(Exception):
            loop.run(self.supervisor.stop(), timeout=10)


@dataclass
class Job:
    """Every part of one started job. `state` is what its ledgers stamp, `metrics` its counts,
    `loop` the private asyncio loop its async parts run on."""

    cfg: RolloutRecoveryConfig  # the job's: fenced by `owner` (job_config)
    storage: RunStorage  # fenced by `owner`
    owner: Owner
    state: RunState
    metrics: RunMetrics
    loop: LoopThread
    placement: JobPlacement
    store: StagingStore
    workers: WorkerPool
    env: EnvironmentClient
    coordinator: CheckpointCoordinator
    evidence: EvidenceLog
    engines_kept: bool = False  # runs on the engines of a job before, reset
    supervision: Supervision | None = None
    gateway: Gateway | None = None
    stream: RolloutStream | None = None  # asynchronous GRPO's groups, once one started

    def open_stream(self, result_of: Callable) -> RolloutStream:
        """The job's stream of started groups (controller/stream.py), made on first use."""
        if self.stream is None:
            self.stream = RolloutStream(self.env, self.coordinator, self.state,
                                        self.cfg.liveness, self.metrics, result_of)  # fmt: skip
        return self.stream

    def start_gateway(self, token: str | None = None) -> Gateway:
        """Serve the rollout gateway from the environment (`token`: the one callers present,
        else a new one)."""
        token = token or secrets.token_urlsafe(24)
        self.gateway = Gateway(self.env.start_gateway(token, self.state.weight_version), token)
        return self.gateway

    def renew_environment(self, cfg: RolloutRecoveryConfig | None = None) -> None:
        """A fresh environment actor (with `cfg`'s environment blocks, else the job's) in place
        of the current one, whose HTTP connections close so the engines abort every call it
        had in flight (benchmarks start rounds clean)."""
        with contextlib.suppress(Exception):
            self.env.close()
        self.env = _start_environment(cfg or self.cfg, self.storage, self.placement,
                                      self.workers, self.store)  # fmt: skip
        self.coordinator.use_environment(self.env)

    def counters(self) -> dict[str, float]:
        return _counters(self.cfg, self.workers, self.env, self.metrics)

    def lost_components(self, timeout_s: float) -> list[ComponentLost]:
        """The store shards and environment actors of this job that died (components.py)."""
        actors = [("store shard", s) for s in self.store.shards]
        actors += [("environment actor", a) for a in self.env.actors]
        return components.dead(actors, timeout_s)

    def halt(self) -> None:
        """End the store shards and environment actors, so a call still waiting on them fails
        now; a `close(keep_engines=True)` and a new build follow."""
        self.store.shutdown()
        for actor in self.env.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)

    def close(self, keep_engines: bool = False) -> Engines | None:
        """Stop every part in reverse; the supervisor's, the stream's and the environment's
        errors are swallowed, so the rest still stops. `keep_engines`: the workers and their
        placement stay running and are returned, for `build_job(engines=...)`."""
        if self.supervision is not None:
            self.supervision.stop(self.loop)
        if self.stream is not None:  # its groups stop, then its cadence (after a snapshot)
            with contextlib.suppress(Exception):
                self.loop.run(
                    self.stream.close(),
                    timeout=self.cfg.rollout_checkpointing.attempt_timeout_s + 30,
                )
        self.metrics.stop()
        with contextlib.suppress(Exception):
            self.env.close()
        self.loop.stop()
        if not keep_engines:
            self.workers.stop()
        self.store.shutdown()
        if keep_engines:
            return Engines(self.placement, self.workers)
        self.placement.remove()  # after its actors are gone
        return None


def build_job(
    given: RolloutRecoveryConfig, ray_address: str, owner: Owner | None,
    standalone_gateway: bool = False, engines: Engines | None = None,
) -> Job:  # fmt: skip
    """Start a job for `given` as `owner` (claimed here when None): the store, workers and
    environment, the gateway (`gateway.enabled`, unless `standalone_gateway`: the caller starts
    it with `Job.start_gateway`), the metrics and the supervision. `engines`: the store and
    workers started already (`start_engines`); without a store they are the workers of a job
    before, reset to serve this one (WorkerPool.reset) instead of new engines; where a reset
    fails they are stopped and new ones start. A failure stops whatever did start."""
    actors = given.placement.environment.actors
    if standalone_gateway and actors > 1:  # refused before anything starts
        raise RecoveryError(
            f"the rollout gateway serves the episodes of one environment actor, and "
            f"placement.environment.actors={actors}; set placement.environment.actors=1"
        )
    storage = RunStorage(given.checkpointing.checkpoint_dir)
    if owner is None:
        owner = claim_snapshot_root(storage)
    cfg, storage = job_config(with_token_log_uri(given), storage, owner)
    init_ray(ray_address, log_to_driver=False)
    model_dir = model_identity.resolve_model_path(cfg.policy.model_path)
    state = RunState(model_identity.base_model_identity(cfg.policy.model_path, model_dir))
    metrics, loop = RunMetrics(), LoopThread("rollout-recovery")
    with contextlib.ExitStack() as undo:
        undo.callback(loop.stop)
        env, kept = None, False
        if engines is not None and engines.store is None:
            engines, env = _reset_engines(cfg, storage, engines)
            kept = engines is not None
        if engines is None:
            engines = start_engines(cfg)
        undo.callback(engines.stop)
        if env is None:
            env = _start_environment(cfg, storage, engines.placement, engines.workers,
                                     engines.store)  # fmt: skip
        undo.callback(_quietly, env.close)
        coordinator = CheckpointCoordinator(cfg.checkpoint_config(), state, engines.store,
                                            engines.workers, env, storage, metrics, owner,
                                            run_settings.of(cfg))  # fmt: skip
        gateway = None
        if cfg.gateway.enabled and not standalone_gateway:
            token = secrets.token_urlsafe(24)
            gateway = Gateway(env.start_gateway(token), token)
            print(f"rollout gateway at {gateway.url}/rollouts/<rollout_id>/v1", flush=True)
        evidence = EvidenceLog(storage, engines.workers)
        counters = functools.partial(_counters, cfg, engines.workers, env, metrics)
        metrics_url = metrics.serve(counters, cfg.vllm_cfg.host)
        undo.callback(metrics.stop)
        evidence.write_workers(metrics_url)
        supervision = None
        seen = Circumstances(failover=cfg.failover.enabled, seen="job")
        if decide(Fault.WORKER, Phase.RUNNING, seen) is Action.MOVE_CALLS:  # healing.py
            supervisor = WorkerSupervisor(
                cfg.failover, engines.workers, env, metrics, coordinator.between_attempts,
                on_replaced=lambda: evidence.write_workers(metrics_url),
            )  # fmt: skip
            task = asyncio.run_coroutine_threadsafe(supervisor.run(), loop.loop)
            supervision = Supervision(supervisor, task)
        undo.pop_all()
    return Job(cfg, storage, owner, state, metrics, loop, engines.placement, engines.store,
               engines.workers, env, coordinator, evidence, kept, supervision,
               gateway)  # fmt: skip


def _counters(cfg: RolloutRecoveryConfig, workers: WorkerPool, env: EnvironmentClient,
              metrics: RunMetrics) -> dict[str, float]:  # fmt: skip
    """The job's counts in one vocabulary (controller/metrics.py names them)."""
    tallies = workers.capture_metrics() if cfg.token_capture.enabled else None
    return metrics.collect(env.counters(), tallies)


def _quietly(close: Callable[[], object]) -> None:
    with contextlib.suppress(Exception):
        close()


def _start_environment(
    cfg: RolloutRecoveryConfig, storage: RunStorage, placement: JobPlacement,
    workers: WorkerPool, store: StagingStore,
) -> EnvironmentClient:  # fmt: skip
    scratch = storage.local_path("scratch")
    return EnvironmentClient.start(cfg.environment_config(), workers, store,
                                   str(scratch) if scratch else None,
                                   count=cfg.placement.environment.actors,
                                   actor_options=placement.environment.options)  # fmt: skip


def _reset_engines(
    cfg: RolloutRecoveryConfig, storage: RunStorage, engines: Engines
) -> tuple[Engines | None, EnvironmentClient | None]:
    """The engines of a job before, reset to serve this one (WorkerPool.reset), with the new
    store and the environment actors started beside the reset; or (None, None), with what did
    start stopped and the engines ended, where they cannot be kept (a worker lost or dead):
    new ones start."""
    place = cfg.placement
    store = StagingStore.create(num_shards=place.store.shards, num_cpus=place.store.num_cpus,
                                shard_options=engines.placement.store.options,
                                wait=False)  # fmt: skip
    env = None
    try:
        resetting = engines.workers.begin_reset(cfg, store)
        env = _start_environment(cfg, storage, engines.placement, engines.workers, store)
        engines.workers.end_reset(resetting)
        store.ready()
    except Exception as err:
        log.warning("the engines could not be kept (%s): starting new ones", one_line(err))
        if env is not None:
            with contextlib.suppress(Exception):
                env.close(timeout_s=5)
        store.shutdown()
        engines.stop()
        return None, None
    return Engines(engines.placement, engines.workers, store), env
