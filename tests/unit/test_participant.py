from __future__ import annotations

import asyncio

import pytest

from rollout_recovery.environment.participant import (
    CheckpointParticipant,
    ParticipantState,
    ProtocolError,
)


def test_checkpoint_path_and_admission():
    async def scenario():
        p = CheckpointParticipant()
        await p.admitted()  # open: passes at once
        p.prepare("c1", lease_s=30)
        waiter = asyncio.create_task(p.admitted())
        await asyncio.sleep(0.1)
        assert not waiter.done()  # parked at the turn boundary
        p.prepared("c1")
        with pytest.raises(ProtocolError, match="'c0'"):
            p.commit("c0")  # a late message from another checkpoint
        p.commit("c1")
        assert p.state == ParticipantState.COMMITTED and not waiter.done()
        p.reopen("c1")
        async with asyncio.timeout(1):
            await waiter
        assert p.state == ParticipantState.IDLE and p.calls_served == 2
        with pytest.raises(ProtocolError):
            p.commit("c1")  # already ended

    asyncio.run(scenario())


def test_an_aborted_checkpoint_reopens_and_a_lost_controller_times_out():
    async def scenario():
        p = CheckpointParticipant()
        p.prepare("c1", lease_s=30)
        p.reopen("c1")  # abort before prepared: admission reopens
        assert p.state == ParticipantState.IDLE
        p.prepare("c2", lease_s=0.2)  # the controller then disappears
        async with asyncio.timeout(2):
            await p.admitted()
        assert p.lease_expiries == 1 and p.state == ParticipantState.IDLE
        with pytest.raises(ProtocolError):
            p.prepared("c2")

    asyncio.run(scenario())


def test_restore_only_into_a_fresh_environment():
    async def scenario():
        fresh = CheckpointParticipant()
        fresh.restore("c9")
        with pytest.raises(ProtocolError):
            fresh.prepare("c10", 30)
        fresh.restored("c9")
        assert fresh.state == ParticipantState.IDLE
        used = CheckpointParticipant()
        await used.admitted()
        with pytest.raises(ProtocolError, match="already served 1 calls"):
            used.restore("c9")

    asyncio.run(scenario())
