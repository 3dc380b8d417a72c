"""RolloutRecovery: the calls a trainer makes, built from one config.

start the data plane, the workers and the environment (or restore them from a snapshot);
submit prompt groups (the environment's finished episodes become `replay` rows);
take a training batch (a lease, acked after the optimizer step); push new weights; notify a
trainer checkpoint (a data-plane snapshot follows it). The shipped GRPO driver uses only this.

Every snapshot's ledger records the model identity (the base model's digest, the weight version
and the digest of the weights being served), so a restore can refuse another model. Checkpoint
attempts, on the cadence or after a trainer checkpoint, share one count of consecutive
failures: `rollout_checkpointing.max_consecutive_failures` in a row stop the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ray

from rollout_recovery import faults
from rollout_recovery.config import RolloutRecoveryConfig
from rollout_recovery.data_plane import (
    LeaseResult,
    PublishGate,
    ReplayRow,
    SnapshotError,
    StagingStore,
)
from rollout_recovery.environment.participant import ProtocolError
from rollout_recovery.environment.rollout_env import RolloutEnvironmentActor
from rollout_recovery.errors import CheckpointWriteError, RecoveryError, RestoreError
from rollout_recovery.generation import WorkerHandle, start_workers, stop_workers
from rollout_recovery.model_identity import base_model_identity, directory_weights_digest
from rollout_recovery.restore import (
    DATA_PLANE,
    LEDGER,
    LEDGER_FORMAT,
    check_model,
    read_ledger,
    select_snapshot,
)
from rollout_recovery.runtime import init_ray
from rollout_recovery.storage import RunStorage
from rollout_recovery.tiny_model import resolve_model_path

log = logging.getLogger("rollout_recovery")
WORKERS_FILE = "workers.json"
CALL_ATTEMPTS_DIR = "call_attempts"
COUNTERS = (
    "checkpoints",
    "checkpoint_failures",
    "fence_hold_s",
    "restored_episodes",
    "restored_calls",
    "restored_prefix_tokens",
    "restored_turn_tokens",
    "tail_tokens",
    "regenerated_tokens",
    "tool_applications",
)


@dataclass
class GroupResult:
    group_id: str
    rows: list[ReplayRow]
    rewards: list[float]
    generated_tokens: int
    states: list[dict | None]  # each episode's final tool state (None: restored finished)


class RolloutRecovery:
    def __init__(self, cfg: RolloutRecoveryConfig, ray_address: str = "local") -> None:
        self.cfg = cfg
        self.ray_address = ray_address
        self.store: StagingStore | None = None
        self.workers: list[WorkerHandle] = []
        self.env: ray.actor.ActorHandle | None = None  # the RolloutEnvironmentActor
        self.weight_version = 0
        self.weights_sha256: str | None = None  # None: the base model's weights are served
        self.model_dir = resolve_model_path(cfg.policy.model_path)
        self.model = base_model_identity(cfg.policy.model_path, self.model_dir)
        # One private loop, on its own thread, for every async call: the caller's thread may
        # already run one (a Ray actor does).
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.step = 0  # the trainer step whose rollouts are being generated
        self._epoch = itertools.count(1)
        self.storage = RunStorage(cfg.checkpointing.checkpoint_dir)
        self.snapshot_root = self.storage.child_uri(DATA_PLANE)
        self.stats: Counter[str] = Counter()  # checkpoints, failures, fence hold seconds
        self.failures_in_a_row = 0
        self.session = f"session-{time.time_ns()}"  # names this process's evidence log
        self._attempt_cursors: list[int] = []  # per worker: its call-attempt log read so far
        self._attempts_dropped: list[int] = []

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> RolloutRecovery:
        init_ray(self.ray_address, log_to_driver=False)
        self.store = StagingStore.create(num_shards=1)
        self.workers = start_workers(self.cfg, store=self.store)
        env_cls = ray.remote(RolloutEnvironmentActor).options(
            num_cpus=0, max_concurrency=16, **_fault_env()
        )
        self.env = env_cls.remote(self.cfg, self.workers, self.store)
        ray.get(self.env.counters.remote())  # constructed
        self._attempt_cursors = [0] * len(self.workers)
        self._attempts_dropped = [0] * len(self.workers)
        self._write_workers()
        return self

    def _write_workers(self) -> None:
        """`workers.json`: where this session's workers serve (URL, pids), so an operator or
        a check can read their control routes (the bearer token is not written)."""
        workers = [{"index": w.info.worker_index, "url": w.info.url, "pid": w.info.pid,
                    "engine_pids": w.info.engine_pids} for w in self.workers]  # fmt: skip
        body = {"session": self.session, "workers": workers}
        try:
            self.storage.write_bytes(WORKERS_FILE, json.dumps(body, indent=1).encode())
        except OSError as err:  # a report for operators; the run does not depend on it
            log.warning("cannot write %s: %s", WORKERS_FILE, one_line(err))

    def record_call_attempts(self, step: int) -> int:
        """Append what the workers' engines did per call attempt since the last call (resume
        verdict, prefix spliced in, tokens decoded, finish) to
        `call_attempts/<session>.jsonl`, each line tagged with `step` and the worker index;
        returns the number of lines. The evidence a recovery check compares across a crash.
        A failed write is a warning (the log is a report) and is retried with the next step."""
        if not self.cfg.token_capture.enabled:
            return 0
        cursors = zip(self.workers, self._attempt_cursors, strict=True)
        pages = ray.get([w.actor.call_attempts.remote(c) for w, c in cursors])
        lines = []
        for i, page in enumerate(pages):
            lines += [json.dumps({"step": step, "worker": i} | rec) for rec in page["attempts"]]
            if page["dropped"] > self._attempts_dropped[i]:
                log.warning("worker %d dropped %d call-attempt records (token_capture."
                            "max_attempt_records)", i, page["dropped"])  # fmt: skip
                self._attempts_dropped[i] = page["dropped"]
        if lines:
            try:
                rel = f"{CALL_ATTEMPTS_DIR}/{self.session}.jsonl"
                self.storage.append_line(rel, "\n".join(lines))
            except OSError as err:
                log.warning("cannot write %s: %s", CALL_ATTEMPTS_DIR, one_line(err))
                return 0
        self._attempt_cursors = [page["next"] for page in pages]
        return len(lines)

    def close(self) -> None:
        if self.env is not None:
            with contextlib.suppress(Exception):
                ray.get(self.env.close.remote(), timeout=30)
            ray.kill(self.env)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if self.workers:
            stop_workers(self.workers)
        if self.store is not None:
            self.store.shutdown()
        self.workers, self.store, self.env = [], None, None

    # ------------------------------------------------------------------ rollouts

    def submit_groups(
        self,
        groups: list[tuple[str, list[dict]]],
        seeds: Callable[[int, int], int],
        reward_fn: Callable[[str], float],
    ) -> list[GroupResult]:
        """Run `grpo.generations_per_prompt` episodes per (group id, messages) pair,
        concurrently, in the environment; each finished episode becomes a `replay` row.
        `seeds(group, gen)` gives each generation its own sampler seed, so runs are
        reproducible. Episodes whose row is already stored are not run again, and episodes a
        restore brought back continue from their last committed turn (or cut prefix)."""
        n = self.cfg.grpo.generations_per_prompt
        seed_table = [[seeds(gi, i) for i in range(n)] for gi in range(len(groups))]

        async def episodes():
            return await self.env.run_groups.remote(
                groups, seed_table, reward_fn, self.weight_version
            )

        async def run():
            work = asyncio.ensure_future(episodes())
            if self.cfg.rollout_recovery.target_level == "none":
                return await work
            cadence = asyncio.ensure_future(self._checkpoint_cadence())
            try:
                await asyncio.wait({work, cadence}, return_when=asyncio.FIRST_COMPLETED)
                if cadence.done():  # it gave up after max_consecutive_failures: stop the run
                    cadence.result()
                return work.result()
            finally:
                cadence.cancel()
                await asyncio.gather(cadence, return_exceptions=True)

        out = self._run(run())
        results = []
        for gi, (gid, _) in enumerate(groups):
            part = out[gi * n : (gi + 1) * n]
            results.append(
                GroupResult(
                    gid,
                    [r for r, _, _ in part],
                    [r.reward for r, _, _ in part],
                    sum(t for _, t, _ in part),
                    [s for _, _, s in part],
                )
            )
        return results

    # ------------------------------------------------------------------ training side

    def take_batch(self, max_rows: int, ttl_s: float = 600.0) -> LeaseResult:
        return self.store.lease("replay", "trainer", max_rows, ttl_s)

    def ack(self, lease: LeaseResult) -> int:
        return self.store.ack(lease.lease_id)

    def set_step(self, step: int) -> None:
        """The trainer step whose rollouts are generated next (recorded in ledgers)."""
        self.step = step

    def counters(self) -> dict[str, float]:
        """Running totals: checkpoints taken and failed, fence hold seconds; restored episodes
        and calls, prefix / turn tokens kept, tail and regenerated tokens decoded, tool
        applications; `restore_refused.<reason>` for each episode record that started over."""
        got = ray.get(self.env.counters.remote()) | self.stats
        refused = {k: v for k, v in got.items() if k.startswith("restore_refused.")}
        return {k: got.get(k, 0) for k in COUNTERS} | refused | self._worker_resumes()

    def _worker_resumes(self) -> dict[str, int]:
        """What the workers did with resume requests: accepted (resumed from the prefix) or
        refused (failed closed and decoded from scratch), summed over workers."""
        if not self.cfg.token_capture.enabled:
            return {}
        seen: Counter[str] = Counter()
        for tally in ray.get([w.actor.capture_metrics.remote() for w in self.workers]):
            seen.update({k: int(v) for k, v in tally.items() if k.startswith("resume.")})
        accepted = seen["resume.resumed"]
        after = (
            "resume.resumed",
            "resume.finished_without_decoding",
            "resume.prefix_tokens",
            "resume.decoded_tokens",
        )  # outcomes of accepted resumes and token counts
        refused = sum(v for k, v in seen.items() if k not in after)
        return {"worker_resumes_accepted": accepted, "worker_resumes_refused": refused}

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
        version = self.weight_version + 1 if version is None else version
        ray.get([w.actor.push_weights.remote(str(weights_dir), version)
                 for w in self.workers])  # fmt: skip
        self.weight_version, self.weights_sha256 = version, digest
        return self.weight_version

    # ------------------------------------------------------------------ checkpoints

    async def _checkpoint_cadence(self) -> None:
        interval = self.cfg.rollout_checkpointing.snapshot_attempt_interval_s
        while True:
            await asyncio.sleep(interval)
            await self._counted_checkpoint("cadence")

    async def _counted_checkpoint(self, reason: str) -> dict | None:
        """One attempt, counted with every other: a failure is logged and returns None until
        max_consecutive_failures fail in a row, which raises CheckpointWriteError."""
        try:
            metrics = await self.checkpoint(reason)
        except Exception as err:
            self.failures_in_a_row += 1
            limit = self.cfg.rollout_checkpointing.max_consecutive_failures
            why = one_line(err)
            log.warning("rollout checkpoint failed (%d in a row): %s", self.failures_in_a_row, why)
            self._log_checkpoint(
                {
                    "checkpoint": None,
                    "reason": reason,
                    "step": self.step,
                    "failed": why,
                    "failures_in_a_row": self.failures_in_a_row,
                }
            )
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

    def _log_checkpoint(self, record: dict) -> None:
        try:
            self.storage.append_line("checkpoints.jsonl", json.dumps(record))
        except OSError as err:  # the log is a report; the checkpoint's fate is decided already
            log.warning("cannot write checkpoints.jsonl: %s", err)

    def _ledger(self, reason: str, records: dict) -> dict:
        return {
            "format": LEDGER_FORMAT,
            "step": self.step,
            "weight_version": self.weight_version,
            "reason": reason,
            "level": self.cfg.rollout_recovery.target_level,
            "model": {
                "base": self.model,
                "weight_version": self.weight_version,
                "weights_sha256": self.weights_sha256,
            },
            **records,  # episodes, continuations
        }

    async def checkpoint(self, reason: str) -> dict:
        """One checkpoint attempt (DESIGN.md §4): fence the workers, prepare the environment
        (admission closed, in-flight calls cut), commit its episode records, snapshot the
        store with the ledger (manifest last), then release the fences and reopen admission,
        also when the attempt fails. An attempt that fails or times out is aborted through its
        publish gate: from then on its snapshot can no longer be published. Returns the
        per-checkpoint metrics (also appended to checkpoints.jsonl)."""
        t0 = time.monotonic()
        epoch = next(self._epoch)
        timeout = self.cfg.rollout_checkpointing.attempt_timeout_s
        lease_s = max(self.cfg.token_capture.control_timeout_s * 3, timeout + 5)
        ckpt_id = f"ckpt-{self.step}-{epoch}"
        fenced = self.workers if self.cfg.token_capture.enabled else []
        gate = PublishGate()

        async def attempt():
            await asyncio.gather(*(w.actor.begin_fence.remote(epoch, lease_s) for w in fenced))
            cuts = await self.env.prepare.remote(ckpt_id, lease_s)
            records = await self.env.commit.remote(ckpt_id)
            swept = records.pop("chunk_rows_swept", 0)
            ledger = self._ledger(reason, records)
            s0 = time.monotonic()
            snap = await self.store.asnapshot(
                self.snapshot_root,
                meta={"trainer_step": str(self.step), "reason": reason},
                sidecars={LEDGER: json.dumps(ledger, sort_keys=True).encode()},
                deadline=t0 + timeout,
                gate=gate,
            )
            return cuts | {"chunk_rows_swept": swept}, records, snap, time.monotonic() - s0

        try:
            cuts, records, snap, snapshot_s = await asyncio.wait_for(attempt(), timeout)
        except Exception as err:
            self.stats["checkpoint_failures"] += 1
            late = not gate.abort()  # False: it was published before the abort landed
            if isinstance(err, TimeoutError):
                outcome = "it was published just before the abort" if late else (
                    "aborted, nothing published")  # fmt: skip
                raise TimeoutError(
                    f"checkpoint {ckpt_id} took longer than rollout_checkpointing."
                    f"attempt_timeout_s={timeout}; {outcome}"
                ) from None
            raise
        finally:
            fence_s = time.monotonic() - t0
            await self._release(ckpt_id, epoch, fenced)
        StagingStore.gc(self.snapshot_root, self.cfg.rollout_checkpointing.keep_latest_k)
        self.stats["checkpoints"] += 1
        self.stats["fence_hold_s"] += fence_s
        metrics = {
            "checkpoint": snap.uri, "reason": reason, "step": self.step,
            "fence_hold_s": fence_s, "save_s": time.monotonic() - t0, "snapshot_s": snapshot_s,
            "episodes_recorded": len(records["episodes"]), **cuts,
        }  # fmt: skip
        self._log_checkpoint(metrics)
        return metrics

    async def _release(self, ckpt_id: str, epoch: int, fenced: list[WorkerHandle]) -> None:
        """Reopen admission and release every fence, whatever any one of them raises (a fence
        left held would stop terminal rows and chunk deletes until its lease ran out)."""
        steps = [self.env.resume.remote(ckpt_id)]
        steps += [w.actor.end_fence.remote(epoch) for w in fenced]
        for i, result in enumerate(await asyncio.gather(*steps, return_exceptions=True)):
            if isinstance(result, ProtocolError):
                continue  # a lapsed lease already reopened admission
            if isinstance(result, BaseException):
                what = "reopening admission" if i == 0 else f"releasing worker {i - 1}'s fence"
                self.stats["release_errors"] += 1
                log.warning("checkpoint %s: %s failed: %s", ckpt_id, what, one_line(result))

    def restore(self, snapshot: str | None = None, mode: str | None = None) -> dict | None:
        """Restore the store from a snapshot and load its episode records into the (fresh)
        environment; returns the ledger (with `snapshot` and the `skipped` newer snapshots and
        why), or None when nothing was ever published. `snapshot`: restore exactly this one
        (already chosen, e.g. by the driver); otherwise the newest usable one is chosen by
        `restore_mode`. A snapshot of another model, of a finer recovery level, or none usable
        among those found raises RestoreError; nothing is deleted."""
        restore_id = f"restore-{time.time_ns()}"
        ray.get(self.env.begin_restore.remote(restore_id))  # refused once calls were served
        records: list[dict] = []
        try:
            if snapshot is None:
                choice = select_snapshot(
                    self.snapshot_root,
                    mode or self.cfg.rollout_checkpointing.restore_mode,
                    self.cfg.rollout_recovery.target_level,
                )
                if choice is None:
                    return None
                snapshot, ledger, skipped = choice.snapshot, choice.ledger, choice.skipped
            else:
                ledger, skipped = read_ledger(snapshot), []
            check_model(snapshot, ledger, self.model)
            try:
                self.store.restore(snapshot)
            except SnapshotError as err:
                raise RestoreError(f"snapshot {snapshot} cannot be restored: {err}") from None
            records = ledger.get("episodes", [])
        finally:
            ray.get(self.env.end_restore.remote(restore_id, records))
        self.step = ledger["step"]
        return ledger | {"snapshot": snapshot, "skipped": skipped}

    def notify_trainer_checkpoint(self, step: int) -> dict:
        """After a trainer checkpoint: snapshot the data plane (so a restore never pairs
        rollouts with weights no checkpoint holds) and keep the newest keep_latest_k. A failed
        attempt counts like any other (returns `failed`); too many in a row raise."""
        if not self.cfg.checkpointing.save_data_plane:
            return {"snapshot_s": 0.0}
        self.step = step
        metrics = self._run(self._counted_checkpoint("trainer_checkpoint"))
        if metrics is None:
            return {"snapshot_s": None, "failed": self.failures_in_a_row}
        return {"snapshot_s": metrics["snapshot_s"], "snapshot": metrics["checkpoint"]}


def _fault_env() -> dict:
    """Actor options carrying an armed test fault (faults.py) into the actor; none when off."""
    env = faults.actor_env_vars()
    return {"runtime_env": {"env_vars": env}} if env else {}


def one_line(err: BaseException) -> str:
    """An exception as one line, unwrapped from Ray's task error."""
    cause = getattr(err, "cause", None) or err
    text = " ".join(str(cause).split()) or type(cause).__name__
    return text if len(text) < 500 else text[:497] + "..."


class SingleController:
    """The RolloutRecovery controller as a Ray actor (it owns the store and the workers, so
    they share its fate), used through the same calls as the in-process object."""

    def __init__(self, cfg: RolloutRecoveryConfig, ray_address: str = "local") -> None:
        init_ray(ray_address, log_to_driver=False)
        actor_cls = ray.remote(RolloutRecovery).options(
            num_cpus=0, max_concurrency=1, **_fault_env()
        )
        self.actor = actor_cls.remote(cfg, ray_address)
        ray.get(self.actor.__ray_call__.remote(lambda rr: rr.start() and None))

    def __getattr__(self, name: str):
        method = getattr(self.actor, name)

        def call(*args, **kwargs):
            try:
                return ray.get(method.remote(*args, **kwargs))
            except ray.exceptions.RayTaskError as err:
                if isinstance(err.cause, RecoveryError | OSError):
                    raise err.cause from None  # an expected failure: its one line, no trace
                raise

        return call

    def close(self) -> None:
        try:
            ray.get(self.actor.close.remote())
        finally:
            ray.kill(self.actor)
