"""EpisodeRunner: the environment's async work on its own loop - running episodes against the
workers, and its side of the checkpoint protocol (docs/design.md §2, §4).

Episodes are single-turn GRPO prompts or multi-turn tool episodes (`environment.max_turns`).
Every call goes through `ModelCallClient` (token capture, lineage, exact prefix supply), and a
finished episode becomes one `replay` row, durable before it is reported. Checkpoint side:

- `prepare(ckpt)` closes admission (episodes park at their next turn boundary) and, at prefix
  level, has the worker pool cut each worker's in-flight calls; the receipts become
  continuations;
- `commit(ckpt)` returns the episode records (committed turns, tool state, the continuation
  of the call in flight), all read at once between turns, and sweeps stale staging rows;
- `resume(ckpt)` reopens admission (also after an aborted attempt);
- `load(records)` takes a restored snapshot's records: each unfinished episode is re-admitted
  as attempt + 1 from its last committed turn (or its call's cut prefix).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Callable, Iterable

from rollout_recovery.config import EnvironmentActorConfig
from rollout_recovery.crashpoints import crash_point
from rollout_recovery.data_plane import replay_rows_to_table, table_to_replay_rows
from rollout_recovery.environment.episode import (
    Episode,
    TallyTool,
    TurnRecord,
    call_seed,
    replay_row,
)
from rollout_recovery.environment.lineage import LineageStore
from rollout_recovery.environment.model_client import ModelCallClient
from rollout_recovery.environment.participant import CheckpointParticipant
from rollout_recovery.environment.token_sink import StoreTokenSink
from rollout_recovery.generation.pool import WorkerPool
from rollout_recovery.protocol import (
    XARG_SEED,
    XARG_TEMPERATURE,
    CallIdentity,
    CallRef,
    CheckpointRecords,
    Continuation,
    CutInventory,
    EpisodeOutcome,
    replay_key,
    rollout_id,
)


class EpisodeRunner:
    """One environment's episodes and checkpoint state; every method runs on one loop."""

    def __init__(self, cfg: EnvironmentActorConfig, workers: WorkerPool, store) -> None:
        self.cfg, self.workers, self.store = cfg, workers, store
        self.max_turns = cfg.environment.max_turns
        self.sink = StoreTokenSink(store) if store is not None else None
        self.lineage = LineageStore()
        tc = cfg.token_capture
        self.clients = [
            ModelCallClient(
                w.info.url,
                w.info.served_model_name,
                self.sink,
                self.lineage,
                supply_prefix=tc.supply_prefix_token_ids,
                request_token_ids=tc.request_token_ids,
                turn_end_token_id=w.info.eos_token_id,
            )
            for w in workers
        ]
        self.participant = CheckpointParticipant()
        self.tool = TallyTool()
        self.episodes: dict[str, Episode] = {}  # admitted and unfinished
        self.pending: dict[str, Episode] = {}  # restored, waiting for their step to run
        self.inflight: dict[str, tuple[int, CallIdentity]] = {}  # rollout -> (worker, call)
        self._cuts: dict[str, Continuation] = {}  # this checkpoint's continuations, by rollout
        self._next_worker = itertools.count()
        self.counts: Counter[str] = Counter()

    # ------------------------------------------------------------------ episodes

    async def run_groups(
        self,
        groups: list[tuple[str, list[dict]]],
        seeds: list[list[int]],
        reward_fn: Callable[[str], float],
        weight_version: int,
    ) -> list[EpisodeOutcome]:
        done = set(await self.store.alist("replay"))
        jobs = []
        for (gid, msgs), group_seeds in zip(groups, seeds, strict=True):
            for i, seed in enumerate(group_seeds):
                rid, key = rollout_id(gid, i), replay_key(gid, i)
                restored = self.pending.pop(rid, None)
                if key in done:
                    jobs.append(self._existing(key))
                    continue
                if restored is None:
                    msgs_copy = [dict(m) for m in msgs]
                    ep = Episode(rid, gid, i, seed, msgs_copy, self.tool.initial_state())
                else:
                    ep = restored
                    ep.attempt += 1
                jobs.append(self._episode(ep, reward_fn, weight_version, restored is not None))
        return await asyncio.gather(*jobs)

    async def _existing(self, key: str) -> EpisodeOutcome:
        table, _ = await self.store.aget("replay", [key])
        return EpisodeOutcome(table_to_replay_rows(table)[0], 0, None)

    def _adopt(self, ep: Episode, client: ModelCallClient) -> None:
        """A restored episode's committed turns become lineage its next call resolves to."""
        self.counts["restored_episodes"] += 1
        for t in ep.turns:
            client.adopt(
                t.entry, ep.messages[: t.request_messages], ep.messages[t.request_messages]
            )
            self.counts["restored_turn_tokens"] += len(t.entry.generated_token_ids)

    async def _episode(self, ep: Episode, reward_fn, weight_version: int, restored: bool):
        worker = next(self._next_worker) % len(self.clients)
        client = self.clients[worker]
        if restored:
            self._adopt(ep, client)
        self.episodes[ep.rollout_id] = ep
        decoded = 0
        try:
            while len(ep.turns) < self.max_turns:
                decoded += await self._turn(ep, worker, client)
            row = replay_row(ep, float(reward_fn("".join(ep.replies()))), weight_version)
            # Durable as soon as it is finished: a crash later does not regenerate it.
            await self.store.aput("replay", replay_rows_to_table([row]))
            crash_point("replay_row_written")
        finally:
            self.episodes.pop(ep.rollout_id, None)
        return EpisodeOutcome(row, decoded, ep.state)

    def _request_fields(self, ep: Episode, turn: int, cont: Continuation | None) -> dict:
        g = self.cfg.policy.generation
        xargs = {XARG_SEED: call_seed(ep.seed, turn), XARG_TEMPERATURE: g.temperature}
        if cont is not None and cont.cut:
            self.counts["restored_calls"] += 1
            self.counts["restored_prefix_tokens"] += cont.tokens
            xargs |= cont.to_request_fields(g.max_new_tokens)
        return xargs

    async def _turn(self, ep: Episode, worker: int, client: ModelCallClient) -> int:
        """One model call of the episode, then its turn boundary; the tokens decoded."""
        turn, call = len(ep.turns), CallIdentity(ep.rollout_id, ep.next_call_id, ep.attempt)
        cont, ep.continuation = ep.continuation, None
        if cont is not None and cont.call_id != call.model_call_id:
            cont = None
        xargs = self._request_fields(ep, turn, cont)
        await self.participant.admitted()  # parked while a checkpoint is being taken
        self.inflight[ep.rollout_id] = (worker, call)
        try:
            res = await client.call(
                ep.rollout_id,
                call.model_call_id,
                ep.messages,
                attempt=ep.attempt,
                temperature=0.0,  # sampling is the position-keyed sampler's
                max_tokens=self.cfg.policy.generation.max_new_tokens,
                ignore_eos=self.max_turns == 1,  # a turn of an episode ends at its EOS
                vllm_xargs=xargs,
            )
        finally:
            self.inflight.pop(ep.rollout_id, None)
        n = len(res.entry.generated_token_ids)
        if cont is not None and cont.cut:
            self.counts["tail_tokens"] += n - cont.tokens
        elif cont is not None:  # in flight at the checkpoint, not cut: decoded again
            self.counts["regenerated_tokens"] += n
        # The turn boundary: record the turn and apply the tool with no await between, so a
        # checkpoint sees both or neither.
        ep.messages.append(res.assistant_message)
        ep.turns.append(TurnRecord(res.entry, len(ep.messages) - 1))
        if len(ep.turns) < self.max_turns:
            reply = res.assistant_message.get("content") or ""
            result = self.tool.apply(ep.state, turn, reply)
            self.counts["tool_applications"] += 1
            ep.messages.append({"role": "tool", "name": self.tool.name, "content": result})
        return n

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

    def _continuation(self, ep: Episode) -> Continuation | None:
        """The call in flight at this checkpoint: its cut, or (not cut) its identity alone."""
        if ep.rollout_id in self.pending:  # not re-admitted yet: its record is unchanged
            return ep.continuation
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
            rec = ep.to_record()
            rec.continuation = self._continuation(ep)
            out.episodes.append(rec)
            if rec.continuation is not None:
                out.continuations[ep.rollout_id] = rec.continuation
        live = {call for _, call in self.inflight.values()}
        out.chunk_rows_swept = await self.sweep(out.continuations.values(), live)
        return out

    async def sweep(self, continuations: Iterable[Continuation | None], live: set) -> int:
        """Delete chunk rows that outlived their call: rows neither named by a continuation
        being kept nor belonging to a call attempt still in flight (a call that finished, was
        aborted, or died with a previous run). Rows must not outlive their call past the next
        checkpoint, or every snapshot carries them forever."""
        if self.store is None:
            return 0
        partition = self.cfg.token_capture.staging_partition
        keep = {k for c in continuations if c is not None for k in c.keys or []}
        doomed = [
            key
            for key in await self.store.alist(partition)
            if key not in keep and CallIdentity.of_chunk_key(key) not in live
        ]
        if doomed:
            await self.store.adelete(partition, doomed)
            crash_point("chunks_swept")
            self.counts["chunk_rows_swept"] += len(doomed)
        return len(doomed)

    async def load(self, restore_id: str, episodes: list[Episode]) -> int:
        """Take a restored snapshot's episodes (pending until their step runs)."""
        await self.sweep([ep.continuation for ep in episodes], set())
        self.pending = {ep.rollout_id: ep for ep in episodes}
        self.participant.restored(restore_id)
        return len(self.pending)

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
        for client in self.clients:
            await client.aclose()
