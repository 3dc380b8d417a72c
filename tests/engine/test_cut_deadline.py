"""A cut is bounded by token_capture.control_timeout_s and leaves nothing half-staged."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
import ray

from rollout_recovery.data_plane import StagingStore
from rollout_recovery.generation import start_workers, stop_workers

pytestmark = pytest.mark.engine


class SlowStore:
    """Fault injection: delays staging puts while a flag file exists (picklable, so it can be
    handed to the worker actor like a real store)."""

    def __init__(self, store: StagingStore, flag: str, delay_s: float) -> None:
        self.store, self.flag, self.delay_s = store, flag, delay_s

    async def aput(self, partition, table):
        if Path(self.flag).exists():
            await asyncio.sleep(self.delay_s)
        return await self.store.aput(partition, table)

    async def aget(self, partition, keys):
        return await self.store.aget(partition, keys)

    async def adelete(self, partition, keys):
        return await self.store.adelete(partition, keys)


def test_cut_deadline_marks_unreached_calls_and_cleans_up(ray_session, tiny_cfg, tmp_path):
    store = StagingStore.create(num_shards=1)
    flag = tmp_path / "slow"
    cfg = tiny_cfg.model_copy(deep=True)
    cfg.token_capture.enabled = True
    cfg.token_capture.control_timeout_s = 0.5
    [worker] = start_workers(cfg, 1, store=SlowStore(store, str(flag), delay_s=2.0))
    rollouts = [f"dl-{i}" for i in range(4)]
    inv = {
        "checkpoint_id": "deadline",
        "calls": [{"rollout_id": r, "model_call_id": "c0"} for r in rollouts],
    }

    async def scenario():
        body = {
            "model": "policy",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 600,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        async with httpx.AsyncClient() as client:
            tasks = [
                asyncio.create_task(
                    client.post(
                        f"{worker.info.url}/v1/chat/completions",
                        json=body | {"vllm_xargs": {"rr_rollout_id": r, "rr_model_call_id": "c0"}},
                        timeout=300,
                    )
                )
                for r in rollouts
            ]
            await asyncio.sleep(0.3)
            flag.touch()
            t0 = time.monotonic()
            cut = worker.actor.cut.remote(inv)
            await asyncio.sleep(0.1)
            # Fence calls never queue behind a running cut.
            f0 = time.monotonic()
            await worker.actor.begin_fence.remote(3, 30)
            assert await worker.actor.end_fence.remote(3)
            fence_s = time.monotonic() - f0
            slow = await cut
            took = time.monotonic() - t0
            await asyncio.sleep(2.5)  # the late put lands, then is discarded
            staged_after_deadline = store.list("rollout_staging", "dl-")
            flag.unlink()
            inv2 = inv | {"checkpoint_id": "deadline-2"}
            fast = await worker.actor.cut.remote(inv2)
            for t in tasks:
                t.cancel()
            return slow, took, staged_after_deadline, fast, fence_s

    try:
        slow, took, staged, fast, fence_s = asyncio.run(scenario())
        assert took < 1.5, took
        assert fence_s < 0.3, fence_s
        assert {c["reason"] for c in slow["calls"]} == {"control_deadline"}
        assert all(c["disposition"] == "durable_failure" for c in slow["calls"])
        assert staged == []  # nothing half-staged stays behind
        # The next cut starts from scratch and succeeds.
        assert all(c["disposition"] == "durable_prefix" for c in fast["calls"])
        assert all(c["staging_keys"][0].endswith("/c000000") for c in fast["calls"])
        metrics = ray.get(worker.actor.capture_metrics.remote())
        assert metrics["cut_failure.control_deadline"] == 4
    finally:
        stop_workers([worker])
        store.shutdown()
