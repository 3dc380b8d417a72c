"""The controller's stream of asynchronous groups (controller/stream.py) on a fake environment:
groups finish in their own time and are taken in that order, a failure reaches the next take,
the cadence runs while groups are in flight, and closing stops them all."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from rollout_recovery.config import LivenessConfig
from rollout_recovery.controller.coordinator import RunState
from rollout_recovery.controller.metrics import RunMetrics
from rollout_recovery.controller.stream import RolloutStream, StartedGroup
from rollout_recovery.data_plane import ReplayRow
from rollout_recovery.data_plane.errors import BadInputError
from rollout_recovery.protocol import EpisodeOutcome, GroupResult


class FakeEnv:
    """Each group takes `delay[group id]` seconds; `fail` names a group whose episode fails."""

    def __init__(self, delay: dict[str, float], fail: str | None = None) -> None:
        self.delay, self.fail, self.versions = delay, fail, []

    async def run_groups(self, groups, seeds, weight_version):
        [(gid, _)] = groups
        self.versions.append(weight_version)
        await asyncio.sleep(self.delay[gid])
        if gid == self.fail:
            raise RuntimeError(f"episode of {gid} failed")
        row = ReplayRow(key=f"{gid}/000", rollout_id=f"{gid}-g0", group_id=gid,
                        generation_index=0, prompt_len=1, token_ids=np.zeros(2, np.int32),
                        loss_mask=np.array([0, 1], np.int8), logprobs=np.zeros(2, np.float32),
                        reward=1.0, weight_version_min=weight_version,
                        weight_version_max=weight_version)  # fmt: skip
        return [EpisodeOutcome(row, 1, None) for _ in seeds[0]]

    async def progress(self):
        raise AssertionError("the watch is off in these tests")


class FakeCoordinator:
    def __init__(self) -> None:
        self.running = False

    async def alongside(self, work):
        self.running = True
        try:
            return await work
        finally:
            self.running = False


def _stream(env) -> tuple[RolloutStream, FakeCoordinator]:
    coordinator = FakeCoordinator()
    state = RunState({"path": "tiny://default"})
    stream = RolloutStream(env, coordinator, state, LivenessConfig(stall_timeout_s=None),
                           RunMetrics(), GroupResult.of)  # fmt: skip
    return stream, coordinator


def _groups(*names: str) -> list[StartedGroup]:
    return [StartedGroup(n, {"task": n}, [1, 2]) for n in names]


async def test_groups_are_taken_in_the_order_they_finish_while_the_cadence_runs():
    env = FakeEnv({"a": 0.15, "b": 0.01, "c": 0.05})
    stream, coordinator = _stream(env)
    stream.state.weight_version = 3
    stream.start(_groups("a", "b", "c"))
    await asyncio.sleep(0)
    assert coordinator.running and stream.counts() == {"in_flight": 3, "finished": 0}
    first = await stream.take(2)
    assert [r.group_id for r in first] == ["b", "c"] and len(first[0].rows) == 2
    assert env.versions == [3, 3, 3]
    with pytest.raises(BadInputError, match="only 0 finished and 1 are in flight"):
        await stream.take(2)
    [last] = await stream.take(1)
    assert last.group_id == "a"
    with pytest.raises(BadInputError, match=r"\[.d.\] are already in flight; none was"):
        stream.start(_groups("d", "d"))
    assert "d" not in stream.running
    await stream.close()
    assert not coordinator.running and stream.running == {}


async def test_a_failed_group_fails_the_next_take_and_the_next_start():
    stream, _ = _stream(FakeEnv({"a": 0.01, "b": 0.2}, fail="a"))
    stream.start(_groups("a", "b"))
    with pytest.raises(RuntimeError, match="episode of a failed"):
        await stream.take(1)
    with pytest.raises(RuntimeError, match="episode of a failed"):
        stream.start(_groups("c"))
    await stream.close()
