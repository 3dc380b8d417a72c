"""RolloutRecovery: the rollout side of a run, built from one config. A training loop uses it
through TrainingRun (run.py), which adds the trainer's side: the claim, restore planning,
paired trainer checkpoints and the step log.

Data flow of a step (each arrow a call across processes):

    submit_groups -> EnvironmentClient.run_groups -> EpisodeRunner: ModelCallClient -> worker
        (finished episodes -> `replay` rows)
        watched meanwhile: EnvironmentClient.progress every liveness.check_interval_s
        (controller/liveness.py: no progress for liveness.stall_timeout_s -> RunStalled)
    every snapshot_attempt_interval_s, CheckpointCoordinator.attempt:
        fence      WorkerPool.begin_fences        (workers hold terminal rows, chunk deletes)
        prepare    EnvironmentClient.prepare      (admission closed at turn boundaries)
        cut        WorkerPool.cut(inventories)    (in-flight calls -> chained chunk rows)
        commit     EnvironmentClient.commit       (-> CheckpointRecords: episode records)
        snapshot   StagingStore.asnapshot         (data files, sidecars, the Ledger)
        publish    the manifest, written last     (PublishGate: an aborted attempt never)
        release    WorkerPool.end_fences + EnvironmentClient.reopen (also on failure)
    take_batch / ack -> StagingStore lease (`replay`) ; push_weights -> WorkerPool
    notify_trainer_checkpoint -> CheckpointCoordinator.counted("trainer_checkpoint")
    restore -> controller/restore.py: EnvironmentClient.begin_restore
        -> controller/selection.py (choose, verify, check the model) -> StagingStore.restore
        -> controller/token_log_restore.py (calls in flight extended; restores.jsonl)
        -> EnvironmentClient.end_restore(ledger.episodes)

`start` and `close` are controller/lifecycle.py. Where the store shards, the environment actors
and the workers run is `placement` (placement.py): reserved before they start, given back by
`close` once they are gone. As a Ray actor (`SingleController`) the controller gets its
placement, first store and workers from the caller's process, so they outlive it; `halt` and
`restart` build the job again around the same workers after a store shard or an environment
actor died (run.py `TrainingRun.keep_running`).

Every snapshot's ledger records the model identity, so a restore can refuse another model.
Snapshots are published as the controller's owner epoch (data_plane/ownership.py): once a newer
controller claimed the run's snapshot root, a checkpoint raises OwnerFenced and the run stops.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import ray

from rollout_recovery import components, faults, model_identity
from rollout_recovery.config import RolloutRecoveryConfig
from rollout_recovery.controller.coordinator import CheckpointCoordinator, RunState
from rollout_recovery.controller.evidence import EvidenceLog
from rollout_recovery.controller.gateway_serving import serve_gateway
from rollout_recovery.controller.lifecycle import (
    Engines,
    claim_snapshot_root,
    close_job,
    job_config,
    start_engines,
    start_job,
)
from rollout_recovery.controller.liveness import watch_step
from rollout_recovery.controller.metrics import RunMetrics
from rollout_recovery.controller.restore import restore_run, with_token_log_uri
from rollout_recovery.controller.stream import RolloutStream, StartedGroup
from rollout_recovery.controller.supervisor import WorkerSupervisor
from rollout_recovery.data_plane import LeaseResult, ReplayRow, StagingStore
from rollout_recovery.data_plane.errors import BadInputError
from rollout_recovery.data_plane.ownership import Owner
from rollout_recovery.environment.client import EnvironmentClient
from rollout_recovery.errors import (
    ComponentLost,
    RecoveryError,
    RestoreError,
    RunStalled,
    one_line,
)
from rollout_recovery.generation.pool import WorkerPool
from rollout_recovery.placement import JobPlacement
from rollout_recovery.protocol import EpisodeOutcome
from rollout_recovery.runtime import ActorProxy, LoopThread, init_ray
from rollout_recovery.storage import RunStorage

log = logging.getLogger("rollout_recovery")


@dataclass
class GroupResult:
    group_id: str
    rows: list[ReplayRow]
    rewards: list[float]
    generated_tokens: int
    results: list  # what each episode function returned (JSON values, kept with its row)

    @classmethod
    def of(cls, group_id: str, outcomes: list[EpisodeOutcome]) -> GroupResult:
        rows, decoded = [o.row for o in outcomes], sum(o.decoded_tokens for o in outcomes)
        return cls(group_id, rows, [r.reward for r in rows], decoded, [o.result for o in outcomes])


class RolloutRecovery:
    def __init__(
        self, cfg: RolloutRecoveryConfig, ray_address: str = "local", owner: Owner | None = None,
        engines: Engines | None = None,
    ) -> None:  # fmt: skip
        self.given_cfg = cfg  # as given: `restart` builds the job again from it
        self.engines = engines  # started by the caller (SingleController), or by `start`
        self.engines_reset = False  # `start` kept the engines of a job before (lifecycle.py)
        self.cfg, self.ray_address = with_token_log_uri(cfg), ray_address
        self.owner = owner  # the claim on the snapshot root; claimed in `start` when None
        self.model_dir = model_identity.resolve_model_path(cfg.policy.model_path)
        self.state = RunState(model_identity.base_model_identity(cfg.policy.model_path,
                                                                 self.model_dir))  # fmt: skip
        self.storage = RunStorage(cfg.checkpointing.checkpoint_dir)
        self.metrics = RunMetrics()
        self._loop = LoopThread("rollout-recovery")  # the caller's thread may run a loop
        self.store: StagingStore | None = None
        self.workers = WorkerPool([])
        self.env: EnvironmentClient | None = None
        self.coordinator: CheckpointCoordinator | None = None
        self.evidence: EvidenceLog | None = None
        self.gateway_url: str | None = None  # the rollout gateway, when gateway.enabled
        self.gateway_token: str | None = None
        self.supervisor: WorkerSupervisor | None = None  # failover.enabled
        self._supervision: Future | None = None
        self.placement: JobPlacement | None = None  # where the actors run (placement.py)
        self.stream: RolloutStream | None = None  # asynchronous GRPO's groups (start_groups)

    def start(self, standalone_gateway: bool = False) -> RolloutRecovery:
        """Start the store, workers and environment (and, with `gateway.enabled`, the gateway
        the episode functions use; `standalone_gateway`: `serve_rollouts` starts it later)."""
        engines, self.engines = self.engines, None  # handed over: the job's from here on
        start_job(self, standalone_gateway, engines)
        return self

    def take_over(self, owner: Owner, engines: Engines | None) -> None:
        """A standby controller (`Standby`) takes on the job of one that died: claimed as
        `owner`, on `engines`, then `start` as a new controller would."""
        self.owner, self.engines = owner, engines
        self.start()

    def close(self) -> None:
        close_job(self)

    def engines_kept(self) -> bool:
        """Whether this job runs on the engines of the job before, reset (`start_job`)."""
        return self.engines_reset

    def halt(self) -> None:
        """After the death of a store shard or the environment actor: end the other store
        shards and environment actors too, so a call still waiting on them (the `default`
        group's) fails now; `restart` follows once it did. Runs in the `control` group."""
        if self.store is not None:
            self.store.shutdown()
        for actor in self.env.actors if self.env else []:
            with contextlib.suppress(Exception):
                ray.kill(actor)

    def restart(self, owner: Owner) -> None:
        """Build the job again as `owner` (the restore's new claim) around the same engines: the
        store, the environment actors, the coordinator and the supervision are new, the
        workers are reset to a fresh start's state (WorkerPool.reset) instead of started again
        (minutes of weight loading on a GPU node). What the engines did stays on record: the
        evidence log goes on with the same cursors. The facade's state is made anew
        (`__init__`), as for a new controller. Then `restore` as after `start`."""
        kept, evidence = Engines(self.placement, self.workers), self.evidence
        close_job(self, keep_engines=True)
        self.__init__(self.given_cfg, self.ray_address, owner)
        try:
            start_job(self, standalone_gateway=False, engines=kept)
        except BaseException:
            kept.stop()
            raise
        if evidence is not None and self.evidence is not None:
            self.evidence.carry_on(evidence)

    def submit_groups(
        self, groups: list[tuple[str, dict]], seeds: Callable[[int, int], int]
    ) -> list[GroupResult]:
        """Run `grpo.generations_per_prompt` episodes of `environment.episode` per (group id,
        task) pair, concurrently, in the environment, checkpointing on the cadence meanwhile;
        each finished episode, scored by `environment.reward`, becomes a `replay` row.
        `seeds(group, gen)` gives each generation its own sampler seed. Episodes whose row is
        already stored are not run again, and episodes a restore brought back replay their
        journal."""
        n = self.cfg.grpo.generations_per_prompt
        table = [[seeds(gi, i) for i in range(n)] for gi in range(len(groups))]
        work = self.env.run_groups(groups, table, self.state.weight_version)
        watched = watch_step(work, self.env.progress, self.cfg.liveness, self.state.step)
        try:
            out = self._loop.run(self.coordinator.alongside(watched))
        except RunStalled as err:
            self.metrics.add(f"run_stalled.{err.reason}")
            raise
        return [GroupResult.of(gid, out[gi * n : (gi + 1) * n])
                for gi, (gid, _) in enumerate(groups)]  # fmt: skip

    # ------------------------------------------------------------------ asynchronous GRPO

    def start_groups(self, groups: list[StartedGroup]) -> dict[str, int]:
        """Start these groups now, without waiting for them (controller/stream.py): they
        generate while the caller trains, checkpointed on the cadence. Returns the stream's
        counts (groups in flight, finished and not taken)."""
        if self.stream is None:
            self.stream = RolloutStream(self.env, self.coordinator, self.state, self.cfg.liveness,
                                        self.metrics, GroupResult.of)  # fmt: skip
        self._loop.call(self.stream.start, groups)
        return self._loop.call(self.stream.counts)

    def finished_groups(self, n: int, timeout_s: float | None = None) -> list[GroupResult]:
        """The `n` started groups that finished first, oldest first (waiting for them); a
        group that failed, or a cadence that gave up, raises its error here."""
        if self.stream is None:
            raise BadInputError("no group was started: call start_groups first")
        return self._loop.run(self.stream.take(n, timeout_s))

    def take_groups(self, results: list[GroupResult], ttl_s: float = 600.0) -> LeaseResult:
        """Lease exactly these groups' rows for training (others stay in the buffer)."""
        keys = [row.key for r in results for row in r.rows]
        lease = self.store.lease_keys("replay", "trainer", keys, ttl_s)
        got = set(lease.rows.column("key").to_pylist())
        if got != set(keys):
            missing = sorted(set(keys) - got)
            raise RecoveryError(
                f"{len(missing)} rows of the finished groups could not be leased (e.g. "
                f"{missing[0]}): leased by another consumer, or not in the store; the run "
                "stops (continue it with `train --restore`)"
            )
        return lease

    def drop_groups(self, results: list[GroupResult], reason: str) -> int:
        """Consume these finished groups' rows untrained (counted as
        `async.groups_dropped_<reason>`); returns the rows dropped."""
        lease = self.take_groups(results, ttl_s=60.0)
        self.metrics.add(f"async.groups_dropped_{reason}", len(results))
        return self.store.ack(lease.lease_id)

    def buffered_groups(self) -> list[str]:
        """The groups with rows in the buffer (finished, not trained), by id."""
        return sorted({key.rsplit("/", 1)[0] for key in self.store.list("replay")})

    def take_batch(self, max_rows: int, ttl_s: float = 600.0) -> LeaseResult:
        return self.store.lease("replay", "trainer", max_rows, ttl_s)

    def ack(self, lease: LeaseResult) -> int:
        """The leased rows were trained on. With groups generating meanwhile (start_groups), the
        cadence takes no snapshot from now until the trainer checkpoint (CheckpointCoordinator.
        ack_held): one would pair the older checkpoint with a buffer that lacks these rows."""
        if self.stream is None:
            return self.store.ack(lease.lease_id)
        return self._loop.run(self.coordinator.ack_held(lambda: self.store.aack(lease.lease_id)))

    def set_step(self, step: int) -> None:
        """The trainer step whose rollouts are generated next (recorded in ledgers)."""
        self.state.step = step

    def counters(self) -> dict[str, float]:
        """The run's counts in one vocabulary (controller/metrics.py names them)."""
        tallies = self.workers.capture_metrics() if self.cfg.token_capture.enabled else None
        return self.metrics.collect(self.env.counters(), tallies)

    def preempt(self, timeout_s: float, step: int) -> dict:
        """A preemption (run.py calls it in the `control` group, beside the call the notice
        interrupted): hold generation on every worker, so nothing more is decoded, then one
        checkpoint attempt (`preemption`) within `timeout_s`, which at prefix level cuts every
        call where it was held; then the engines' records go to the evidence log (as trainer
        step `step`'s). Returns the attempt's metrics and `held`, or `failed` saying why."""
        t0 = time.monotonic()
        out: dict = {}
        try:
            if not faults.active("preemption_hold_disabled"):
                out["held"] = self._loop.run(self.workers.ahold_generation(), timeout_s)
            left = timeout_s - (time.monotonic() - t0)
            metrics = self._loop.run(self.coordinator.counted("preemption", left), left + 5.0)
        except Exception as err:  # reported: the run is ending either way
            return out | {"failed": one_line(err) or type(err).__name__}
        if metrics is None:
            return out | {"failed": "its checkpoint attempt failed (checkpoints.jsonl says why)"}
        self.record_call_attempts(step)
        return out | metrics

    def lost_components(self, timeout_s: float = 1.0) -> list[ComponentLost]:
        """The store shards and environment actors of this job that died (components.py); the
        trainer asks, in the `control` group, while a step's call waits."""
        actors = [("store shard", s) for s in self.store.shards] if self.store else []
        actors += [("environment actor", a) for a in self.env.actors] if self.env else []
        return components.dead(actors, timeout_s)

    def record_call_attempts(self, step: int) -> int:
        """Append what the engines did per call attempt to the run's evidence log."""
        return self.evidence.record_call_attempts(step) if self.cfg.token_capture.enabled else 0

    def push_weights(
        self, weights_dir: str | Path, version: int | None = None,
        expect_sha256: str | None = None, in_flight: bool = True,
    ) -> int:  # fmt: skip
        """Load new weights into every worker as the next weight version (or `version`, when
        a restore re-establishes a checkpoint's weights; `expect_sha256`: the digest those
        weights must have, or nothing is pushed): into the calls in flight, or (`in_flight`
        False) once they ended."""
        digest = model_identity.directory_weights_digest(weights_dir)
        if expect_sha256 is not None and digest != expect_sha256:
            raise RestoreError(
                f"the weights in {weights_dir} have digest {digest[:12]}, the snapshot expects "
                f"{expect_sha256[:12]}; refusing to push them"
            )
        version = self.state.weight_version + 1 if version is None else version
        self.workers.push_weights(str(weights_dir), version, in_flight)
        self.state.weight_version, self.state.weights_sha256 = version, digest
        return version

    def restore(self, snapshot: str | None = None, mode: str | None = None) -> dict | None:
        """Restore the store and the environment's episodes from `snapshot`, or from the newest
        usable one by `restore_mode`; the ledger as a dict (with `snapshot` and the newer
        `skipped` ones and why), or None when nothing was ever published."""
        return restore_run(self, snapshot, mode)

    def serve_rollouts(self, stop: threading.Event, token: str | None = None) -> dict | None:
        """A standalone gateway: rollouts opened, served and finished over HTTP by harnesses
        outside the job (docs/gateway.md), checkpointed on the cadence, until `stop` is set;
        then one last checkpoint keeps every open rollout. Its metrics, None if it failed."""
        return serve_gateway(self, stop, token)

    def notify_trainer_checkpoint(self, step: int, digest: str | None = None) -> dict:
        """After a trainer checkpoint of `step` (`digest`: its digest, recorded in this and
        every later snapshot's ledger until the next, so a restore pairs only that checkpoint
        with them): snapshot the data plane. A failed attempt counts like any other (returns
        `failed`); too many in a row raise. TrainingRun.save_checkpoint calls this."""
        self.state.step, self.state.trainer_checkpoint = step, digest
        if not self.cfg.checkpointing.save_data_plane:
            self.coordinator.release_hold()
            return {"snapshot_s": 0.0}
        metrics = self._loop.run(self.coordinator.counted("trainer_checkpoint"))
        if metrics is None:
            return {"snapshot_s": None, "failed": self.coordinator.failures_in_a_row}
        return {"snapshot_s": metrics["snapshot_s"], "snapshot": metrics["checkpoint"]}


# One call at a time, and beside it the `control` group: a preemption's final checkpoint and
# close run while the call its notice interrupted still holds the default group.
CONTROLLER_OPTIONS = {"num_cpus": 0, "max_concurrency": 1, "concurrency_groups": {"control": 1}}


def Standby(cfg: RolloutRecoveryConfig, ray_address: str = "local") -> ActorProxy:
    """A controller process started ahead and left idle, holding no job and claiming nothing:
    after the controller's death `SingleController` gives it the job, so the restore does not
    wait for a new process to start (`failover.standby_controller`). Returns at once; the
    process starts in the background."""
    return ActorProxy(RolloutRecovery, (cfg, ray_address), **CONTROLLER_OPTIONS)


def SingleController(
    cfg: RolloutRecoveryConfig, ray_address: str = "local", owner: Owner | None = None,
    engines: Engines | None = None, standby: ActorProxy | None = None,
) -> tuple[ActorProxy, Engines]:  # fmt: skip
    """The RolloutRecovery controller as a Ray actor, used through the same calls as the
    in-process object, and the engines it runs on. `owner` is the claim on the run's snapshot
    root (`train` claims before it restores); without one it is claimed here. The placement,
    the store and the workers are started here, in the caller's process, so that they outlive
    the controller (Ray ends an actor with its owner); `engines`: those of a controller that
    died, reset for this one instead (lifecycle.py). `standby`: a controller started ahead
    for `cfg` (`Standby`) takes the job; where it died meanwhile a new one starts."""
    if owner is None:  # claimed here, in the caller: its error is one line
        owner = claim_snapshot_root(RunStorage(cfg.checkpointing.checkpoint_dir))
    init_ray(ray_address, log_to_driver=False)
    if engines is None:
        storage = RunStorage(cfg.checkpointing.checkpoint_dir)
        job_cfg, _ = job_config(with_token_log_uri(cfg), storage, owner)
        engines = start_engines(job_cfg)
    try:
        if standby is not None and _took_over(standby, owner, engines):
            return standby, engines
        proxy = ActorProxy(RolloutRecovery, (cfg, ray_address, owner, engines), start="start",
                           **CONTROLLER_OPTIONS)  # fmt: skip
    except BaseException:
        engines.stop()
        raise
    return proxy, engines


def _took_over(standby: ActorProxy, owner: Owner, engines: Engines) -> bool:
    """Whether `standby` took the job; False where it had died (a new controller starts)."""
    try:
        standby.take_over(owner, engines)
    except ComponentLost as err:
        if err.component != "controller":
            raise
        log.warning("the standby controller had died (%s): starting a new one", err.reason)
        standby.kill()
        return False
    return True
