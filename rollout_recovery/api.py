"""RolloutRecovery: the calls a trainer makes, built from one config.

start the data plane, the workers and the environment (or restore them from a snapshot);
submit prompt groups (the environment's finished episodes become `replay` rows);
take a training batch (a lease, acked after the optimizer step); push new weights; notify a
trainer checkpoint (a data-plane snapshot follows it). The shipped GRPO driver uses only this.
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

from rollout_recovery.config import RolloutRecoveryConfig
from rollout_recovery.data_plane import (
    LeaseResult,
    ReplayRow,
    SnapshotError,
    StagingStore,
)
from rollout_recovery.data_plane.snapshot_io import published_uris
from rollout_recovery.environment.participant import ProtocolError
from rollout_recovery.environment.rollout_env import RolloutEnvironmentActor
from rollout_recovery.generation import WorkerHandle, start_workers, stop_workers
from rollout_recovery.runtime import init_ray
from rollout_recovery.tiny_model import resolve_model_path

log = logging.getLogger("rollout_recovery")
LEDGER = "ledger.json"
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
        self.model_dir = resolve_model_path(cfg.policy.model_path)
        # One private loop, on its own thread, for every async call: the caller's thread may
        # already run one (a Ray actor does).
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.step = 0  # the trainer step whose rollouts are being generated
        self._epoch = itertools.count(1)
        self.snapshot_root = str(Path(cfg.checkpointing.checkpoint_dir) / "data_plane")
        self.checkpoint_log = Path(cfg.checkpointing.checkpoint_dir) / "checkpoints.jsonl"
        self.stats: Counter[str] = Counter()  # checkpoints, failures, fence hold seconds

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> RolloutRecovery:
        init_ray(self.ray_address, log_to_driver=False)
        self.store = StagingStore.create(num_shards=1)
        self.workers = start_workers(self.cfg, store=self.store)
        env_cls = ray.remote(RolloutEnvironmentActor).options(num_cpus=0, max_concurrency=16)
        self.env = env_cls.remote(self.cfg, self.workers, self.store)
        ray.get(self.env.counters.remote())  # constructed
        return self

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
        after = ("resume.resumed", "resume.finished_without_decoding", "resume.prefix_tokens")
        refused = sum(v for k, v in seen.items() if k not in after)
        return {"worker_resumes_accepted": accepted, "worker_resumes_refused": refused}

    def push_weights(self, weights_dir: str | Path, version: int | None = None) -> int:
        """Load new weights into every worker as the next weight version (or `version`, when
        a restore re-establishes a checkpoint's weights)."""
        self.weight_version = self.weight_version + 1 if version is None else version
        ray.get([w.actor.push_weights.remote(str(weights_dir), self.weight_version)
                 for w in self.workers])  # fmt: skip
        return self.weight_version

    # ------------------------------------------------------------------ checkpoints

    async def _checkpoint_cadence(self) -> None:
        interval = self.cfg.rollout_checkpointing.snapshot_attempt_interval_s
        failures = 0
        while True:
            await asyncio.sleep(interval)
            try:
                await self.checkpoint("cadence")
                failures = 0
            except Exception as err:
                failures += 1
                log.warning("rollout checkpoint attempt failed (%s): %s", failures, err)
                if failures >= self.cfg.rollout_checkpointing.max_consecutive_failures:
                    raise

    async def checkpoint(self, reason: str) -> dict:
        """One checkpoint attempt (DESIGN.md §4): fence the workers, prepare the environment
        (admission closed, in-flight calls cut), commit its episode records, snapshot the
        store with the ledger (manifest last), then release the fences and reopen admission,
        also when the attempt fails. Returns the per-checkpoint metrics (also appended to
        checkpoints.jsonl)."""
        t0 = time.monotonic()
        epoch = next(self._epoch)
        timeout = self.cfg.rollout_checkpointing.attempt_timeout_s
        lease_s = max(self.cfg.token_capture.control_timeout_s * 3, timeout + 5)
        ckpt_id = f"ckpt-{self.step}-{epoch}"
        fenced = self.workers if self.cfg.token_capture.enabled else []

        async def attempt():
            await asyncio.gather(*(w.actor.begin_fence.remote(epoch, lease_s) for w in fenced))
            cuts = await self.env.prepare.remote(ckpt_id, lease_s)
            records = await self.env.commit.remote(ckpt_id)
            ledger = {
                "format": 2,
                "step": self.step,
                "weight_version": self.weight_version,
                "reason": reason,
                "level": self.cfg.rollout_recovery.target_level,
                **records,  # episodes, continuations
            }
            s0 = time.monotonic()
            snap = await self.store.asnapshot(
                self.snapshot_root,
                meta={"trainer_step": str(self.step), "reason": reason},
                sidecars={LEDGER: json.dumps(ledger, sort_keys=True).encode()},
                deadline=t0 + timeout,
            )
            return cuts, records, snap, time.monotonic() - s0

        try:
            cuts, records, snap, snapshot_s = await asyncio.wait_for(attempt(), timeout)
        except Exception as err:
            self.stats["checkpoint_failures"] += 1
            if isinstance(err, TimeoutError):
                raise TimeoutError(
                    f"checkpoint {ckpt_id} took longer than rollout_checkpointing."
                    f"attempt_timeout_s={timeout}; aborted, nothing published"
                ) from None
            raise
        finally:
            fence_s = time.monotonic() - t0
            with contextlib.suppress(ProtocolError):  # a lapsed lease already reopened it
                await self.env.resume.remote(ckpt_id)
            await asyncio.gather(*(w.actor.end_fence.remote(epoch) for w in fenced))
        StagingStore.gc(self.snapshot_root, self.cfg.rollout_checkpointing.keep_latest_k)
        self.stats["checkpoints"] += 1
        self.stats["fence_hold_s"] += fence_s
        metrics = {
            "checkpoint": snap.uri, "reason": reason, "step": self.step,
            "fence_hold_s": fence_s, "save_s": time.monotonic() - t0, "snapshot_s": snapshot_s,
            "episodes_recorded": len(records["episodes"]), **cuts,
        }  # fmt: skip
        with open(self.checkpoint_log, "a") as fh:
            fh.write(json.dumps(metrics) + "\n")
        return metrics

    def restore(self, mode: str | None = None) -> dict | None:
        """Restore the store from the snapshot `restore_snapshot` selects and load its episode
        records into the (fresh) environment; returns the ledger, or None when there is
        nothing to restore."""
        restore_id = f"restore-{time.time_ns()}"
        ray.get(self.env.begin_restore.remote(restore_id))  # refused once calls were served
        records: list[dict] = []
        try:
            picked = restore_snapshot(
                self.store,
                self.snapshot_root,
                mode or self.cfg.rollout_checkpointing.restore_mode,
                self.cfg.rollout_recovery.target_level,
            )
            if picked is not None:
                records = picked[1].get("episodes", [])
        finally:
            ray.get(self.env.end_restore.remote(restore_id, records))
        if picked is None:
            return None
        uri, ledger = picked
        self.step = ledger["step"]
        return ledger | {"snapshot": uri}

    def notify_trainer_checkpoint(self, step: int) -> dict:
        """After a trainer checkpoint: snapshot the data plane (so a restore never pairs
        rollouts with weights no checkpoint holds) and keep the newest keep_latest_k."""
        if not self.cfg.checkpointing.save_data_plane:
            return {"snapshot_s": 0.0}
        self.step = step
        metrics = self._run(self.checkpoint("trainer_checkpoint"))
        return {"snapshot_s": metrics["snapshot_s"], "snapshot": metrics["checkpoint"]}


LEVELS = ("none", "turn", "prefix")


def restore_snapshot(store: StagingStore, root: str, mode: str, level: str):
    """Pick and load a snapshot: the newest published one (`mode="trainer_checkpoint"`: the
    newest taken right after a trainer checkpoint). One that is corrupt is skipped, with a
    message, for the one before it. A snapshot holding work of a finer recovery level than
    `level` is refused with the setting that restores it. Returns (uri, ledger) or None."""
    for uri in reversed(published_uris(root)):
        try:
            manifest = StagingStore.manifest(uri)
            if mode == "trainer_checkpoint" and manifest.body.meta.get("reason") != (
                "trainer_checkpoint"
            ):
                continue
            ledger = json.loads(StagingStore.read_sidecar(uri, LEDGER))
        except SnapshotError as err:
            print(f"Snapshot {uri} is unusable ({err}); falling back to the previous one")
            continue
        taken = ledger.get("level", "none")
        unfinished = ledger["continuations"] or ledger.get("episodes")
        if unfinished and LEVELS.index(taken) > LEVELS.index(level):
            raise RuntimeError(
                f"snapshot {uri} holds {taken}-level recovery state; restore it with "
                f"rollout_recovery.target_level={taken}, or use "
                "rollout_checkpointing.restore_mode=trainer_checkpoint"
            )
        try:
            store.restore(uri)
        except SnapshotError as err:
            print(f"Snapshot {uri} is unusable ({err}); falling back to the previous one")
            continue
        return uri, ledger
    return None


class SingleController:
    """The RolloutRecovery controller as a Ray actor (it owns the store and the workers, so
    they share its fate), used through the same calls as the in-process object."""

    def __init__(self, cfg: RolloutRecoveryConfig, ray_address: str = "local") -> None:
        init_ray(ray_address, log_to_driver=False)
        actor_cls = ray.remote(RolloutRecovery).options(num_cpus=0, max_concurrency=1)
        self.actor = actor_cls.remote(cfg, ray_address)
        ray.get(self.actor.__ray_call__.remote(lambda rr: rr.start() and None))

    def __getattr__(self, name: str):
        method = getattr(self.actor, name)
        return lambda *args, **kwargs: ray.get(method.remote(*args, **kwargs))

    def close(self) -> None:
        try:
            ray.get(self.actor.close.remote())
        finally:
            ray.kill(self.actor)
