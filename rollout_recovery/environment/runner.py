"""EpisodeRunner: one environment's episodes, on its own loop (docs/design.md §2, §4).

An episode is a run of the configured episode function (`environment.episode`) with an
`EpisodeContext`; a finished episode becomes one `replay` row, durable before it is reported.
The runner is built from three parts with one job each:

    EpisodeRunner          episodes: admit, run (replaying a restored journal), finish
      CallDispatcher       their model calls on the workers, and failover (dispatch.py)
        CallTable          one InflightCall per episode's call (inflight.py)
      EnvironmentCheckpoints  prepare, commit, sweep, load (checkpointing.py)
      episode_failure      what a failed episode's error says (failures.py)

A restored snapshot's episodes wait in `pending` until their step runs; each unfinished one
runs again as attempt + 1, replaying its journal, its in-flight call resumed from its cut
prefix. A replay that diverges from its journal starts the episode over, counted by reason.
Episodes opened from outside (a standalone gateway) are the gateway backend's
(environment/gateway_backend.py), run by `run_episode` here.

A job may run several environments (`placement.environment.actors`); runner `index` of
`count` owns the rollouts `environment_of(rollout_id, count) == index`: it runs only their
episodes, and its sweep deletes only their staged rows.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rollout_recovery.config import EnvironmentActorConfig
from rollout_recovery.crashpoints import crash_point
from rollout_recovery.data_plane import replay_rows_to_table, table_to_replay_rows
from rollout_recovery.environment.checkpointing import EnvironmentCheckpoints
from rollout_recovery.environment.context import EpisodeContext, JournalDiverged
from rollout_recovery.environment.dispatch import CallDispatcher
from rollout_recovery.environment.episode import EpisodeState, replay_row
from rollout_recovery.environment.failures import episode_failure, result_json, reward_of
from rollout_recovery.environment.participant import CheckpointParticipant
from rollout_recovery.environment.token_sink import StoreTokenSink
from rollout_recovery.generation.pool import WorkerPool
from rollout_recovery.imports import load_callable
from rollout_recovery.protocol import (
    CheckpointRecords,
    EnvironmentProgress,
    EpisodeOutcome,
    environment_of,
    replay_key,
    rollout_id,
)

EpisodeFunction = Callable[[EpisodeContext, dict], Awaitable[Any]]


class EpisodeRunner:
    """One environment's episodes and the parts that serve them; every method runs on one
    loop."""

    def __init__(
        self,
        cfg: EnvironmentActorConfig,
        workers: WorkerPool,
        store,
        scratch_root: str | None = None,
        index: int = 0,
        count: int = 1,
    ) -> None:
        if not 0 <= index < count:
            raise ValueError(f"environment index {index} is not in 0..{count - 1}")
        self.cfg, self.workers, self.store = cfg, workers, store
        self.index, self.count = index, count  # which rollouts are this runner's
        env = cfg.environment
        self.episode_fn = load_callable(env.episode)
        self.reward_fn = load_callable(env.reward) if env.reward else None
        root = env.scratch_dir or scratch_root
        self.scratch_root = Path(root) if root else None
        self.sink = StoreTokenSink(store) if store is not None else None
        self.participant = CheckpointParticipant()
        self.counts: Counter[str] = Counter()
        self.dispatch = CallDispatcher(cfg, workers, store, self.sink, self.participant,
                                       self.counts, first_worker=index)  # fmt: skip
        self.calls = self.dispatch.calls
        self.checkpoints = EnvironmentCheckpoints(cfg, workers, store, self.calls,
                                                  self.participant, self.counts, index,
                                                  count)  # fmt: skip
        self.episodes: dict[str, EpisodeState] = {}  # admitted and unfinished
        self.pending: dict[str, EpisodeState] = {}  # restored, waiting for their step to run
        self.contexts: dict[str, EpisodeContext] = {}  # the running attempt of each episode
        self.finished: set[str] = set()  # rollouts finished by this environment
        self.gateway_url: str | None = None  # set when the environment serves a gateway
        self.gateway_token: str | None = None
        self.events = 0  # episodes finished (the liveness watch's, with the calls')
        self.restored_at = 0.0  # when the restored episodes in `pending` were loaded

    def owns(self, rollout: str) -> bool:
        """Whether rollout `rollout` is this environment's (`environment_of`)."""
        return environment_of(rollout, self.count) == self.index

    async def run_groups(
        self, groups: list[tuple[str, dict]], seeds: list[list[int]], weight_version: int
    ) -> list[EpisodeOutcome]:
        """One outcome per episode of this environment's (`owns`), in group order, then index
        order; the other environments run the rest."""
        done = set(await self.store.alist("replay"))
        jobs = []
        for (gid, task), group_seeds in zip(groups, seeds, strict=True):
            for i, seed in enumerate(group_seeds):
                rid, key = rollout_id(gid, i), replay_key(gid, i)
                if not self.owns(rid):
                    continue
                if key in done:
                    self.pending.pop(rid, None)
                    self.calls.drop(rid)
                    jobs.append(self._existing(key))
                    continue
                st, restored = self.admit(rid, gid, i, seed, task)
                jobs.append(self.run_episode(st, weight_version, restored))
        return await asyncio.gather(*jobs)

    def admit(
        self, rid: str, group_id: str, index: int, seed: int, task: dict
    ) -> tuple[EpisodeState, bool]:
        """The episode `rid` to run now, and whether a restore brought it back: the waiting one
        when there is one (restored, or started over: not restored), else a new one; on a
        worker, and recorded by every checkpoint from now on."""
        waiting = self.pending.pop(rid, None)
        st = waiting or EpisodeState(rid, group_id, index, seed, dict(task))
        st.worker = self.dispatch.assign_worker()
        self.episodes[rid] = st
        return st, waiting is not None and not waiting.started_over

    async def start_over(self, rid: str, reason: str, task: asyncio.Future | None) -> None:
        """Episode `rid`, stopped from outside after its replay diverged (`reason`), runs
        next time as a fresh attempt (counted by reason); `task`: its run, cancelled here."""
        st = self.episodes.pop(rid, None)
        self.contexts.pop(rid, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if st is not None:
            self.counts[f"replay_diverged.{reason}"] += 1
            self.dispatch.lineage.forget(rid)
            self.calls.drop(rid)
            self.pending[rid] = st.fresh_start(started_over=True)

    async def _existing(self, key: str) -> EpisodeOutcome:
        table, _ = await self.store.aget("replay", [key])
        row = table_to_replay_rows(table)[0]
        return EpisodeOutcome(row, 0, row.result)

    def _context(self, st: EpisodeState) -> EpisodeContext:
        url = f"{self.gateway_url}/rollouts/{st.rollout_id}/v1" if self.gateway_url else None
        ctx = EpisodeContext(st, self.dispatch, self.cfg.environment.max_turns,
                             self.scratch_root, self.counts, dict(self.cfg.environment.settings),
                             url, self.gateway_token)  # fmt: skip
        self.episodes[st.rollout_id] = st
        self.contexts[st.rollout_id] = ctx
        return ctx

    async def _run_function(
        self, st: EpisodeState, fn: EpisodeFunction
    ) -> tuple[EpisodeState, Any]:
        """Run the episode function to its end; a replay that diverges from its journal starts
        the episode over as a fresh attempt."""
        while True:
            ctx = self._context(st)
            try:
                try:
                    result = await fn(ctx, st.task)
                except Exception as err:
                    if ctx.diverged is not None:  # the function failed on a refused step
                        raise ctx.diverged from None
                    failure = episode_failure(self.cfg, st, ctx, fn, fn is self.episode_fn, err)
                    if failure is err:
                        raise
                    raise failure from err
                if ctx.diverged is not None:
                    raise ctx.diverged
                if len(st.journal) < len(st.replay):
                    raise JournalDiverged(
                        "journal_unconsumed",
                        f"the episode ended after {len(st.journal)} of its "
                        f"{len(st.replay)} journaled steps",
                    )
                return st, result
            except JournalDiverged as err:
                self.counts[f"replay_diverged.{err.reason}"] += 1
                self.dispatch.lineage.forget(st.rollout_id)
                self.calls.drop(st.rollout_id)
                st = st.fresh_start()

    async def run_episode(
        self,
        st: EpisodeState,
        weight_version: int,
        restored: bool,
        fn: EpisodeFunction | None = None,
    ) -> EpisodeOutcome:
        """Run admitted episode `st` (with `fn`, else the configured episode function) to its
        row in `replay`."""
        if restored:
            self.counts["restored_episodes"] += 1
        try:
            st, result = await self._run_function(st, fn or self.episode_fn)
            kept = result_json(self.cfg, st, fn or self.episode_fn, fn is None, result)
            reward = reward_of(self.cfg, self.reward_fn, st, result)
            row = replay_row(st, reward, weight_version, kept)
            # Durable as soon as it is finished: a crash later does not regenerate it.
            await self.store.aput("replay", replay_rows_to_table([row]))
            crash_point("replay_row_written")
            self.finished.add(st.rollout_id)
        finally:
            self.episodes.pop(st.rollout_id, None)
            self.contexts.pop(st.rollout_id, None)
            self.calls.drop(st.rollout_id)
            self.events += 1
        # What was returned, as the row keeps it: a restored run reports the same (JSON) value.
        return EpisodeOutcome(row, st.decoded, row.result)

    def serve_gateway(self, url: str, token: str) -> None:
        """Episodes started from now on see their rollout's gateway URL and the token."""
        self.gateway_url, self.gateway_token = url, token

    # ------------------------------------------------------------------ checkpoints

    async def prepare(self, ckpt: str, lease_s: float) -> dict:
        return await self.checkpoints.prepare(ckpt, lease_s)

    async def commit(self, ckpt: str) -> CheckpointRecords:
        """The records of every running and restored episode of this environment."""
        return await self.checkpoints.commit(ckpt, [*self.episodes.values(),
                                                    *self.pending.values()])  # fmt: skip

    async def load(self, restore_id: str, episodes: list[EpisodeState]) -> int:
        """Take a restored snapshot's episodes (pending until their step runs)."""
        for rid in self.pending:
            self.calls.drop(rid)
        await self.checkpoints.load(restore_id, episodes)
        self.pending = {ep.rollout_id: ep for ep in episodes}
        self.restored_at = time.monotonic()
        return len(self.pending)

    def progress(self) -> EnvironmentProgress:
        """What this environment is doing now (the controller's liveness watch)."""
        waiting = next(iter(self.pending), None)
        return EnvironmentProgress(
            episodes_running=len(self.episodes),
            calls_in_flight=len(self.calls.in_flight()),
            calls_moving=sum(1 for c in self.calls if c.moving),
            effects_running=sum(1 for c in self.contexts.values() if c.effect_id is not None),
            events=self.events + self.dispatch.events,
            restored_waiting=len(self.pending),
            restored_waiting_s=time.monotonic() - self.restored_at if waiting else 0.0,
            restored_example=waiting,
        )

    def diagnostics(self) -> dict[str, int]:
        """Counts of this environment: episodes and tokens restored, and the model clients'
        capture, the lineage store's resolutions and the participant's lease expiries."""
        leases = {"lease_expiries": self.participant.lease_expiries}
        every = dict(self.counts) | self.dispatch.diagnostics() | leases
        return {k: v for k, v in every.items() if v}

    async def aclose(self) -> None:
        await self.dispatch.aclose()
