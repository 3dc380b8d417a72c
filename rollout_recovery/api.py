"""RolloutRecovery: the calls a trainer makes, built from one config. The shipped GRPO driver
uses only this.

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
        release    WorkerPool.end_fences + EnvironmentClient.resume (also on failure)
    take_batch / ack -> StagingStore lease (`replay`) ; push_weights -> WorkerPool
    notify_trainer_checkpoint -> CheckpointCoordinator.counted("trainer_checkpoint")
    restore -> controller.selection (choose, verify, check the model) -> StagingStore.restore
        -> EnvironmentClient.end_restore(ledger.episodes)

Where the store shards, the environment actors and the workers run is `placement`
(placement.py): reserved before they start, given back by `close` once they are gone.

Every snapshot's ledger records the model identity, so a restore can refuse another model.
Snapshots are published as the controller's owner epoch (data_plane/ownership.py): once a newer
controller claimed the run's snapshot root, a checkpoint raises OwnerFenced and the run stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rollout_recovery.config import RolloutRecoveryConfig
from rollout_recovery.controller.coordinator import CheckpointCoordinator, RunState
from rollout_recovery.controller.evidence import EvidenceLog
from rollout_recovery.controller.journal_restore import extend_from_journal
from rollout_recovery.controller.liveness import watch_step
from rollout_recovery.controller.metrics import RunMetrics
from rollout_recovery.controller.selection import DATA_PLANE, restore_snapshot
from rollout_recovery.controller.supervisor import WorkerSupervisor
from rollout_recovery.data_plane import LeaseResult, ReplayRow, StagingStore
from rollout_recovery.data_plane.ownership import Owner
from rollout_recovery.environment.client import EnvironmentClient
from rollout_recovery.errors import RecoveryError, RestoreError, RunStalled
from rollout_recovery.generation.pool import WorkerPool
from rollout_recovery.model_identity import (
    base_model_identity,
    directory_weights_digest,
    resolve_model_path,
)
from rollout_recovery.placement import JobPlacement, place_job
from rollout_recovery.runtime import ActorProxy, LoopThread, init_ray
from rollout_recovery.storage import RunStorage

JOURNAL_DIR = "journal"  # journal segments under the checkpoint dir (data_plane/journal_log.py)
RESTORES_LOG = "restores.jsonl"  # per restore: what each call took from the journal


@dataclass
class GroupResult:
    group_id: str
    rows: list[ReplayRow]
    rewards: list[float]
    generated_tokens: int
    results: list  # what each episode function returned (None: finished before a restore)


class RolloutRecovery:
    def __init__(
        self, cfg: RolloutRecoveryConfig, ray_address: str = "local", owner: Owner | None = None
    ) -> None:
        tc = cfg.token_capture
        journal_on = tc.journal_interval_tokens is not None or tc.journal_interval_s is not None
        if journal_on and tc.journal_storage and cfg.checkpointing.save_data_plane:
            cfg = cfg.model_copy(deep=True)  # the workers append segments there
            run_storage = RunStorage(cfg.checkpointing.checkpoint_dir)
            cfg.token_capture.journal_uri = run_storage.child_uri(JOURNAL_DIR)
        self.cfg, self.ray_address = cfg, ray_address
        self.owner = owner  # the claim on the snapshot root; claimed in `start` when None
        self.model_dir = resolve_model_path(cfg.policy.model_path)
        self.state = RunState(base_model_identity(cfg.policy.model_path, self.model_dir))
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
        self._supervision = None
        self.placement: JobPlacement | None = None  # where the actors run (placement.py)

    def start(self, standalone_gateway: bool = False) -> RolloutRecovery:
        """Start the store, workers and environment (and, with `gateway.enabled`, the gateway
        the episode functions use; `standalone_gateway`: `serve_rollouts` starts it later)."""
        actors = self.cfg.placement.environment.actors
        if standalone_gateway and actors > 1:  # refused before anything starts
            raise RecoveryError(
                f"the rollout gateway serves the episodes of one environment actor, and "
                f"placement.environment.actors={actors}; set placement.environment.actors=1"
            )
        if self.owner is None:
            self.owner = StagingStore.claim(self.storage.child_uri(DATA_PLANE))
        init_ray(self.ray_address, log_to_driver=False)
        place = self.cfg.placement
        self.placement = placed = place_job(self.cfg)
        self.store = StagingStore.create(num_shards=place.store.shards,
                                         num_cpus=place.store.num_cpus,
                                         shard_options=placed.store.options)  # fmt: skip
        self.workers = WorkerPool.start(self.cfg, store=self.store,
                                        slot_options=placed.workers.options)  # fmt: skip
        env_cfg, ckpt_cfg = self.cfg.environment_config(), self.cfg.checkpoint_config()
        scratch = self.storage.local_path("scratch")
        self.env = EnvironmentClient.start(env_cfg, self.workers, self.store,
                                           str(scratch) if scratch else None,
                                           count=place.environment.actors,
                                           actor_options=placed.environment.options)  # fmt: skip
        self.coordinator = CheckpointCoordinator(ckpt_cfg, self.state, self.store, self.workers,
                                                 self.env, self.storage, self.metrics,
                                                 self.owner)  # fmt: skip
        if self.cfg.gateway.enabled and not standalone_gateway:
            self.gateway_token = secrets.token_urlsafe(24)
            self.gateway_url = self.env.start_gateway(self.gateway_token)
            print(f"rollout gateway at {self.gateway_url}/rollouts/<rollout_id>/v1", flush=True)
        self.evidence = EvidenceLog(self.storage, self.workers)
        metrics_url = self.metrics.serve(self.counters, self.cfg.vllm_cfg.host)
        self.evidence.write_workers(metrics_url)
        if self.cfg.failover.enabled:
            self.supervisor = WorkerSupervisor(
                self.cfg.failover, self.workers, self.env, self.metrics,
                self.coordinator.between_attempts,
                on_replaced=lambda: self.evidence.write_workers(metrics_url),
            )  # fmt: skip
            self._supervision = asyncio.run_coroutine_threadsafe(
                self.supervisor.run(), self._loop.loop
            )
        return self

    def close(self) -> None:
        if self._supervision is not None:
            self._supervision.cancel()
            with contextlib.suppress(Exception):
                self._loop.run(self.supervisor.stop(), timeout=10)
        self.metrics.stop()
        if self.env is not None:
            with contextlib.suppress(Exception):
                self.env.close()
        self._loop.stop()
        self.workers.stop()
        if self.store is not None:
            self.store.shutdown()
        if self.placement is not None:  # after their actors are gone
            self.placement.remove()
        self.store, self.env, self.placement = None, None, None

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
        parts = [(gid, out[gi * n : (gi + 1) * n]) for gi, (gid, _) in enumerate(groups)]
        return [GroupResult(gid, [o.row for o in part], [o.row.reward for o in part],
                            sum(o.decoded_tokens for o in part), [o.result for o in part])
                for gid, part in parts]  # fmt: skip

    def take_batch(self, max_rows: int, ttl_s: float = 600.0) -> LeaseResult:
        return self.store.lease("replay", "trainer", max_rows, ttl_s)

    def ack(self, lease: LeaseResult) -> int:
        return self.store.ack(lease.lease_id)

    def set_step(self, step: int) -> None:
        """The trainer step whose rollouts are generated next (recorded in ledgers)."""
        self.state.step = step

    def counters(self) -> dict[str, float]:
        """The run's counts in one vocabulary (controller/metrics.py names them)."""
        tallies = self.workers.capture_metrics() if self.cfg.token_capture.enabled else None
        return self.metrics.collect(self.env.counters(), tallies)

    def record_call_attempts(self, step: int) -> int:
        """Append what the engines did per call attempt to the run's evidence log."""
        return self.evidence.record_call_attempts(step) if self.cfg.token_capture.enabled else 0

    def push_weights(
        self, weights_dir: str | Path, version: int | None = None, expect_sha256: str | None = None
    ) -> int:
        """Load new weights into every worker as the next weight version (or `version`, when
        a restore re-establishes a checkpoint's weights; `expect_sha256`: the digest those
        weights must have, or nothing is pushed)."""
        digest = directory_weights_digest(weights_dir)
        if expect_sha256 is not None and digest != expect_sha256:
            raise RestoreError(
                f"the weights in {weights_dir} have digest {digest[:12]}, the snapshot expects "
                f"{expect_sha256[:12]}; refusing to push them"
            )
        version = self.state.weight_version + 1 if version is None else version
        self.workers.push_weights(str(weights_dir), version)
        self.state.weight_version, self.state.weights_sha256 = version, digest
        return version

    def restore(self, snapshot: str | None = None, mode: str | None = None) -> dict | None:
        """Restore the store and the environment's episodes from `snapshot`, or from the newest
        usable one by `restore_mode`; the ledger as a dict (with `snapshot` and the newer
        `skipped` ones and why), or None when nothing was ever published."""
        restore_id = f"restore-{time.time_ns()}"
        self.env.begin_restore(restore_id)  # refused once calls were served
        episodes = []
        try:
            where = (self.coordinator.cfg, self.store, self.coordinator.snapshot_root)
            chosen = restore_snapshot(*where, self.state.model, snapshot, mode)
            if chosen is None:
                return None
            episodes = chosen.ledger.episodes
            journal = self._extend_from_journal(restore_id, chosen.snapshot, episodes)
        finally:
            self.env.end_restore(restore_id, episodes)
        self.state.step = chosen.ledger.step
        return chosen.ledger.model_dump(mode="json") | {"snapshot": chosen.snapshot,
                                                        "skipped": chosen.skipped,
                                                        "journal": journal}  # fmt: skip

    def _extend_from_journal(self, restore_id: str, snapshot: str, episodes) -> dict:
        """Each restored call in flight continues from the newer of its snapshot cut and its
        journal (controller/journal_restore.py); what was taken is logged to
        `restores.jsonl`, the evidence a recovery check reads."""
        tc = self.cfg.token_capture
        if not tc.journal_uri or not episodes:
            return {}
        ext = extend_from_journal(episodes, self.store, tc.staging_partition, tc.journal_uri)
        for name, n in ext.counts.items():
            self.metrics.add(name, n)
        line = {"restore_id": restore_id, "snapshot": snapshot, "journal": ext.calls,
                "counts": dict(ext.counts)}  # fmt: skip
        with contextlib.suppress(OSError):
            self.storage.append_line(RESTORES_LOG, json.dumps(line))
        return ext.calls

    def serve_rollouts(self, stop: threading.Event, token: str | None = None) -> dict | None:
        """A standalone gateway: rollouts opened, served and finished over HTTP by harnesses
        outside the job (docs/gateway.md), checkpointed on the cadence, until `stop` is set;
        then one last checkpoint keeps every open rollout. Its metrics, None if it failed."""
        self.gateway_token = token or secrets.token_urlsafe(24)
        self.gateway_url = self.env.start_gateway(self.gateway_token, self.state.weight_version)

        async def until_stopped() -> None:
            while not stop.is_set():
                await asyncio.sleep(0.1)

        self._loop.run(self.coordinator.alongside(until_stopped()))
        return self._loop.run(self.coordinator.counted("shutdown"))

    def notify_trainer_checkpoint(self, step: int) -> dict:
        """After a trainer checkpoint: snapshot the data plane (so a restore never pairs
        rollouts with weights no checkpoint holds). A failed attempt counts like any other
        (returns `failed`); too many in a row raise."""
        if not self.cfg.checkpointing.save_data_plane:
            return {"snapshot_s": 0.0}
        self.state.step = step
        metrics = self._loop.run(self.coordinator.counted("trainer_checkpoint"))
        if metrics is None:
            return {"snapshot_s": None, "failed": self.coordinator.failures_in_a_row}
        return {"snapshot_s": metrics["snapshot_s"], "snapshot": metrics["checkpoint"]}


def SingleController(
    cfg: RolloutRecoveryConfig, ray_address: str = "local", owner: Owner | None = None
) -> ActorProxy:
    """The RolloutRecovery controller as a Ray actor (it owns the store and the workers, so
    they share its fate), used through the same calls as the in-process object. `owner` is
    the claim on the run's snapshot root (`train` claims before it restores); without one the
    controller claims the root itself when it starts."""
    if owner is None:  # claimed here, in the caller: its error is one line
        owner = StagingStore.claim(
            RunStorage(cfg.checkpointing.checkpoint_dir).child_uri(DATA_PLANE)
        )
    init_ray(ray_address, log_to_driver=False)
    options = {"num_cpus": 0, "max_concurrency": 1}
    return ActorProxy(RolloutRecovery, (cfg, ray_address, owner), start="start", **options)
