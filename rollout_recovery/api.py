"""RolloutRecovery: the rollout side of a run, built from one config; the facade a training
loop's TrainingRun (run.py) calls, in process or as the controller actor (controller_actor.py).

It holds one job (controller/job.py: `build_job` starts it, `Job.close` stops it) and forwards
each call: the step's calls to controller/steps.py, a restore to controller/restore.py, the
standalone gateway to controller/gateway_serving.py. `halt` and `restart` build the job again
around the same engines after a store shard or an environment actor died (run.py
`TrainingRun.keep_running`). A step's data flow is drawn in docs/design.md (section 4).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from rollout_recovery.config import RolloutRecoveryConfig
from rollout_recovery.controller import steps
from rollout_recovery.controller.gateway_serving import serve_gateway
from rollout_recovery.controller.job import Engines, Gateway, Job, build_job
from rollout_recovery.controller.restore import restore_run
from rollout_recovery.controller.stream import StartedGroup
from rollout_recovery.data_plane import LeaseResult
from rollout_recovery.data_plane.ownership import Owner
from rollout_recovery.errors import ComponentLost, RecoveryError
from rollout_recovery.protocol import GroupResult


class RolloutRecovery:
    def __init__(
        self, cfg: RolloutRecoveryConfig, ray_address: str = "local", owner: Owner | None = None,
        engines: Engines | None = None,
    ) -> None:  # fmt: skip
        self.given_cfg, self.ray_address = cfg, ray_address  # `restart` builds again from them
        self._owner = owner  # the first start's claim on the snapshot root (claimed when None)
        self._engines = engines  # the first start's, started by the caller (controller_actor)
        self._job: Job | None = None

    @property
    def job(self) -> Job:
        if self._job is None:
            raise RecoveryError("the rollout job is not running: call start() first")
        return self._job

    def running(self) -> bool:
        return self._job is not None

    def start(self, standalone_gateway: bool = False) -> RolloutRecovery:
        """Start the store, workers and environment (and, with `gateway.enabled`, the gateway
        the episode functions use; `standalone_gateway`: `serve_rollouts` starts it later)."""
        engines, self._engines = self._engines, None  # handed over: the job's from here on
        self._job = build_job(self.given_cfg, self.ray_address, self._owner, standalone_gateway,
                              engines)  # fmt: skip
        return self

    def take_over(self, owner: Owner, engines: Engines | None) -> None:
        """A standby controller takes on the job of one that died: claimed as `owner`, on
        `engines`, then `start` as a new controller would."""
        self._owner, self._engines = owner, engines
        self.start()

    def close(self) -> None:
        job, self._job = self._job, None
        if job is not None:
            job.close()

    def engines_kept(self) -> bool:
        """Whether this job runs on the engines of the job before, reset."""
        return self.job.engines_kept

    def gateway(self) -> Gateway | None:
        return self._job.gateway if self._job is not None else None

    def halt(self) -> None:
        """After the death of a store shard or the environment actor: end the other store
        shards and environment actors too, so a call still waiting on them (the `default`
        group's) fails now; `restart` follows. Runs in the `control` group."""
        self.job.halt()

    def restart(self, owner: Owner) -> None:
        """Build the job again as `owner` (the restore's new claim) around the same engines,
        reset to a fresh start's state (WorkerPool.reset) instead of started again (minutes of
        weight loading on a GPU node); the evidence log goes on with the same cursors. Then
        `restore` as after `start`."""
        old, self._job = self.job, None
        kept = old.close(keep_engines=True)
        self._job = build_job(self.given_cfg, self.ray_address, owner, engines=kept)
        self._job.evidence.carry_on(old.evidence)

    def submit_groups(
        self, groups: list[tuple[str, dict]], seeds: Callable[[int, int], int]
    ) -> list[GroupResult]:
        """Run `grpo.generations_per_prompt` episodes of `environment.episode` per (group id,
        task) pair, checkpointing on the cadence meanwhile; each finished episode, scored by
        `environment.reward`, becomes a `replay` row. `seeds(group, gen)` gives each its
        sampler seed. Stored episodes are not run again; restored ones replay their journal."""
        return steps.submit_groups(self.job, groups, seeds)

    def start_groups(self, groups: list[StartedGroup]) -> dict[str, int]:
        """Asynchronous GRPO: start these groups without waiting (controller/stream.py); the
        stream's counts (in flight, finished and not taken)."""
        return steps.start_groups(self.job, groups)

    def finished_groups(self, n: int, timeout_s: float | None = None) -> list[GroupResult]:
        """The `n` started groups that finished first, oldest first (waiting for them); a
        group that failed, or a cadence that gave up, raises its error here."""
        return steps.finished_groups(self.job, n, timeout_s)

    def take_groups(self, results: list[GroupResult], ttl_s: float = 600.0) -> LeaseResult:
        """Lease exactly these groups' rows for training (others stay in the buffer)."""
        return steps.take_groups(self.job, results, ttl_s)

    def drop_groups(self, results: list[GroupResult], reason: str) -> int:
        """Consume these groups' rows untrained (`async.groups_dropped_<reason>`)."""
        return steps.drop_groups(self.job, results, reason)

    def buffered_groups(self) -> list[str]:
        """The groups with rows in the buffer (finished, not trained), by id."""
        return sorted({key.rsplit("/", 1)[0] for key in self.job.store.list("replay")})

    def take_batch(self, max_rows: int, ttl_s: float = 600.0) -> LeaseResult:
        return self.job.store.lease("replay", "trainer", max_rows, ttl_s)

    def ack(self, lease: LeaseResult) -> int:
        """The leased rows were trained on."""
        return steps.ack(self.job, lease)

    def set_step(self, step: int) -> None:
        """The trainer step whose rollouts are generated next (recorded in ledgers)."""
        self.job.state.step = step

    def counters(self) -> dict[str, float]:
        """The run's counts in one vocabulary (controller/metrics.py names them)."""
        return self.job.counters()

    def preempt(self, timeout_s: float, step: int) -> dict:
        """A preemption's final checkpoint, in the `control` group beside the call the notice
        interrupted: generation held, one attempt within `timeout_s`, the engines' records
        logged as step `step`'s. Its metrics and `held`, or `failed` saying why."""
        return steps.preempt(self.job, timeout_s, step)

    def lost_components(self, timeout_s: float = 1.0) -> list[ComponentLost]:
        """The store shards and environment actors of this job that died (components.py); the
        trainer asks, in the `control` group, while a step's call waits."""
        return self._job.lost_components(timeout_s) if self._job is not None else []

    def record_call_attempts(self, step: int) -> int:
        """Append what the engines did per call attempt to the run's evidence log."""
        return steps.record_call_attempts(self.job, step)

    def push_weights(
        self, weights_dir: str | Path, version: int | None = None,
        expect_sha256: str | None = None, in_flight: bool = True,
    ) -> int:  # fmt: skip
        """Load new weights into every worker as the next weight version (or `version`, when a
        restore re-establishes a checkpoint's, whose digest must be `expect_sha256`): into the
        calls in flight, or (`in_flight` False) once they ended."""
        return steps.push_weights(self.job, weights_dir, version, expect_sha256, in_flight)

    def restore(self, snapshot: str | None = None, mode: str | None = None) -> dict | None:
        """Restore the store and the environment's episodes from `snapshot`, or from the newest
        usable one by `restore_mode`; the ledger as a dict (with `snapshot` and the newer
        `skipped` ones and why), or None when nothing was ever published."""
        return restore_run(self.job, snapshot, mode)

    def serve_rollouts(self, stop: threading.Event, token: str | None = None) -> dict | None:
        """A standalone gateway (docs/gateway.md), checkpointed on the cadence until `stop` is
        set; then one last checkpoint keeps every open rollout. Its metrics, None if failed."""
        return serve_gateway(self.job, stop, token)

    def notify_trainer_checkpoint(self, step: int, digest: str | None = None) -> dict:
        """After a trainer checkpoint of `step` (`digest`: recorded in this and every later
        snapshot's ledger until the next, so a restore pairs only that checkpoint with them):
        snapshot the data plane. TrainingRun.save_checkpoint calls this."""
        return steps.notify_trainer_checkpoint(self.job, step, digest)
