"""TrainingRun: the trainer's side of recovery, for any training loop. `rollout-recovery train`
(training/driver.py) is one loop built on it; examples/own_loop/ is another.

    with TrainingRun.open(cfg, restore=True) as run:      # claim; plan or refuse; start
        if run.checkpoint is not None:                     # the paired trainer checkpoint
            load(run.checkpoint.files); write weights to run.weights_dir; run.push_weights()
        for step in range(run.start_step, cfg.grpo.steps):
            run.begin_step(step)
            results = run.submit_groups(groups, seeds)      # rollouts, checkpointed meanwhile
            lease = run.take_batch(results)                # also kept under batches/
            train(lease.rows); run.ack(lease)
            write weights to run.weights_dir; run.push_weights()
            run.save_checkpoint(files, extra, record)      # paired snapshot; step log line

Asynchronous GRPO (`grpo.async_grpo.enabled`) replaces `submit_groups` with a stream: groups
started with `start_groups` generate while the loop trains, `finished_groups(n)` hands over the
first n to finish, and weights are pushed into calls in flight (producer.py decides which
groups to start and train on, and keeps the cursor a restore goes on from).

`TrainingRun.keep_running(cfg, loop)` opens the run and calls `loop(run)`, and when an actor
the job cannot do without dies under it (the controller, a store shard, the environment actor:
`ComponentLost`, components.py) it restores the run in the same process and calls `loop`
again, `failover.max_restores` times. `train` runs its loop this way.

What the run does for the loop:

- `open` claims the location first (trainer/run_plan.py): a fresh run only as its first
  owner, so a location another run owns or is starting is refused with one line naming it; a
  restore chooses the newest snapshot whose trainer checkpoint is the one paired with it,
  verified (or refuses, deleting nothing), sets aside newer ones it skipped, and says so.
- every write under the location (trainer checkpoints, batches, the step and checkpoint logs,
  token log segments, engine records) goes through storage fenced by the claim (storage.py):
  once a newer owner claimed the run, the next write raises OwnerFenced naming it. The
  weights for the workers go to a directory of this owner's own.
- `save_checkpoint` writes the loop's files as they are (its own format), meta last, then
  snapshots the rollouts with the checkpoint's digest in the ledger (a restore pairs only
  that checkpoint with the snapshot), prunes checkpoints no kept snapshot pairs with, and
  appends the step's line to the step log.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from rollout_recovery.config import RolloutRecoveryConfig
from rollout_recovery.controller.selection import DATA_PLANE, run_has_state
from rollout_recovery.controller.stream import StartedGroup
from rollout_recovery.crashpoints import crash_point
from rollout_recovery.data_plane import LeaseResult
from rollout_recovery.data_plane.ownership import Fence, Owner
from rollout_recovery.errors import (
    CheckpointWriteError,
    ComponentLost,
    Preempted,
    RecoveryError,
    RunStalled,
)
from rollout_recovery.model_identity import resolve_model_path
from rollout_recovery.preemption import NoticeWatch
from rollout_recovery.protocol import GroupResult, group_id
from rollout_recovery.runtime import ActorProxy
from rollout_recovery.storage import RunStorage, StorageError
from rollout_recovery.trainer import batches, step_log, trainer_checkpoints
from rollout_recovery.trainer.final_checkpoint import final_checkpoint
from rollout_recovery.trainer.held_job import HeldJob, Kept
from rollout_recovery.trainer.restore_loop import restore_in_process
from rollout_recovery.trainer.run_plan import (
    RestorePlan,
    announce,
    claim_fresh,
    claim_restore,
    paired_steps,
    started_again,
)
from rollout_recovery.trainer.step_figures import StepFigures
from rollout_recovery.trainer.tasks import make_tasks
from rollout_recovery.trainer.trainer_checkpoints import TrainerCheckpoint
from rollout_recovery.trainer.weights import RunWeights

__all__ = ["GroupResult", "StartedGroup", "TrainerCheckpoint", "TrainingRun", "group_id"]

T = TypeVar("T")


class TrainingRun:
    """One training run's recovery, opened by `TrainingRun.open`; see the module docstring."""

    def __init__(
        self, cfg: RolloutRecoveryConfig, storage: RunStorage, owner: Owner,
        plan: RestorePlan | None,
    ) -> None:  # fmt: skip
        self.cfg, self.storage, self.owner, self._plan = cfg, storage, owner, plan
        self.job: HeldJob | None = None  # the controller actor and its engines (`open`)
        self.weights = RunWeights(storage, owner, plan.choice.ledger if plan else None,
                                  due=plan is not None and plan.checkpoint is not None)  # fmt: skip
        self.figures: StepFigures | None = None  # the step in progress
        self.restored: dict | None = None  # the restored snapshot's ledger (`open`)
        self.model_dir = resolve_model_path(cfg.policy.model_path)  # policy.model_path, local
        self._notices = NoticeWatch(cfg.preemption)  # SIGTERM / notice file (preemption.py)
        self._last_step = self.start_step - 1  # the last step begun
        self.opened: dict[str, float] = {}  # how long `open`'s parts took (keep_running logs it)
        self.kept: Kept | None = None  # what of the job a restore in this process keeps
        self.restores_left = False  # keep_running sets it while it has restores left

    @property
    def start_step(self) -> int:
        return self._plan.step if self._plan is not None else 0

    @property
    def checkpoint(self) -> TrainerCheckpoint | None:
        """The trainer checkpoint paired with the restored snapshot (None: a fresh start)."""
        return self._plan.checkpoint if self._plan is not None else None

    @property
    def rollouts(self) -> ActorProxy:
        """The controller actor (api.py's calls), for `counters()` and the other calls."""
        if self.job is None:
            raise RecoveryError("the run's job is not running (closed, or not opened)")
        return self.job.rollouts

    @property
    def weights_dir(self) -> Path:
        return self.weights.dir

    @property
    def weight_version(self) -> int:
        return self.weights.version

    @classmethod
    def open(
        cls, cfg: RolloutRecoveryConfig, restore: bool = False, ray_address: str = "local",
        kept: Kept | None = None,
    ) -> TrainingRun:  # fmt: skip
        """Claim `checkpointing.checkpoint_dir` and start the job; with `restore`, continue
        the run there from its newest usable snapshot (nothing to restore: from step 0).
        Refusals (RunExistsError, RestoreError) are one line and change nothing. `kept`: the
        engines of the job before, and its
        controller where it lives (`keep_running`): the job is built again around them."""
        t0 = time.monotonic()
        storage = RunStorage(cfg.checkpointing.checkpoint_dir)
        storage.check_writable()
        plan = None
        if restore:
            left = run_has_state(storage)
            plan, owner = claim_restore(cfg, storage)
        else:
            owner = claim_fresh(storage)
        mine = storage.fenced(Fence.of(storage.child_uri(DATA_PLANE), owner))
        if restore and plan is None:
            started_again(mine, owner, left)
        if plan is not None:
            announce(mine, plan)
            step_log.complete(mine, plan.step)
            for rel in mine.leftover_temporaries():  # writes the crash cut short
                mine.delete_file(rel)
        run = cls(cfg, mine, owner, plan)
        t1 = time.monotonic()
        try:
            # Before Ray's start (init_ray keeps this handler over Ray's): a notice while the
            # job starts ends the start at once, with nothing published.
            run._notices.start()
            with run._notices.interruptible():
                run.job = HeldJob.start(cfg, ray_address, owner, kept)
            t2 = time.monotonic()
            if plan is not None:
                run.restored = run.rollouts.restore(plan.choice.snapshot)
        except Preempted as err:
            run.close()
            print(f"preempted ({err.notice}) while the job was starting: nothing was published "
                  "by this start; continue the run with `train --restore`", flush=True)  # fmt: skip
            raise
        except BaseException:
            run.close()
            raise
        run.opened = {"plan_s": t1 - t0, "start_s": t2 - t1, "restore_s": time.monotonic() - t2,
                      "opened_at": time.time(),
                      "engines_kept": kept is not None and run.rollouts.engines_kept()}  # fmt: skip
        return run

    @classmethod
    def keep_running(
        cls, cfg: RolloutRecoveryConfig, loop: Callable[[TrainingRun], T], restore: bool = False,
        ray_address: str = "local",
    ) -> T:  # fmt: skip
        """`loop(run)` in a run `open` started, kept running through the death of an actor the
        job cannot do without (`ComponentLost`: the controller, a store shard, the environment
        actor): what is left of the job is stopped and the run continues in this process from
        its newest snapshot, as `train --restore` would, up to `failover.max_restores` times;
        `loop` is called again with the restored run (it starts at `run.start_step`). Each
        restore is said on the terminal and logged (`restored_in_process`). One death more
        raises the ComponentLost, its line saying to continue with `train --restore`."""
        return restore_in_process(cls.open, cfg, loop, restore, ray_address)

    def __enter__(self) -> TrainingRun:
        return self

    def __exit__(self, kind: type | None, err: BaseException | None, tb: object) -> None:
        notice = self._notices.notice
        if isinstance(err, Preempted) or (isinstance(err, KeyboardInterrupt) and notice):
            self._final_checkpoint()
            self.close(preempted=True)
            if not isinstance(err, Preempted):  # the notice landed outside a guarded wait
                raise Preempted(notice) from None
            return
        self.close(lost=err if isinstance(err, ComponentLost) else None)

    def close(self, preempted: bool = False, lost: ComponentLost | None = None) -> None:
        """Stop the job (workers, store, environment); the location keeps everything. After an
        actor of the job died (`lost`), what the healing table says serves the restore is kept
        in `kept` (trainer/held_job.py)."""
        self._notices.stop()
        try:
            if self.job is not None:
                job, self.job = self.job, None
                self.kept = job.close(self.cfg, preempted, lost, self.restores_left)
        finally:
            self.weights.cleanup()

    def _final_checkpoint(self) -> None:
        """A preemption: hold every call, cut it, publish a snapshot within the grace left."""
        rollouts = self.job.rollouts if self.job is not None else None
        final_checkpoint(self._notices, rollouts, self.storage, self.cfg, self._last_step + 1)

    # ------------------------------------------------------------------ weights

    def push_weights(self) -> int:
        """Load the weights the loop wrote into `weights_dir` into every worker; returns their
        weight version. The first push after a restore re-establishes the snapshot's version,
        and refuses weights other than the ones its calls were decoded with."""
        self.storage.check_owner("pushing weights to the workers")
        a = self.cfg.grpo.async_grpo
        restoring = self.weights.due
        version = self.weights.push(self.rollouts, not a.enabled or a.in_flight_weight_updates)
        if not restoring and self.figures is not None:
            crash_point("weights_pushed")
        return version

    # ------------------------------------------------------------------ a step

    def begin_step(self, step: int) -> None:
        """Start generating step `step`'s rollouts (recorded in the snapshots' ledgers)."""
        self._notices.check()
        if self.weights.due:
            raise RecoveryError(
                f"run.checkpoint holds the trainer state of step {self.checkpoint.step}: load it, "
                "write its weights to run.weights_dir and call run.push_weights() before "
                "run.begin_step (the restored calls continue with those weights)"
            )
        self.rollouts.set_step(step)
        fo = self.cfg.failover
        # After a step, so its start never slows a restore's first calls; only where
        # keep_running could still restore (healing.py: the standby takes the job).
        wanted = self.restores_left and fo.keep_engines and fo.standby_controller
        if step > self.start_step and wanted:
            self.job.start_standby(self.cfg)
        self._last_step = step
        self.figures = StepFigures(step, self.rollouts.counters())

    def tasks(self, step: int) -> list[dict]:
        """Step `step`'s tasks from `environment.tasks(grpo.prompts_per_step, seed)`, checked;
        an error in that function names it and shows its own frames."""
        return make_tasks(self.cfg, step)

    def submit_groups(
        self, groups: list[tuple[str, dict]], seeds: Callable[[int, int], int]
    ) -> list[GroupResult]:
        """The step's episodes, run and scored (RolloutRecovery.submit_groups); a stalled run
        is written to the step log before it raises."""
        step = self._current()
        try:
            with self._notices.interruptible():
                results = self._watched("submit_groups", groups, seeds)
        except RunStalled as err:
            step_log.append(self.storage, {"event": "stalled", "step": step,
                                           "reason": err.reason, "error": str(err)})  # fmt: skip
            raise
        self.figures.generated(results)
        return results

    # ------------------------------------------------------------------ asynchronous GRPO

    def start_groups(self, groups: list[StartedGroup]) -> dict[str, int]:
        """Start these groups now; they generate while the loop trains (see the module
        docstring). Returns the counts of groups in flight and finished."""
        return self.rollouts.start_groups(groups)

    def finished_groups(self, n: int, timeout_s: float | None = None) -> list[GroupResult]:
        """The first `n` started groups to finish, oldest first (waiting for them)."""
        t0 = time.monotonic()
        with self._notices.interruptible():
            results = self._watched("finished_groups", n, timeout_s)
        self.figures.wait_s += time.monotonic() - t0
        return results

    def drop_groups(self, results: list[GroupResult], reason: str) -> int:
        """Consume finished groups untrained (counted as `async.groups_dropped_<reason>`)."""
        return self.rollouts.drop_groups(results, reason)

    def restored_groups(self) -> set[str]:
        """The groups the restored snapshot holds: episodes to go on with, and finished ones
        in the buffer (empty for a fresh run). Start them again to take them up."""
        if self.restored is None:
            return set()
        episodes = {e["group_id"] for e in self.restored.get("episodes", [])}
        return episodes | set(self.rollouts.buffered_groups())

    def take_batch(self, results: list[GroupResult], ttl_s: float = 600.0) -> LeaseResult:
        """Lease these groups' rows for training; the batch and what each episode returned are
        kept under batches/ (and what the engines did per call attempt in the evidence log)
        first."""
        step = self._current() + 1
        self.rollouts.record_call_attempts(step)
        if self.cfg.grpo.async_grpo.enabled:  # generated while earlier steps trained
            self.figures.generated(results)
        lease = self.rollouts.take_groups(results, ttl_s)
        crash_point("batch_leased")
        self.storage.write_bytes(batches.batch_rel(step, "arrow"), batches.batch_bytes(lease.rows))
        self.storage.write_bytes(batches.batch_rel(step, "results.json"),
                                 batches.results_json(results))  # fmt: skip
        self.figures.batch_digest = batches.batch_digest(lease.rows)
        return lease

    def ack(self, lease: LeaseResult) -> int:
        """After the optimizer step: the leased rows are trained on."""
        acked = self.rollouts.ack(lease)
        crash_point("batch_acked")
        return acked

    def save_checkpoint(
        self, files: dict[str, bytes], extra: dict | None = None, record: dict | None = None
    ) -> dict:
        """End the step: write the trainer checkpoint (the loop's `files`, in its own format,
        and the JSON `extra`), snapshot the rollouts paired with it, prune, and append the
        step's line (`record` plus the run's figures) to the step log; returns that line."""
        step = self._current() + 1
        c0 = time.monotonic()
        fig = self.figures
        line = fig.line(step, record or {}, self.weight_version, self.weights.push_s,
                        self.rollouts.counters())  # fmt: skip
        kept = line | {"checkpoint_s": None, "snapshot_s": None}  # completes a lost log line
        try:
            meta = trainer_checkpoints.save(self.storage, step, files, extra or {}, kept)
        except StorageError as err:
            raise CheckpointWriteError(
                f"cannot write the trainer checkpoint of step {step}: {err.detail}; free space "
                "or fix permissions under checkpointing.checkpoint_dir, then continue with "
                "`train --restore` (nothing was deleted)"
            ) from None
        crash_point("after_trainer_checkpoint")
        snap = self.rollouts.notify_trainer_checkpoint(step, meta["digest"])
        if "failed" in snap:
            print(f"rollout snapshot after trainer step {step} failed ({snap['failed']} in a "
                  "row; see checkpoints.jsonl); the run goes on", flush=True)  # fmt: skip
        crash_point("after_trainer_snapshot")
        paired = paired_steps(self.storage)
        if paired is not None:
            keep = self.cfg.rollout_checkpointing.keep_latest_k
            trainer_checkpoints.prune(self.storage, keep, paired)
        line |= {"checkpoint_s": time.monotonic() - c0, "snapshot_s": snap["snapshot_s"],
                 "generation_s": fig.gen_s, "step_s": time.monotonic() - fig.t0}  # fmt: skip
        step_log.append(self.storage, line)
        crash_point("step_logged")
        self.figures = None
        self._notices.check()  # a notice during the step: its checkpoint is written, now stop
        return line

    def _watched(self, name: str, *args: object) -> object:
        """A call that waits on the step's episodes: a dead controller ends it at once, and
        every `failover.component_check_s` the controller is asked whether a store shard or
        the environment actor died, which would leave the call waiting (components.py)."""

        def probe() -> None:
            try:
                lost = self.rollouts.call_in("control", "lost_components", timeout=30.0)
            except TimeoutError:  # the control group is busy (a preemption): ask again later
                return
            if lost:
                raise lost[0]

        every = self.cfg.failover.component_check_s
        try:
            return self.rollouts.watched(name, args, probe, every)
        except (ComponentLost, Preempted, KeyboardInterrupt):
            raise
        except Exception:
            # An episode whose rows went to a dead store shard fails before the next probe:
            # the death is the cause to report (and to restore from), not the episode's error.
            probe()
            raise

    def _current(self) -> int:
        if self.figures is None:
            raise RecoveryError("call run.begin_step(step) first: no step is in progress")
        return self.figures.step
