"""A cut is bounded by token_capture.control_timeout_s and leaves nothing half-staged."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from rollout_recovery.data_plane import StagingStore
from rollout_recovery.data_plane.schemas import table_to_chunk_rows
from rollout_recovery.generation import WorkerPool

pytestmark = pytest.mark.engine


class SlowStore:
    """Fault injection: delays staging puts while a flag file exists, and appends a line to
    `<flag>.landed` as each delayed put lands (picklable, so it can be handed to the worker
    actor like a real store)."""

    def __init__(self, store: StagingStore, flag: str, delay_s: float) -> None:
        self.store, self.flag, self.delay_s = store, flag, delay_s

    async def aput(self, partition, table):
        if not Path(self.flag).exists():
            return await self.store.aput(partition, table)
        await asyncio.sleep(self.delay_s)
        out = await self.store.aput(partition, table)
        with open(f"{self.flag}.landed", "a") as fh:
            fh.write("landed\n")
        return out

    async def aget(self, partition, keys):
        return await self.store.aget(partition, keys)

    async def adelete(self, partition, keys):
        return await self.store.adelete(partition, keys)


@pytest.fixture(scope="module")
def slow_worker(ray_session, tiny_cfg, tmp_path_factory):
    """A worker whose staging puts take 4 s while a flag file exists; cuts time out at 1.5 s.
    Both timers run on the worker's one event loop, so the deadline fires first whatever the
    load; the margins are for the test's own calls (a fence while the cut runs)."""
    store = StagingStore.create(num_shards=1)
    flag = tmp_path_factory.mktemp("slow") / "flag"
    cfg = tiny_cfg.model_copy(deep=True)
    cfg.token_capture.enabled = True
    cfg.token_capture.control_timeout_s = 1.5
    pool = WorkerPool.start(cfg, 1, store=SlowStore(store, str(flag), delay_s=4.0))
    yield pool[0], store, flag
    pool.stop()
    store.shutdown()


def _requests(client: httpx.AsyncClient, url: str, rollouts: list[str]) -> list[asyncio.Task]:
    body = {
        "model": "policy",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 900,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    return [
        asyncio.create_task(
            client.post(
                f"{url}/v1/chat/completions",
                json=body | {"vllm_xargs": {"rr_rollout_id": r, "rr_model_call_id": "c0"}},
                timeout=300,
            )
        )
        for r in rollouts
    ]


def _landed(flag: Path) -> int:
    path = Path(f"{flag}.landed")
    return len(path.read_text().splitlines()) if path.exists() else 0


async def _until_landed(flag: Path, n: int, timeout_s: float = 60.0) -> None:
    """Wait until `n` delayed puts have landed in all (a late put, then its cleanup's turn)."""
    deadline = time.monotonic() + timeout_s
    while _landed(flag) < n:
        assert time.monotonic() < deadline, f"{_landed(flag)} of {n} delayed puts landed"
        await asyncio.sleep(0.05)


async def _decoding(worker, rollouts: list[str], timeout_s: float = 120.0) -> None:
    """Wait until the engine has sampled a token of every call (its own attempt records say
    so): a cut that comes before finds nothing to cut, and a fixed sleep was that on a loaded
    machine."""
    deadline = time.monotonic() + timeout_s
    while True:
        page = await worker.acall_attempts(0)
        started = {a["rollout_id"] for a in page["attempts"] if a["decoded_tokens"] > 0}
        if set(rollouts) <= started:
            return
        assert time.monotonic() < deadline, f"not decoding: {sorted(set(rollouts) - started)}"
        await asyncio.sleep(0.05)


def test_cut_deadline_marks_unreached_calls_and_cleans_up(slow_worker):
    worker, store, flag = slow_worker
    rollouts = [f"dl-{i}" for i in range(4)]
    inv = {
        "checkpoint_id": "deadline",
        "calls": [{"rollout_id": r, "model_call_id": "c0"} for r in rollouts],
    }

    async def scenario():
        async with httpx.AsyncClient() as client:
            tasks = _requests(client, worker.info.url, rollouts)
            await _decoding(worker, rollouts)
            landed = _landed(flag)
            flag.touch()
            cut = asyncio.create_task(worker.acut(inv))  # runs while the fence calls are made
            await asyncio.sleep(0.1)
            # Fence calls never queue behind a running cut: they return while it still runs.
            await worker.abegin_fence(3, 30)
            assert await worker.aend_fence(3)
            fenced_while_cutting = not cut.done()
            slow = await cut
            # The cut returned at its deadline, not after its put: that put has not landed.
            returned_first = _landed(flag) == landed
            await _until_landed(flag, landed + 1)  # the late put lands, then is discarded
            deadline = time.monotonic() + 60
            while (staged_after_deadline := store.list("rollout_staging", "dl-")) and (
                time.monotonic() < deadline
            ):
                await asyncio.sleep(0.05)  # its cleanup, queued behind it on the worker
            flag.unlink()
            inv2 = inv | {"checkpoint_id": "deadline-2"}
            fast = await worker.acut(inv2)
            for t in tasks:
                t.cancel()
            return slow, returned_first, staged_after_deadline, fast, fenced_while_cutting

    slow, returned_first, staged, fast, fenced_while_cutting = asyncio.run(scenario())
    assert returned_first, "the cut waited for its slow put instead of its deadline"
    assert fenced_while_cutting, "the fence calls queued behind the running cut"
    assert {c["reason"] for c in slow["calls"]} == {"control_deadline"}
    assert all(c["disposition"] == "durable_failure" for c in slow["calls"])
    assert staged == []  # nothing half-staged stays behind
    # The next cut starts from scratch and succeeds.
    assert all(c["disposition"] == "durable_prefix" for c in fast["calls"])
    assert all(c["staging_keys"][0].endswith("/c000000") for c in fast["calls"])
    metrics = worker.capture_metrics()
    assert metrics["cut_failure.control_deadline"] == 4


def test_a_late_cleanup_never_deletes_what_a_later_cut_made_durable(slow_worker):
    """A cut misses its deadline while its put is still in flight; the next cut of the same
    calls reuses the chunk keys. The late put and its cleanup must not overwrite or delete
    rows that a later receipt reported durable."""
    worker, store, flag = slow_worker
    rollouts = [f"late-{i}" for i in range(3)]
    inv = {"calls": [{"rollout_id": r, "model_call_id": "c0"} for r in rollouts]}
    epoch = worker.fence_state()["highest_epoch"] + 1

    async def scenario():
        async with httpx.AsyncClient() as client:
            tasks = _requests(client, worker.info.url, rollouts)
            await _decoding(worker, rollouts)
            await worker.abegin_fence(epoch, 60)  # finished calls keep their chunks
            landed = _landed(flag)
            flag.touch()
            late = await worker.acut(inv | {"checkpoint_id": "late-1"})
            flag.unlink()  # the next puts are fast; the first one is still sleeping
            receipts = [await worker.acut(inv | {"checkpoint_id": "late-2"})]
            await _until_landed(flag, landed + 1)  # the late put lands
            await asyncio.sleep(0.5)  # then its cleanup runs
            receipts.append(await worker.acut(inv | {"checkpoint_id": "late-3"}))
            await asyncio.sleep(0.5)
            for t in tasks:
                t.cancel()
            return late, receipts

    try:
        late, receipts = asyncio.run(scenario())
        assert {c["reason"] for c in late["calls"]} == {"control_deadline"}
        durable = [c for r in receipts for c in r["calls"] if c["disposition"] == "durable_prefix"]
        assert len(durable) >= len(rollouts)  # the last cut, at least, is durable
        for c in durable:
            table, missing = store.get("rollout_staging", c["staging_keys"])
            assert missing == [], (c, missing)
            rows = table_to_chunk_rows(table)
            assert rows[-1].digest.hex() == c["prefix_digest"]  # not overwritten by the late put
            assert rows[-1].cum_len == c["prefix_token_count"]
        second = receipts[0]["calls"]
        assert {c["reason"] for c in second if c["disposition"] != "durable_prefix"} <= {
            "cleanup_pending"
        }
    finally:
        worker.end_fence(epoch)
