"""A checkpoint attempt cancelled part-way (the cadence is cancelled when generation ends)
still ends its checkpoint: admission reopens and the fences lift before the cancellation
goes on, so the next attempt succeeds. Real coordinator, store and environment actor; no
engines."""

from __future__ import annotations

import asyncio

import pytest

from tests.cluster.store_helpers import coordinator_without_engines

pytestmark = pytest.mark.cluster


async def test_an_attempt_cancelled_while_releasing_still_reopens_admission(make_store, tmp_path):
    with coordinator_without_engines(make_store(1), tmp_path / "run") as (
        coordinator,
        env,
        storage,
    ):
        entered, go = asyncio.Event(), asyncio.Event()
        real_reopen = env.reopen

        async def held_reopen(ckpt: str) -> None:
            entered.set()
            await go.wait()
            await real_reopen(ckpt)

        env.reopen = held_reopen
        attempt = asyncio.ensure_future(coordinator.attempt("cadence"))
        async with asyncio.timeout(60):  # the snapshot is published; releasing
            await entered.wait()
        attempt.cancel()
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await attempt
        env.reopen = real_reopen
        after = await coordinator.counted("trainer_checkpoint")
        assert after is not None, storage.read_lines("checkpoints.jsonl")[-1:]
        assert coordinator.failures_in_a_row == 0
