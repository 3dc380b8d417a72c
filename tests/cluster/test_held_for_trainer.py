"""Asynchronous GRPO's hold (controller/coordinator.py, `ack_held`): from the ack of a trained
batch until its trainer checkpoint, the cadence takes no snapshot, which would pair the older
trainer checkpoint with a buffer that no longer holds the trained rows; a preemption's final
snapshot is refused there, and once published is the last. A real coordinator, store and
environment actor, no engines."""

from __future__ import annotations

import pytest

from rollout_recovery.data_plane import StagingStore
from rollout_recovery.errors import RecoveryError
from tests.cluster.store_helpers import coordinator_without_engines


async def test_the_cadence_takes_no_snapshot_between_an_ack_and_its_trainer_checkpoint(
    make_store, tmp_path
):
    with coordinator_without_engines(make_store(1), tmp_path / "run") as (coordinator, _, _):
        first = await coordinator.counted("trainer_checkpoint")
        acked = []

        async def ack() -> int:
            acked.append(True)
            return 4

        assert await coordinator.ack_held(ack) == 4 and acked == [True]
        assert await coordinator.attempt("cadence") is None  # held: skipped, counted
        assert coordinator.metrics.controller["checkpoints_skipped.held_for_trainer"] == 1
        assert StagingStore.latest(coordinator.snapshot_root) == first["checkpoint"]
        paired = await coordinator.attempt("trainer_checkpoint")  # releases the hold
        assert paired is not None and paired["checkpoint"] != first["checkpoint"]
        again = await coordinator.attempt("cadence")
        assert (
            again is not None
            and StagingStore.latest(coordinator.snapshot_root) == (again["checkpoint"])
        )


async def test_a_preemption_snapshot_is_the_last_and_none_is_taken_while_held(make_store, tmp_path):
    """A preemption's attempt while held for the trainer is refused (its snapshot would pair
    the older checkpoint with the acked buffer: the last published one stays the newest); once
    one is published, nothing newer is, whatever the reason."""

    async def ack() -> int:
        return 0

    with coordinator_without_engines(make_store(1), tmp_path / "run") as (coordinator, _, _):
        first = await coordinator.counted("trainer_checkpoint")
        await coordinator.ack_held(ack)
        with pytest.raises(RecoveryError, match="not yet written the checkpoint"):
            await coordinator.attempt("preemption")
        assert StagingStore.latest(coordinator.snapshot_root) == first["checkpoint"]
        await coordinator.attempt("trainer_checkpoint")
        final = await coordinator.attempt("preemption", timeout_s=5.0)
        assert final is not None and final["reason"] == "preemption"
        for reason in ("cadence", "trainer_checkpoint", "preemption"):
            assert await coordinator.attempt(reason) is None
        assert coordinator.metrics.controller["checkpoints_skipped.after_preemption"] == 3
        assert StagingStore.latest(coordinator.snapshot_root) == final["checkpoint"]
