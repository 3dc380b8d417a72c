"""EpisodeRunner: the environment's async work on its own loop - running episode functions
against the workers, and its side of the checkpoint protocol (docs/design.md §2, §4).

An episode is a run of the configured episode function (`environment.episode`) with an
`EpisodeContext`; its model calls go through `ModelCallClient` (token capture, lineage, exact
prefix supply) on the episode's worker, and a finished episode becomes one `replay` row,
durable before it is reported. Checkpoint side:

- `prepare(ckpt)` closes admission (model calls park at their next turn boundary) and, at
  prefix level, has the worker pool cut each worker's in-flight calls; the receipts become
  continuations;
- `commit(ckpt)` returns the episode records (journals, each call's token entry, the
  continuation of the call in flight), all read at once between steps, and sweeps stale
  staging rows;
- `resume(ckpt)` reopens admission (also after an aborted attempt);
- `load(records)` takes a restored snapshot's episodes: each unfinished one runs again as
  attempt + 1, replaying its journal, its in-flight call resumed from its cut prefix. A replay
  that diverges from its journal starts the episode over, counted by reason.

A job may run several environments (`placement.environment.actors`); runner `index` of
`count` owns the rollouts `environment_of(rollout_id, count) == index`: it runs only their
episodes, and its sweep deletes only their staged rows (the others' are not its to judge).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx

from rollout_recovery.config import EnvironmentActorConfig
from rollout_recovery.crashpoints import crash_point
from rollout_recovery.data_plane import replay_rows_to_table, table_to_replay_rows
from rollout_recovery.environment.context import (
    ChatReply,
    EpisodeContext,
    JournalDiverged,
)
from rollout_recovery.environment.episode import EpisodeState, call_seed, replay_row
from rollout_recovery.environment.lineage import LineageStore
from rollout_recovery.environment.migration import journal_continuation
from rollout_recovery.environment.model_client import ModelCallClient, ModelCallFailed
from rollout_recovery.environment.participant import CheckpointParticipant
from rollout_recovery.environment.token_entry import TokenEntry
from rollout_recovery.environment.token_sink import StoreTokenSink
from rollout_recovery.generation.pool import WORKER_GONE, WorkerHandle, WorkerPool
from rollout_recovery.imports import load_callable
from rollout_recovery.protocol import (
    XARG_SEED,
    XARG_TEMPERATURE,
    CallIdentity,
    CallRef,
    CheckpointRecords,
    Continuation,
    CutInventory,
    EnvironmentProgress,
    EpisodeOutcome,
    environment_of,
    replay_key,
    rollout_id,
)


class EpisodeFailed(RuntimeError):
    """The user's episode function raised (not a divergence): the step fails, naming it."""


class WorkerLost(Exception):
    """A call's worker died under it (`cause`: actor_dead, engine_dead, ...): the call moves."""

    def __init__(self, worker: int, cause: str, call: CallIdentity) -> None:
        super().__init__(f"worker {worker} lost ({cause}) during {call.key_prefix()}")
        self.worker, self.cause, self.call = worker, cause, call


class RolloutRefused(RuntimeError):
    """An outside rollout-control call this environment cannot honour; `reason` names why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# Request fields the environment sets itself: the position-keyed sampler takes the seed and
# temperature, logprobs are always captured, and one call is one choice.
OWN_FIELDS = ("model", "seed", "logprobs", "n", "messages")


class EpisodeRunner:
    """One environment's episodes and checkpoint state; every method runs on one loop."""

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
        self.max_turns = env.max_turns
        self.episode_fn = load_callable(env.episode)
        self.reward_fn = load_callable(env.reward) if env.reward else None
        root = env.scratch_dir or scratch_root
        self.scratch_root = Path(root) if root else None
        self.sink = StoreTokenSink(store) if store is not None else None
        self.lineage = LineageStore()
        self._finish: dict[tuple[str, str], str | None] = {}  # shared by every client
        self.clients = [self._client(w) for w in workers]
        self.participant = CheckpointParticipant()
        self.episodes: dict[str, EpisodeState] = {}  # admitted and unfinished
        self.pending: dict[str, EpisodeState] = {}  # restored, waiting for their step to run
        self.contexts: dict[str, EpisodeContext] = {}  # the running attempt of each episode
        self.finished: set[str] = set()  # rollouts finished by this environment
        self.inflight: dict[str, tuple[int, CallIdentity]] = {}  # rollout -> (worker, call)
        self.resuming: dict[str, Continuation] = {}  # in flight from a restored prefix
        self._cuts: dict[str, Continuation] = {}  # this checkpoint's continuations, by rollout
        # Calls between a lost worker and their next attempt: (the lost attempt, the prefix it
        # was resumed from); their rows are kept until the next attempt is in flight.
        self.migrating: dict[str, tuple[CallIdentity, Continuation | None]] = {}
        self.migrated: set[str] = set()  # rollouts whose continuation is a migration's
        self._workers_changed = asyncio.Event()
        # Round robin from this environment's own offset, so N environments do not all start
        # on worker 0.
        self._next_worker = itertools.count(index)
        self._results: dict[str, asyncio.Future] = {}  # outside rollouts: the harness's result
        self._open: dict[str, asyncio.Future] = {}  # outside rollouts: their episode
        self.gateway_url: str | None = None  # set when the environment serves a gateway
        self.gateway_token: str | None = None
        self.counts: Counter[str] = Counter()
        self.events = 0  # calls started and answered, episodes finished (the liveness watch's)
        self.restored_at = 0.0  # when the restored episodes in `pending` were loaded

    # ------------------------------------------------------------------ episodes

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
                restored = self.pending.pop(rid, None)
                if key in done:
                    jobs.append(self._existing(key))
                    continue
                st = restored or EpisodeState(rid, gid, i, seed, dict(task))
                st.worker = self._assign_worker()
                self.episodes[rid] = st  # recorded by a checkpoint from now on
                jobs.append(self._episode(st, weight_version, restored is not None))
        return await asyncio.gather(*jobs)

    async def open_rollout(
        self, group_id: str, index: int, seed: int, task: dict, weight_version: int
    ) -> tuple[EpisodeState, bool]:
        """An episode opened from outside (a standalone gateway): its function waits for the
        harness's result (`finish_rollout`). Opening a rollout a restore brought back replays
        its journal to the harness that makes its calls again."""
        rid, key = rollout_id(group_id, index), replay_key(group_id, index)
        if rid in self.finished or key in await self.store.alist("replay", key):
            raise RolloutRefused("rollout_finished", f"rollout {rid} has finished")
        if rid in self._results:
            raise RolloutRefused("rollout_open", f"rollout {rid} is open; finish it first")
        restored = self.pending.pop(rid, None)
        if restored is not None and restored.task != task:
            self.pending[rid] = restored
            raise RolloutRefused("task_differs", f"rollout {rid} was restored with another task; "
                                 "open it with the task it had")  # fmt: skip
        st = restored or EpisodeState(rid, group_id, index, seed, dict(task))
        st.worker = self._assign_worker()
        self.episodes[rid] = st
        self._results[rid] = asyncio.get_running_loop().create_future()
        self._open[rid] = asyncio.ensure_future(
            self._episode(st, weight_version, restored is not None, self._harness_result)
        )
        return st, restored is not None

    def opened_outside(self, rid: str) -> bool:
        """Whether `rid` is open from outside (a standalone gateway), not run by a step."""
        return rid in self._results

    async def _harness_result(self, ctx: EpisodeContext, task: dict) -> Any:
        return await asyncio.shield(self._results[ctx.rollout_id])

    async def finish_rollout(self, rid: str, result: Any) -> EpisodeOutcome:
        """The harness's result: the episode ends, its row is written to `replay`."""
        future = self._results.get(rid)
        if future is None:
            if rid in self.finished:
                raise RolloutRefused("rollout_finished", f"rollout {rid} has finished")
            raise RolloutRefused("unknown_rollout", f"no rollout {rid} is open")
        if future.done():
            raise RolloutRefused("rollout_finishing", f"rollout {rid} is being finished")
        future.set_result(result)
        try:
            return await self._open[rid]
        finally:
            self._open.pop(rid, None)
            self._results.pop(rid, None)

    async def abandon_rollout(self, rid: str, reason: str) -> None:
        """An outside rollout whose harness diverged from its journal: it is closed, and
        opening it again starts it over as a fresh attempt (counted by reason)."""
        task = self._open.pop(rid, None)
        self._results.pop(rid, None)
        st = self.episodes.pop(rid, None)
        self.contexts.pop(rid, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if st is not None:
            self.counts[f"replay_diverged.{reason}"] += 1
            self.lineage.forget(rid)
            self.pending[rid] = st.fresh_start()

    async def _existing(self, key: str) -> EpisodeOutcome:
        table, _ = await self.store.aget("replay", [key])
        return EpisodeOutcome(table_to_replay_rows(table)[0], 0, None)

    def _context(self, st: EpisodeState) -> EpisodeContext:
        url = f"{self.gateway_url}/rollouts/{st.rollout_id}/v1" if self.gateway_url else None
        ctx = EpisodeContext(st, self, self.max_turns, self.scratch_root, self.counts,
                             dict(self.cfg.environment.settings), url,
                             self.gateway_token)  # fmt: skip
        self.episodes[st.rollout_id] = st
        self.contexts[st.rollout_id] = ctx
        return ctx

    async def _run_function(self, st: EpisodeState, fn) -> tuple[EpisodeState, Any]:
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
                    raise EpisodeFailed(
                        f"{st.rollout_id}: environment.episode={self.cfg.environment.episode} "
                        f"raised {type(err).__name__}: {err}"
                    ) from err
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
                self.lineage.forget(st.rollout_id)
                st = st.fresh_start()

    async def _episode(self, st: EpisodeState, weight_version: int, restored: bool, fn=None):
        if restored:
            self.counts["restored_episodes"] += 1
        try:
            st, result = await self._run_function(st, fn or self.episode_fn)
            reward = self.reward_fn(st.task, result) if self.reward_fn else result
            row = replay_row(st, float(reward), weight_version)
            # Durable as soon as it is finished: a crash later does not regenerate it.
            await self.store.aput("replay", replay_rows_to_table([row]))
            crash_point("replay_row_written")
            self.finished.add(st.rollout_id)
        finally:
            self.episodes.pop(st.rollout_id, None)
            self.contexts.pop(st.rollout_id, None)
            self.events += 1
        return EpisodeOutcome(row, st.decoded, result)

    def serve_gateway(self, url: str, token: str) -> None:
        """Episodes started from now on see their rollout's gateway URL and the token."""
        self.gateway_url, self.gateway_token = url, token

    def adopt(self, st: EpisodeState, entry: TokenEntry, messages: list[dict], message: dict):
        """A call answered from the journal becomes lineage the next call resolves to."""
        self.clients[st.worker].adopt(entry, messages, message)

    async def call(
        self, st: EpisodeState, messages: list[dict], request: dict
    ) -> tuple[ChatReply, TokenEntry]:
        """The episode's next model call on its worker: parked while a checkpoint is being
        taken, resumed from its cut prefix when a restore brought one. A worker that dies
        under the call does not fail it: the call moves to a live worker as the next attempt,
        from its journal (docs/failover.md), at most `failover.max_migrations` times."""
        moves = 0
        while True:
            try:
                return await self._call_once(st, messages, request)
            except WorkerLost as lost:
                moves += 1
                self.counts[f"migrations.{lost.cause}"] += 1
                if moves > self.cfg.failover.max_migrations:
                    self.migrating.pop(st.rollout_id, None)
                    self.counts["migration_failed.max_migrations"] += 1
                    raise EpisodeFailed(
                        f"{lost.call.key_prefix()}: max_migrations - its worker died "
                        f"{moves} times (failover.max_migrations="
                        f"{self.cfg.failover.max_migrations})"
                    ) from lost
                await self._migrate(st, lost)

    async def _call_once(
        self, st: EpisodeState, messages: list[dict], request: dict
    ) -> tuple[ChatReply, TokenEntry]:
        g = self.cfg.policy.generation
        turn, call = len(st.turns), CallIdentity(st.rollout_id, st.next_call_id, st.attempt)
        cont = st.continuation
        if cont is not None and cont.call_id != call.model_call_id:
            cont = None
        kind = "migration" if st.rollout_id in self.migrated else "restore"
        fields = {k: v for k, v in request.items() if k not in OWN_FIELDS and v is not None}
        max_tokens = fields.pop("max_tokens", None) or g.max_new_tokens
        temperature = fields.pop("temperature", None)
        temperature = g.temperature if temperature is None else temperature
        xargs = {XARG_SEED: call_seed(st.seed, turn), XARG_TEMPERATURE: temperature}
        if cont is not None and cont.cut:
            if kind == "restore":
                self.counts["restored_calls"] += 1
                self.counts["restored_prefix_tokens"] += cont.tokens
            xargs |= cont.to_request_fields(max_tokens)
        # Parked while a checkpoint is being taken; until the call is in flight, a checkpoint
        # records the restored continuation, and from then until it ends the sweep keeps the
        # rows the worker resumes it from.
        await self.participant.admitted()
        self.events += 1
        st.continuation = None
        self.migrated.discard(st.rollout_id)
        self.migrating.pop(st.rollout_id, None)
        self.inflight[st.rollout_id] = (st.worker, call)
        if cont is not None and cont.cut:
            self.resuming[st.rollout_id] = cont
        worker = st.worker
        try:
            res = await self.clients[worker].call(
                st.rollout_id,
                call.model_call_id,
                messages,
                attempt=st.attempt,
                temperature=0.0,  # sampling is the position-keyed sampler's
                max_tokens=max_tokens,
                vllm_xargs=xargs,
                **fields,
            )
        except (httpx.TransportError, ModelCallFailed) as err:
            if not self.cfg.failover.enabled or (
                isinstance(err, ModelCallFailed) and err.status < 500
            ):
                raise
            # Keep this attempt's rows (and the prefix it resumed from) until the next
            # attempt is in flight: no await before this line.
            self.migrating[st.rollout_id] = (call, cont if cont is not None and cont.cut else None)
            cause = await self._lost_cause(worker)
            if cause is None:
                self.migrating.pop(st.rollout_id, None)
                raise
            raise WorkerLost(worker, cause, call) from err
        finally:
            self.inflight.pop(st.rollout_id, None)
            self.resuming.pop(st.rollout_id, None)
            self.events += 1
        n = len(res.entry.generated_token_ids)
        resumed = cont is not None and cont.cut
        st.decoded += n - (cont.tokens if resumed else 0)
        if resumed and kind == "migration":
            self.counts["migration.tail_tokens"] += n - cont.tokens
        elif resumed:
            self.counts["tail_tokens"] += n - cont.tokens
        elif cont is not None and kind == "restore":  # in flight at the checkpoint, not cut
            self.counts["regenerated_tokens"] += n
        message = res.assistant_message
        source = "resumed" if resumed else "decoded"
        reply = ChatReply(message, message.get("content") or "", res.entry.finish_reason,
                          list(res.entry.generated_token_ids), res.response, source,
                          call.model_call_id, st.attempt)  # fmt: skip
        return reply, res.entry

    # ------------------------------------------------------------------ failover

    def _client(self, w: WorkerHandle) -> ModelCallClient:
        tc = self.cfg.token_capture
        return ModelCallClient(
            w.info.url,
            w.info.served_model_name,
            self.sink,
            self.lineage,
            supply_prefix=tc.supply_prefix_token_ids,
            request_token_ids=tc.request_token_ids,
            turn_end_token_id=w.info.eos_token_id,
            finish=self._finish,
        )

    def _assign_worker(self) -> int:
        """Round robin over the live workers (all of them when none is live: the call then
        waits for a replacement when it fails)."""
        live = [i for i, _ in self.workers.live()] or list(range(len(self.clients)))
        return live[next(self._next_worker) % len(live)]

    async def _lost_cause(self, index: int) -> str | None:
        """Why worker `index` is gone, or None when it is alive and well (the failure was the
        call's own). Asks the worker's actor: a dead actor or engine answers at once."""
        if index in self.workers.lost:
            return self.workers.lost[index]
        try:
            async with asyncio.timeout(self.cfg.failover.unhealthy_after_s):
                health = await self.workers[index].ahealth()
        except WORKER_GONE:
            cause = "actor_dead"
        except TimeoutError:
            cause = "health_timeout"
        else:
            if health.healthy:
                return None
            cause = (health.reason or "unhealthy").split(":")[0]
        self.workers.mark_lost(index, cause)
        return self.workers.lost.get(index, cause)

    async def _migrate(self, st: EpisodeState, lost: WorkerLost) -> None:
        """Make the lost call's next attempt: resumed from the newest verified prefix of its
        chain (or from scratch, counted), on a live worker."""
        partition = self.cfg.token_capture.staging_partition
        _, resumed_from = self.migrating.get(st.rollout_id, (lost.call, None))
        cont, refused = await journal_continuation(self.store, partition, lost.call,
                                                   resumed_from)  # fmt: skip
        if refused is not None:
            self.counts[f"migration.journal_refused.{refused}"] += 1
        if cont is None:
            cont = Continuation(call_id=lost.call.model_call_id, attempt=lost.call.attempt)
            self.counts["migration.from_scratch"] += 1
        else:
            self.counts["migration.resumed"] += 1
            self.counts["migration.journal_tokens"] += cont.tokens or 0
        st.attempt = lost.call.attempt + 1
        st.continuation = cont  # a checkpoint taken meanwhile records it (and keeps its rows)
        self.migrated.add(st.rollout_id)
        self.migrating.pop(st.rollout_id, None)
        st.worker = await self._live_worker(st)

    async def _live_worker(self, st: EpisodeState) -> int:
        """A live worker for a moving call; waits for a replacement when none is live."""
        deadline = time.monotonic() + self.cfg.failover.replacement_wait_s
        while True:
            live = [i for i, _ in self.workers.live()]
            if live:
                return live[next(self._next_worker) % len(live)]
            self._workers_changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                self.counts["migration_failed.no_live_worker"] += 1
                raise EpisodeFailed(
                    f"{st.rollout_id}: no_live_worker - no worker came back within "
                    f"failover.replacement_wait_s={self.cfg.failover.replacement_wait_s}"
                )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._workers_changed.wait()

    def worker_lost(self, index: int, cause: str) -> None:
        """The controller found worker `index` dead: no new call goes there."""
        self.workers.mark_lost(index, cause)

    async def worker_replaced(self, index: int, handle: WorkerHandle) -> None:
        """A started replacement on the current weights takes slot `index`."""
        old = self.clients[index]
        self.workers.workers[index] = handle
        self.workers.lost.pop(index, None)
        self.clients[index] = self._client(handle)
        self.counts["workers_replaced"] += 1
        self._workers_changed.set()
        await old.aclose()

    # ------------------------------------------------------------------ checkpoints

    async def prepare(self, ckpt: str, lease_s: float) -> dict:
        """Close admission and (prefix level) cut every in-flight call. Returns the count of
        calls cut and of calls not cut, by reason."""
        self.participant.prepare(ckpt, lease_s)
        self._cuts = {}
        not_cut: Counter[str] = Counter()
        if self.cfg.rollout_recovery.target_level == "prefix":
            calls: dict[int, list[CallRef]] = {}
            for worker, call in dict(self.inflight).values():
                calls.setdefault(worker, []).append(CallRef(**call._asdict()))
            inventories = {w: CutInventory(checkpoint_id=ckpt, calls=refs)
                           for w, refs in calls.items()}  # fmt: skip
            for receipt in await self.workers.cut(inventories):
                for c in receipt["calls"]:
                    # A terminal completion is a whole answer: a resume returns it without
                    # decoding. A call not cut is regenerated after a restore (next attempt).
                    cont = Continuation.from_receipt(c)
                    if not cont.cut:
                        not_cut[c["reason"]] += 1
                    self._cuts[c["rollout_id"]] = cont
        self.participant.prepared(ckpt)
        return {"calls_cut": sum(1 for c in self._cuts.values() if c.cut),
                "calls_not_cut": dict(not_cut)}  # fmt: skip

    def _continuation(self, ep: EpisodeState) -> Continuation | None:
        """The call in flight at this checkpoint: its cut, or (not cut) its identity alone."""
        if ep.rollout_id in self.pending or ep.continuation is not None:
            # A restored call not made again yet (the episode is replaying its journal, or a
            # harness is still starting): its continuation stands, and so do its chunk rows.
            return ep.continuation
        if ep.rollout_id in self.migrating:  # its worker just died: not cut
            lost, _ = self.migrating[ep.rollout_id]
            return Continuation(call_id=lost.model_call_id, attempt=lost.attempt)
        if ep.rollout_id not in self.inflight:
            return None  # parked at a turn boundary
        call = self.inflight[ep.rollout_id][1]
        cut = self._cuts.get(ep.rollout_id)
        if cut is not None and (cut.call_id, cut.attempt) == (call.model_call_id, call.attempt):
            return cut
        return Continuation(call_id=call.model_call_id, attempt=call.attempt)

    async def commit(self, ckpt: str) -> CheckpointRecords:
        """The episode records of this checkpoint and the continuations of in-flight calls;
        then the staging rows that no live call and no continuation needs are deleted."""
        self.participant.commit(ckpt)
        out = CheckpointRecords()
        for ep in [*self.episodes.values(), *self.pending.values()]:
            rec = ep.to_record(self._continuation(ep))
            out.episodes.append(rec)
            if rec.continuation is not None:
                out.continuations[ep.rollout_id] = rec.continuation
        live = {call for _, call in self.inflight.values()}
        live |= {lost for lost, _ in self.migrating.values()}
        keep = [*out.continuations.values(), *self.resuming.values(),
                *(older for _, older in self.migrating.values())]  # fmt: skip
        out.chunk_rows_swept = await self.sweep(keep, live)
        return out

    async def sweep(self, continuations: Iterable[Continuation | None], live: set) -> int:
        """Delete chunk rows that outlived their call: rows neither named by a continuation
        being kept nor belonging to a call attempt still in flight (a call that finished, was
        aborted, or died with a previous run). Rows must not outlive their call past the next
        checkpoint, or every snapshot carries them forever. Only this environment's rows are
        considered (`owns`; a row of no call's shape is environment 0's): another
        environment's calls and continuations are not known here."""
        if self.store is None:
            return 0
        partition = self.cfg.token_capture.staging_partition
        keep = {k for c in continuations if c is not None for k in c.keys or []}
        doomed = []
        for key in await self.store.alist(partition):
            call = CallIdentity.of_chunk_key(key)
            mine = self.owns(call.rollout_id) if call is not None else self.index == 0
            if mine and key not in keep and call not in live:
                doomed.append(key)
        if doomed:
            await self.store.adelete(partition, doomed)
            crash_point("chunks_swept")
            self.counts["chunk_rows_swept"] += len(doomed)
        return len(doomed)

    async def load(self, restore_id: str, episodes: list[EpisodeState]) -> int:
        """Take a restored snapshot's episodes (pending until their step runs)."""
        await self.sweep([ep.continuation for ep in episodes], set())
        self.pending = {ep.rollout_id: ep for ep in episodes}
        self.restored_at = time.monotonic()
        self.participant.restored(restore_id)
        return len(self.pending)

    def progress(self) -> EnvironmentProgress:
        """What this environment is doing now (the controller's liveness watch)."""
        waiting = next(iter(self.pending), None)
        return EnvironmentProgress(
            episodes_running=len(self.episodes),
            calls_in_flight=len(self.inflight),
            calls_moving=len(self.migrating.keys() | self.migrated),
            effects_running=sum(1 for c in self.contexts.values() if c.effect_id is not None),
            events=self.events,
            restored_waiting=len(self.pending),
            restored_waiting_s=time.monotonic() - self.restored_at if waiting else 0.0,
            restored_example=waiting,
        )

    def diagnostics(self) -> dict[str, int]:
        """Counts of this environment: episodes and tokens restored, and the model clients'
        capture, the lineage store's resolutions and the participant's lease expiries."""
        capture: Counter[str] = Counter()
        for client in self.clients:
            capture.update({f"capture.{k}": v for k, v in client.diagnostics.snapshot().items()})
        lineage = {f"lineage.{k}": v for k, v in self.lineage.stats().items()}
        leases = {"lease_expiries": self.participant.lease_expiries}
        every = dict(self.counts) | dict(capture) | lineage | leases
        return {k: v for k, v in every.items() if v}

    async def aclose(self) -> None:
        """Close the HTTP clients; rollouts opened from outside and still open end here (a
        checkpoint holds what they did)."""
        for task in self._open.values():
            task.cancel()
        await asyncio.gather(*self._open.values(), return_exceptions=True)
        for client in self.clients:
            await client.aclose()
