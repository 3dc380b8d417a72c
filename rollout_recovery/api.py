"""RolloutRecovery: the calls a trainer makes, built from one config.

start the data plane and the workers; submit prompt groups (rollouts become `replay` rows);
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray

from rollout_recovery.config import RolloutRecoveryConfig
from rollout_recovery.data_plane import (
    LeaseResult,
    ReplayRow,
    SnapshotError,
    StagingStore,
    replay_rows_to_table,
    table_to_replay_rows,
)
from rollout_recovery.data_plane.snapshot_io import published_uris
from rollout_recovery.environment.lineage import LineageStore
from rollout_recovery.environment.model_client import ModelCallClient
from rollout_recovery.environment.participant import CheckpointParticipant, ProtocolError
from rollout_recovery.environment.token_sink import StoreTokenSink
from rollout_recovery.generation import WorkerHandle, start_workers, stop_workers
from rollout_recovery.runtime import init_ray
from rollout_recovery.tiny_model import resolve_model_path

log = logging.getLogger("rollout_recovery")
LEDGER = "ledger.json"


@dataclass
class GroupResult:
    group_id: str
    rows: list[ReplayRow]
    rewards: list[float]
    generated_tokens: int


class RolloutRecovery:
    def __init__(self, cfg: RolloutRecoveryConfig, ray_address: str = "local") -> None:
        self.cfg = cfg
        self.ray_address = ray_address
        self.store: StagingStore | None = None
        self.workers: list[WorkerHandle] = []
        self.clients: list[ModelCallClient] = []
        self.weight_version = 0
        self.model_dir = resolve_model_path(cfg.policy.model_path)
        self._rr = itertools.count()
        # One private loop, on its own thread, for every async call: HTTP connection pools
        # belong to a loop, and the caller's thread may already run one (a Ray actor does).
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.step = 0  # the trainer step whose rollouts are being generated
        self._inflight: dict[str, tuple[int, int, int]] = {}  # rollout -> (worker, attempt, limit)
        self._epoch = itertools.count(1)
        self.snapshot_root = str(Path(cfg.checkpointing.checkpoint_dir) / "data_plane")
        self.checkpoint_log = Path(cfg.checkpointing.checkpoint_dir) / "checkpoints.jsonl"
        self.participant = CheckpointParticipant()
        self.restored_calls = 0
        self.restored_prefix_tokens = 0
        self.restored_tail_tokens = 0  # decoded after a prefix resume
        self.regenerated_tokens = 0  # decoded again from scratch after a restore

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> RolloutRecovery:
        init_ray(self.ray_address, log_to_driver=False)
        self.store = StagingStore.create(num_shards=1)
        self.workers = start_workers(self.cfg, store=self.store)
        sink, lineage = StoreTokenSink(self.store), LineageStore()
        self.clients = [
            ModelCallClient(w.info.url, w.info.served_model_name, sink, lineage)
            for w in self.workers
        ]
        return self

    def close(self) -> None:
        async def close_clients():
            for c in self.clients:
                await c.aclose()

        self._run(close_clients())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if self.workers:
            stop_workers(self.workers)
        if self.store is not None:
            self.store.shutdown()
        self.workers, self.store = [], None

    # ------------------------------------------------------------------ rollouts

    async def _generate(
        self, group_id: str, messages, gen_index: int, seed: int, reward_fn, resume: dict | None
    ):
        worker = next(self._rr) % len(self.clients)
        client = self.clients[worker]
        g = self.cfg.policy.generation
        rollout_id = f"{group_id}-g{gen_index}"
        attempt = resume["attempt"] + 1 if resume else 0
        xargs = {"rr_seed": seed, "rr_temperature": g.temperature}
        if resume and resume.get("keys"):
            xargs |= {
                "rr_resume_keys": resume["keys"],
                "rr_resume_tokens": resume["tokens"],
                "rr_resume_digest": resume["digest"],
                "rr_resume_limit": g.max_new_tokens,
            }
            self.restored_calls += 1
            self.restored_prefix_tokens += resume["tokens"]
        await self.participant.admitted()  # parked while a checkpoint is being taken
        self._inflight[rollout_id] = (worker, attempt, g.max_new_tokens)
        try:
            res = await client.call(
                rollout_id,
                "c0",
                messages,
                attempt=attempt,
                temperature=0.0,
                max_tokens=g.max_new_tokens,
                ignore_eos=True,
                vllm_xargs=xargs,
            )
        finally:
            self._inflight.pop(rollout_id, None)
        e = res.entry
        prompt, gen = e.prompt_token_ids, e.generated_token_ids
        if resume and resume.get("keys"):
            self.restored_tail_tokens += len(gen) - resume["tokens"]
        elif resume:
            self.regenerated_tokens += len(gen)
        reward = float(reward_fn(res.assistant_message.get("content") or ""))
        row = ReplayRow(
            key=f"{group_id}/{gen_index:03d}",
            rollout_id=rollout_id,
            group_id=group_id,
            generation_index=gen_index,
            prompt_len=len(prompt),
            token_ids=np.asarray([*prompt, *gen], np.int32),
            loss_mask=np.asarray([0] * len(prompt) + [1] * len(gen), np.int8),
            logprobs=np.asarray([0.0] * len(prompt) + list(e.generated_logprobs), np.float32),
            reward=reward,
            weight_version_min=self.weight_version,
            weight_version_max=self.weight_version,
        )
        # Durable as soon as it is finished: a crash later does not regenerate it.
        await self.store.aput("replay", replay_rows_to_table([row]))
        return row, len(gen)

    def submit_groups(
        self,
        groups: list[tuple[str, list[dict]]],
        seeds: Callable[[int, int], int],
        reward_fn: Callable[[str], float],
        resume: dict[str, dict] | None = None,
    ) -> list[GroupResult]:
        """Generate `grpo.generations_per_prompt` rollouts per (group id, messages) pair,
        concurrently, and put them into the `replay` partition. `seeds(group, gen)` gives each
        generation its own sampler seed, so runs are reproducible. Rollouts whose replay row is
        already stored (restored from a snapshot) are not generated again; `resume` maps a
        rollout id to its continuation from the ledger (attempt, staging keys, tokens, digest)."""
        n = self.cfg.grpo.generations_per_prompt
        resume = resume or {}
        done = set(self.store.list("replay"))

        async def existing(key: str):
            table, _ = await self.store.aget("replay", [key])

            return table_to_replay_rows(table)[0], 0

        def job(gi: int, gid: str, msgs, i: int):
            if f"{gid}/{i:03d}" in done:
                return existing(f"{gid}/{i:03d}")
            return self._generate(gid, msgs, i, seeds(gi, i), reward_fn, resume.get(f"{gid}-g{i}"))

        async def run():
            jobs = [
                job(gi, gid, msgs, i) for gi, (gid, msgs) in enumerate(groups) for i in range(n)
            ]
            cadence = None
            if self.cfg.rollout_recovery.target_level == "prefix":
                cadence = asyncio.ensure_future(self._checkpoint_cadence())
            try:
                return await asyncio.gather(*jobs)
            finally:
                if cadence is not None:
                    cadence.cancel()
                    await asyncio.gather(cadence, return_exceptions=True)

        out = self._run(run())
        results = []
        for gi, (gid, _) in enumerate(groups):
            part = out[gi * n : (gi + 1) * n]
            rows, rewards = [r for r, _ in part], [r.reward for r, _ in part]
            results.append(GroupResult(gid, rows, rewards, sum(t for _, t in part)))
        return results

    # ------------------------------------------------------------------ training side

    def take_batch(self, max_rows: int, ttl_s: float = 600.0) -> LeaseResult:
        return self.store.lease("replay", "trainer", max_rows, ttl_s)

    def ack(self, lease: LeaseResult) -> int:
        return self.store.ack(lease.lease_id)

    def set_step(self, step: int) -> None:
        """The trainer step whose rollouts are generated next (recorded in ledgers)."""
        self.step = step

    def counters(self) -> dict[str, int]:
        return {
            "restored_calls": self.restored_calls,
            "restored_prefix_tokens": self.restored_prefix_tokens,
            "tail_tokens": self.restored_tail_tokens,
            "regenerated_tokens": self.regenerated_tokens,
        }

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
        """Fence every worker, cut in-flight calls, snapshot the store with the ledger (manifest
        last), release the fences. Returns the per-checkpoint metrics (also appended to
        checkpoints.jsonl)."""
        t0 = time.monotonic()
        epoch = next(self._epoch)
        lease_s = self.cfg.token_capture.control_timeout_s * 3
        ckpt_id = f"ckpt-{self.step}-{epoch}"
        await asyncio.gather(*(w.actor.begin_fence.remote(epoch, lease_s) for w in self.workers))
        self.participant.prepare(ckpt_id, lease_s)
        try:
            inflight = dict(self._inflight)
            per_worker: dict[int, list[dict]] = {}
            for rid, (worker, attempt, _) in inflight.items():
                per_worker.setdefault(worker, []).append(
                    {"rollout_id": rid, "model_call_id": "c0", "attempt": attempt}
                )
            receipts = await asyncio.gather(*(
                self.workers[w].actor.cut.remote({"checkpoint_id": ckpt_id, "calls": calls})
                for w, calls in per_worker.items()
            ))  # fmt: skip
            continuations, reasons = {}, {}
            for receipt in receipts:
                for c in receipt["calls"]:
                    if c["disposition"] == "durable_prefix" and c["cut_kind"] == "active_prefix":
                        continuations[c["rollout_id"]] = {
                            "attempt": c["attempt"], "keys": c["staging_keys"],
                            "tokens": c["prefix_token_count"], "digest": c["prefix_digest"],
                        }  # fmt: skip
                    else:  # regenerated after a restore, as the next attempt
                        continuations[c["rollout_id"]] = {"attempt": c["attempt"]}
                        why = c["reason"] or c["cut_kind"]
                        reasons[why] = reasons.get(why, 0) + 1
            self.participant.prepared(ckpt_id)
            ledger = {"format": 1, "step": self.step, "weight_version": self.weight_version,
                      "continuations": continuations, "reason": reason,
                      "level": self.cfg.rollout_recovery.target_level}  # fmt: skip
            s0 = time.monotonic()
            snap = await self.store.asnapshot(
                self.snapshot_root,
                meta={"trainer_step": str(self.step), "reason": reason},
                sidecars={LEDGER: json.dumps(ledger, sort_keys=True).encode()},
            )
            snapshot_s = time.monotonic() - s0
            self.participant.commit(ckpt_id)
        finally:
            fence_s = time.monotonic() - t0
            with contextlib.suppress(ProtocolError):  # a lapsed lease already reopened it
                self.participant.resume(ckpt_id)
            await asyncio.gather(*(w.actor.end_fence.remote(epoch) for w in self.workers))
        StagingStore.gc(self.snapshot_root, self.cfg.rollout_checkpointing.keep_latest_k)
        metrics = {
            "checkpoint": snap.uri, "reason": reason, "step": self.step,
            "fence_hold_s": fence_s, "save_s": time.monotonic() - t0, "snapshot_s": snapshot_s,
            "calls_cut": sum(1 for c in continuations.values() if "keys" in c),
            "calls_not_cut": reasons,
        }  # fmt: skip
        with open(self.checkpoint_log, "a") as fh:
            fh.write(json.dumps(metrics) + "\n")
        return metrics

    def restore(self, mode: str | None = None) -> dict | None:
        """Restore the store from the snapshot `restore_snapshot` selects; returns its ledger,
        or None when there is nothing to restore."""
        self.participant.restore(self.snapshot_root)  # refused once calls were served
        try:
            picked = restore_snapshot(
                self.store,
                self.snapshot_root,
                mode or self.cfg.rollout_checkpointing.restore_mode,
                self.cfg.rollout_recovery.target_level,
            )
        finally:
            self.participant.restored(self.snapshot_root)
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
        if ledger["continuations"] and LEVELS.index(taken) > LEVELS.index(level):
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
