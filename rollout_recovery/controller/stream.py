"""Rollouts that never stop for training: the controller's half of asynchronous GRPO.

The trainer starts groups when its producer decides (`start`) and takes finished ones in the
order they finished (`take`), while the rest go on generating. Each group runs as one
`EnvironmentClient.run_groups` call under the liveness watch, on the weight version the workers
serve when it starts (its tokens record the versions that actually sampled them, which move
on as weights are pushed in flight). The checkpoint cadence runs from the first group started
until the stream closes, so snapshots meet calls in flight whenever they come; a group that
fails, or a cadence that gives up, fails the next `take` with its error.

    trainer ── start(groups) ──► stream ── run_groups(one group) ──► environment ──► workers
    trainer ◄── take(n) ──────── finished (FIFO) ◄── outcome of each group
                                 cadence: CheckpointCoordinator.attempt every interval
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from rollout_recovery.config import LivenessConfig
from rollout_recovery.controller.coordinator import CheckpointCoordinator, RunState
from rollout_recovery.controller.liveness import watch_step
from rollout_recovery.controller.metrics import RunMetrics
from rollout_recovery.data_plane.errors import BadInputError
from rollout_recovery.environment.client import EnvironmentClient
from rollout_recovery.errors import RunStalled
from rollout_recovery.protocol import EpisodeOutcome


@dataclass
class StartedGroup:
    """A group the trainer started: its id, task and one sampler seed per generation."""

    group_id: str
    task: dict
    seeds: list[int]


class RolloutStream:
    """Groups in flight and finished ones waiting for the trainer; every method runs on the
    controller's loop."""

    def __init__(
        self,
        env: EnvironmentClient,
        coordinator: CheckpointCoordinator,
        state: RunState,
        liveness: LivenessConfig,
        metrics: RunMetrics,
        result: Callable[[str, list[EpisodeOutcome]], object],
    ) -> None:
        self.env, self.coordinator, self.state = env, coordinator, state
        self.liveness, self.metrics, self.result = liveness, metrics, result
        self.running: dict[str, asyncio.Task] = {}
        self.finished: deque = deque()  # results (`result(group id, outcomes)`), oldest first
        self.failure: BaseException | None = None
        self.changed = asyncio.Event()
        self._closed = asyncio.Event()
        self._cadence: asyncio.Task | None = None

    def start(self, groups: list[StartedGroup]) -> None:
        """Start each group now, on the weights the workers serve."""
        if self.failure is not None:
            raise self.failure
        ids = [g.group_id for g in groups]
        twice = sorted({i for i in ids if i in self.running or ids.count(i) > 1})
        if twice:
            raise BadInputError(f"groups {twice} are already in flight; none was started")
        for g in groups:
            work = self.env.run_groups([(g.group_id, g.task)], [g.seeds], self.state.weight_version)
            watched = watch_step(work, self.env.progress, self.liveness, self.state.step)
            self.running[g.group_id] = asyncio.ensure_future(self._one(g.group_id, watched))
        if self._cadence is None:
            self._cadence = asyncio.ensure_future(self._checkpoints())

    async def _one(self, group_id: str, watched) -> None:
        try:
            outcomes = await watched
        except asyncio.CancelledError:
            raise
        except BaseException as err:
            if isinstance(err, RunStalled):
                self.metrics.add(f"run_stalled.{err.reason}")
            self.failure = self.failure or err
        else:
            self.finished.append(self.result(group_id, outcomes))
        finally:
            self.running.pop(group_id, None)
            self.changed.set()

    async def _checkpoints(self) -> None:
        try:
            await self.coordinator.alongside(self._closed.wait())
        except asyncio.CancelledError:
            raise
        except BaseException as err:
            self.failure = self.failure or err
            self.changed.set()

    async def take(self, n: int, timeout_s: float | None = None) -> list:
        """The `n` groups that finished first (waiting for them), oldest first."""
        if n < 1:
            raise BadInputError(f"take needs n >= 1 (got {n})")
        async with asyncio.timeout(timeout_s):
            while len(self.finished) < n:
                if self.failure is not None:
                    raise self.failure
                if len(self.finished) + len(self.running) < n:
                    raise BadInputError(
                        f"{n} finished groups were asked for, but only {len(self.finished)} "
                        f"finished and {len(self.running)} are in flight: start more first"
                    )
                self.changed.clear()
                await self.changed.wait()
        return [self.finished.popleft() for _ in range(n)]

    def counts(self) -> dict[str, int]:
        return {"in_flight": len(self.running), "finished": len(self.finished)}

    async def close(self) -> None:
        """Stop every group in flight and the cadence (a snapshot in progress ends first)."""
        tasks = list(self.running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.running.clear()  # a task cancelled before it ran never removed itself
        self._closed.set()
        if self._cadence is not None:
            await asyncio.gather(self._cadence, return_exceptions=True)
            self._cadence = None
