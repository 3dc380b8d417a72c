"""RolloutRecovery: the calls a trainer makes, built from one config.

start the data plane and the workers; submit prompt groups (rollouts become `replay` rows);
take a training batch (a lease, acked after the optimizer step); push new weights; notify a
trainer checkpoint (a data-plane snapshot follows it). The shipped GRPO driver uses only this.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray

from rollout_recovery.config import RolloutRecoveryConfig
from rollout_recovery.data_plane import LeaseResult, ReplayRow, StagingStore, replay_rows_to_table
from rollout_recovery.environment.lineage import LineageStore
from rollout_recovery.environment.model_client import ModelCallClient
from rollout_recovery.environment.token_sink import StoreTokenSink
from rollout_recovery.generation import WorkerHandle, start_workers, stop_workers
from rollout_recovery.runtime import init_ray
from rollout_recovery.tiny_model import resolve_model_path


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
        # One private loop for every async call: HTTP connection pools belong to a loop.
        self._loop = asyncio.new_event_loop()

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

        self._loop.run_until_complete(close_clients())
        self._loop.close()
        if self.workers:
            stop_workers(self.workers)
        if self.store is not None:
            self.store.shutdown()
        self.workers, self.store = [], None

    # ------------------------------------------------------------------ rollouts

    async def _generate(self, group_id: str, messages, gen_index: int, seed: int, reward_fn):
        client = self.clients[next(self._rr) % len(self.clients)]
        g = self.cfg.policy.generation
        rollout_id = f"{group_id}-g{gen_index}"
        res = await client.call(
            rollout_id,
            "c0",
            messages,
            temperature=0.0,
            max_tokens=g.max_new_tokens,
            vllm_xargs={"rr_seed": seed, "rr_temperature": g.temperature},
        )
        e = res.entry
        prompt, gen = e.prompt_token_ids, e.generated_token_ids
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
        return row, len(gen)

    def submit_groups(
        self,
        groups: list[tuple[str, list[dict]]],
        seeds: Callable[[int, int], int],
        reward_fn: Callable[[str], float],
    ) -> list[GroupResult]:
        """Generate `grpo.generations_per_prompt` rollouts per (group id, messages) pair,
        concurrently, and put them into the `replay` partition. `seeds(group, gen)` gives each
        generation its own sampler seed, so runs are reproducible."""
        n = self.cfg.grpo.generations_per_prompt

        async def run():
            jobs = [
                self._generate(gid, msgs, i, seeds(gi, i), reward_fn)
                for gi, (gid, msgs) in enumerate(groups)
                for i in range(n)
            ]
            return await asyncio.gather(*jobs)

        out = self._loop.run_until_complete(run())
        rows = [r for r, _ in out]
        self.store.put("replay", replay_rows_to_table(rows))
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

    def push_weights(self, weights_dir: str | Path) -> int:
        self.weight_version += 1
        ray.get([w.actor.push_weights.remote(str(weights_dir), self.weight_version)
                 for w in self.workers])  # fmt: skip
        return self.weight_version

    def notify_trainer_checkpoint(self, step: int) -> dict:
        """After a trainer checkpoint: snapshot the data plane (so a restore never pairs
        rollouts with weights no checkpoint holds) and keep the newest keep_latest_k."""
        if not self.cfg.checkpointing.save_data_plane:
            return {"snapshot_s": 0.0}
        t0 = time.monotonic()
        root = str(Path(self.cfg.checkpointing.checkpoint_dir) / "data_plane")
        snap = self.store.snapshot(root, meta={"trainer_step": str(step)})
        StagingStore.gc(root, self.cfg.rollout_checkpointing.keep_latest_k)
        return {"snapshot_s": time.monotonic() - t0, "snapshot": snap.uri}
