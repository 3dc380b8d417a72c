"""The checkpoint coordinator: the cadence, one checkpoint attempt, its ledger, retention and
the checkpoint log (docs/design.md §4).

One attempt: fence every worker (terminal rows and chunk deletes wait), prepare the
environment (admission closed, in-flight calls cut), commit its episode records, freeze every
store shard (the snapshot's one consistent moment), then release the fences and reopen admission
(also when the attempt fails); only then are the frozen rows written with the ledger and
the manifest published (written last: that publishes it), while generation goes on. The
fences are held for the cut, the commit and the freeze alone. With
`rollout_checkpointing.full_snapshot_every` > 1 a snapshot is incremental: it writes only what
changed since the previous one and lists that one's files (data_plane/snapshot_io.py).

An attempt that fails or runs out of time is aborted through its publish gate, so its
snapshot can no longer be published. Attempts, on the cadence
or after a trainer checkpoint, share one count of consecutive failures:
`rollout_checkpointing.max_consecutive_failures` in a row stop the run.

Every snapshot is published, and every retention pass runs, as this controller's `owner`
(its claim in the snapshot root's ownership log, data_plane/ownership.py). Once a newer
controller claimed the root, both raise OwnerFenced: the run stops at once with that message
(it is not a checkpoint failure to retry), having published and deleted nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from rollout_recovery import crashpoints
from rollout_recovery.config import CheckpointCoordinatorConfig
from rollout_recovery.controller import liveness
from rollout_recovery.controller.metrics import RunMetrics
from rollout_recovery.controller.selection import DATA_PLANE, LEDGER
from rollout_recovery.crashpoints import crash_point
from rollout_recovery.data_plane import PublishGate, StagingStore
from rollout_recovery.data_plane.ownership import Owner, OwnerFenced
from rollout_recovery.data_plane.token_log_segments import TokenLogSegments
from rollout_recovery.environment.client import EnvironmentClient
from rollout_recovery.environment.participant import ProtocolError
from rollout_recovery.errors import CheckpointWriteError, RecoveryError, RunStalled, one_line
from rollout_recovery.generation.pool import WorkerPool
from rollout_recovery.protocol import CheckpointRecords, Ledger, ServedModel
from rollout_recovery.storage import RunStorage

log = logging.getLogger("rollout_recovery")
CHECKPOINT_LOG = "checkpoints.jsonl"
T = TypeVar("T")


@dataclass
class RunState:
    """What a ledger stamps on each snapshot: the trainer step and the served model."""

    model: dict  # the base model's identity (model_identity.base_model_identity)
    step: int = 0  # the trainer step whose rollouts are being generated
    weight_version: int = 0
    weights_sha256: str | None = None  # None: the base model's weights are served
    trainer_checkpoint: str | None = None  # the digest of the trainer checkpoint of `step`

    def served_model(self) -> ServedModel:
        return ServedModel(base=self.model, weight_version=self.weight_version,
                           weights_sha256=self.weights_sha256)  # fmt: skip

    def served(self, weight_version: int, weights_sha256: str) -> None:
        """The workers serve these weights from now on."""
        self.weight_version, self.weights_sha256 = weight_version, weights_sha256

    def checkpointed(self, step: int, trainer_checkpoint: str | None) -> None:
        """Step `step`'s trainer checkpoint (its digest) pairs with the snapshots from now on
        (also what a restore takes from the snapshot it restored)."""
        self.step, self.trainer_checkpoint = step, trainer_checkpoint


async def _to_the_end(work: Awaitable[None]) -> None:
    """Await `work` to its end even if the caller is cancelled meanwhile (the cancellation
    is raised after it). A release stopped early by the cadence's cancellation would leave the
    environment's admission closed and the workers' fences held until their leases ran
    out: every following attempt fails with "prepare ... while committed" (found by the
    crash campaign)."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await task
        raise


class CheckpointCoordinator:
    def __init__(
        self,
        cfg: CheckpointCoordinatorConfig,
        state: RunState,
        store: StagingStore,
        workers: WorkerPool,
        env: EnvironmentClient,
        storage: RunStorage,
        metrics: RunMetrics,
        owner: Owner | None = None,
        settings: dict[str, Any] | None = None,
    ) -> None:
        self.cfg, self.state, self.store, self.workers = cfg, state, store, workers
        # The run's settings its records depend on (run_settings.py), in every ledger.
        self.settings = settings or {}
        # Held through each attempt: a replacement worker joins only between attempts.
        self.between_attempts = asyncio.Lock()
        self.env, self.storage, self.metrics = env, storage, metrics
        self.owner = owner  # this controller's claim on the snapshot root (owner epoch)
        self.snapshot_root = storage.child_uri(DATA_PLANE)
        self.epochs = itertools.count(1)  # fence epochs: each attempt's is newer
        self.failures_in_a_row = 0
        self.stop_grace_s = 30.0  # beyond attempt_timeout_s, for a stopping cadence's release
        # Trained rows were acked and their trainer checkpoint is not written yet: a snapshot
        # now would pair the older checkpoint with a buffer that lacks them (asynchronous GRPO,
        # whose cadence runs while the trainer trains), so the cadence skips until it is.
        self.held_for_trainer = False
        self.final = False  # a preemption's snapshot was published: the run is ending

    async def cadence(self, stop: asyncio.Event | None = None) -> None:
        """Attempt a checkpoint every `snapshot_attempt_interval_s` until `stop` is set or the
        task is cancelled (or until too many fail in a row, which raises)."""
        interval = self.cfg.rollout_checkpointing.snapshot_attempt_interval_s
        stop = stop or asyncio.Event()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await stop.wait()
            if stop.is_set():
                return
            await self.counted("cadence")

    async def alongside(self, work: Awaitable[T]) -> T:
        """`work`, with checkpoint attempts on the cadence until it is done (none at level
        `none`); the cadence giving up (max_consecutive_failures) stops the run.

        The cadence is stopped by a flag as well as by cancellation: a cancellation that lands
        as an awaited step finishes can be lost (Python 3.11's `asyncio.wait_for` drops it),
        and a cadence that missed it would go on forever while the run waits for it to end.
        Should it still not end within its attempt's time, the step fails with
        `run_stalled.checkpoint_stuck` instead of waiting."""
        work = asyncio.ensure_future(work)
        if self.cfg.rollout_recovery.target_level == "none":
            return await work
        stop = asyncio.Event()
        cadence = asyncio.ensure_future(self.cadence(stop))
        try:
            await asyncio.wait({work, cadence}, return_when=asyncio.FIRST_COMPLETED)
            if cadence.done():
                cadence.result()
        finally:
            stopped = await self._stop(cadence, stop)
        if not stopped:
            bound = self.cfg.rollout_checkpointing.attempt_timeout_s + self.stop_grace_s
            raise RunStalled(
                "checkpoint_stuck",
                f"step {self.state.step} stalled (run_stalled.checkpoint_stuck): its work ended "
                f"but the checkpoint in progress did not end within {bound:g} s "
                "(rollout_checkpointing.attempt_timeout_s plus the release); see "
                f"{CHECKPOINT_LOG}. {liveness.NEXT}",
            )
        return work.result()

    async def _stop(self, cadence: asyncio.Future, stop: asyncio.Event) -> bool:
        """Stop the cadence (flag and cancellation); whether it ended in time."""
        stop.set()
        cadence.cancel()
        bound = self.cfg.rollout_checkpointing.attempt_timeout_s + self.stop_grace_s
        done, _ = await asyncio.wait({cadence}, timeout=bound)
        if done and not cadence.cancelled():
            cadence.exception()  # retrieved: the work's outcome is what the step reports
        return bool(done)

    async def counted(self, reason: str, timeout_s: float | None = None) -> dict | None:
        """One attempt, counted with every other: a failure is logged and returns None until
        max_consecutive_failures fail in a row, which raises CheckpointWriteError."""
        try:
            metrics = await self.attempt(reason, timeout_s)
        except OwnerFenced as err:  # a newer controller owns the run: stop now, not retried
            log.error("%s", one_line(err))
            with contextlib.suppress(OwnerFenced):  # the log is the newer owner's now
                self._log({"checkpoint": None, "reason": reason, "step": self.state.step,
                           "fenced": one_line(err)})  # fmt: skip
            raise
        except Exception as err:
            self.failures_in_a_row += 1
            limit = self.cfg.rollout_checkpointing.max_consecutive_failures
            why = one_line(err)
            log.warning("rollout checkpoint failed (%d in a row): %s", self.failures_in_a_row, why)
            self._log({"checkpoint": None, "reason": reason, "step": self.state.step,
                       "failed": why, "failures_in_a_row": self.failures_in_a_row})  # fmt: skip
            if self.failures_in_a_row >= limit:
                raise CheckpointWriteError(
                    f"{self.failures_in_a_row} rollout checkpoint attempts failed in a row "
                    f"(rollout_checkpointing.max_consecutive_failures={limit}); the last: {why}. "
                    "Fix the checkpoint location (space, permissions, reachability), then "
                    "continue with `train --restore`"
                ) from None
            return None
        self.failures_in_a_row = 0
        return metrics

    def ledger(self, reason: str, records: CheckpointRecords) -> Ledger:
        return Ledger(
            step=self.state.step,
            weight_version=self.state.weight_version,
            reason=reason,
            level=self.cfg.rollout_recovery.target_level,
            model=self.state.served_model(),
            trainer_checkpoint=self.state.trainer_checkpoint,
            episodes=records.episodes,
            continuations=records.continuations,
            settings=self.settings,
        )

    def use_environment(self, env: EnvironmentClient) -> None:
        """Checkpoint this environment from the next attempt on (a job's renewed one)."""
        self.env = env

    async def attempt(self, reason: str, timeout_s: float | None = None) -> dict | None:
        """One checkpoint attempt, within `rollout_checkpointing.attempt_timeout_s` (or
        `timeout_s` when shorter: a preemption's grace); returns its metrics (also appended to
        the checkpoint log), or None when a cadence attempt is skipped while held for the
        trainer."""
        async with self.between_attempts:
            if self.final:  # after a preemption's snapshot nothing newer is published
                self.metrics.add("checkpoints_skipped.after_preemption")
                return None
            if self.held_for_trainer and reason == "preemption":
                raise RecoveryError("the trainer had acked rows and not yet written the "
                                    "checkpoint they pair with")  # fmt: skip
            if self.held_for_trainer and reason == "cadence":
                self.metrics.add("checkpoints_skipped.held_for_trainer")
                return None
            if reason == "trainer_checkpoint":  # its digest is the ledger's from now on
                self.held_for_trainer = False
            metrics = await self._attempt(reason, timeout_s)
            if reason == "preemption":
                self.final = True
            return metrics

    async def ack_held(self, ack: Callable[[], Awaitable[T]]) -> T:
        """Run `ack` between attempts, then hold the cadence until the next trainer checkpoint
        (`counted("trainer_checkpoint")` releases it)."""
        async with self.between_attempts:
            out = await ack()
            self.held_for_trainer = True
            return out

    def release_hold(self) -> None:
        """A trainer checkpoint without a snapshot (`checkpointing.save_data_plane=false`)
        ends the hold too; no cadence runs then, so no attempt can be between."""
        self.held_for_trainer = False

    async def _attempt(self, reason: str, timeout_s: float | None) -> dict:
        # A stale owner writes no snapshot files at all, not only no publication.
        self.storage.check_owner("taking a snapshot")
        t0 = time.monotonic()
        epoch = next(self.epochs)
        timeout = self.cfg.rollout_checkpointing.attempt_timeout_s
        limit = f"rollout_checkpointing.attempt_timeout_s={timeout}"
        if timeout_s is not None and timeout_s < timeout:
            timeout, limit = timeout_s, f"the {timeout_s:.1f} s it was given"
        full_every = self.cfg.rollout_checkpointing.full_snapshot_every
        lease_s = max(self.cfg.token_capture.control_timeout_s * 3, timeout + 5)
        ckpt_id = f"ckpt-{self.state.step}-{epoch}"
        fenced = self.workers if self.cfg.token_capture.enabled else WorkerPool([])
        gate = PublishGate()
        phases: dict[str, float] = {}

        def timed(name: str, since: float) -> float:
            now = time.monotonic()
            phases[name] = now - since
            return now

        async def fenced_steps():
            await fenced.begin_fences(epoch, lease_s)
            crash_point("fence_held")
            t = time.monotonic()
            cuts = await self.env.prepare(ckpt_id, lease_s)
            crash_point("env_prepared")
            t = timed("cut_s", t)
            records = await self.env.commit(ckpt_id)
            crash_point("episodes_committed")
            t = timed("commit_s", t)
            self.storage.check_owner("creating a snapshot")  # the freeze makes its directory
            frozen = await self.store.afreeze(
                self.snapshot_root, full_every, deadline=t0 + timeout, gate=gate
            )
            timed("freeze_s", t)
            return cuts, records, frozen

        async def publish(records, frozen):
            # Again right before the files: an owner paused mid-attempt (after the check above)
            # and woken after a restore must not write its snapshot's files.
            self.storage.check_owner("writing a snapshot")
            return await self.store.awrite(
                frozen,
                meta={"trainer_step": str(self.state.step), "reason": reason},
                sidecars={LEDGER: self.ledger(reason, records).to_json()},
                deadline=t0 + timeout,
                gate=gate,
                owner=self.owner,
            )

        try:
            try:
                async with asyncio.timeout(timeout):
                    cuts, records, frozen = await fenced_steps()
            finally:
                fence_s = time.monotonic() - t0
                await _to_the_end(self._release(ckpt_id, epoch, fenced))
            crash_point("fences_released")
            # The freeze is the snapshot's consistent moment: its files are written and it is
            # published while the workers and the environment go on.
            w0 = time.monotonic()
            left = max(0.0, t0 + timeout - w0)
            async with asyncio.timeout(left):
                snap = await publish(records, frozen)
            # Facts a check arms its pause or kill on (crashpoints.py), computed only when a
            # point is armed: the checkpoint path pays nothing for them otherwise.
            facts = {} if not crashpoints.armed() else {
                "step": self.state.step,
                "snapshot": snap.uri.split("?")[0].rstrip("/").rsplit("/", 1)[-1],
                "cut_calls": sum(bool(c.tokens) for c in records.continuations.values()),
                "episodes": len(records.episodes)}  # fmt: skip
            crash_point("snapshot_taken", **facts)
            timed("write_s", w0)
        except asyncio.CancelledError:  # the cadence stopped (its work ended) mid-attempt
            gate.abort()
            raise
        except Exception as err:
            self.metrics.add("checkpoint_failures")
            late = not gate.abort()  # False: it was published before the abort landed
            if isinstance(err, TimeoutError):
                outcome = "it was published just before the abort" if late else (
                    "aborted, nothing published")  # fmt: skip
                raise TimeoutError(
                    f"checkpoint {ckpt_id} took longer than {limit}; {outcome}"
                ) from None
            raise
        keep = self.cfg.rollout_checkpointing.keep_latest_k
        StagingStore.gc(self.snapshot_root, keep, owner=self.owner)
        self._gc_token_log()
        self.metrics.add("checkpoints")
        self.metrics.add("fence_hold_s", fence_s)
        body = snap.manifest.body
        metrics = {
            "checkpoint": snap.uri, "reason": reason, "step": self.state.step,
            "fence_hold_s": fence_s, "save_s": time.monotonic() - t0,
            "snapshot_s": phases["freeze_s"] + phases["write_s"], **phases,
            "incremental": body.base is not None, "snapshot_bytes": body.written_bytes,
            "episodes_recorded": len(records.episodes), **cuts,
            "chunk_rows_swept": records.chunk_rows_swept,
        }  # fmt: skip
        self._log(metrics)
        return metrics

    def _gc_token_log(self) -> None:
        """Token log segments older than `token_capture.log_retention_s` go (a report: a
        failed delete is retried after the next snapshot)."""
        tc = self.cfg.token_capture
        if not tc.log_uri:
            return
        before = time.time_ns() - int(tc.log_retention_s * 1e9)
        try:
            self.metrics.add("token_log_segments_deleted", TokenLogSegments.gc(tc.log_uri, before))
        except OSError as err:
            log.warning("cannot delete old token log segments: %s", one_line(err))

    async def _release(self, ckpt_id: str, epoch: int, fenced: WorkerPool) -> None:
        """Reopen admission and release every fence, whatever any one of them raises (a fence
        left held would stop terminal rows and chunk deletes until its lease ran out)."""
        reopened, released = await asyncio.gather(
            self.env.reopen(ckpt_id), fenced.end_fences(epoch), return_exceptions=True
        )
        failures = [("reopening admission", reopened)]
        if isinstance(released, BaseException):
            failures.append(("releasing the fences", released))
        else:
            failures += [(f"releasing worker {i}'s fence", r) for i, r in enumerate(released)]
        for what, result in failures:
            if isinstance(result, ProtocolError):
                continue  # a lapsed lease already reopened admission
            if isinstance(result, BaseException):
                self.metrics.add("release_errors")
                log.warning("checkpoint %s: %s failed: %s", ckpt_id, what, one_line(result))

    def _log(self, record: dict) -> None:
        try:
            self.storage.append_line(CHECKPOINT_LOG, json.dumps(record))
        except OSError as err:  # the log is a report; the checkpoint's fate is decided already
            log.warning("cannot write %s: %s", CHECKPOINT_LOG, err)
