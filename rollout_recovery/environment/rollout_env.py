"""RolloutEnvironment: runs episodes against the workers' OpenAI endpoints and takes part in
checkpoints (DESIGN.md §3-4).

Episodes are single-turn GRPO prompts or multi-turn tool episodes (`environment.max_turns`).
Every call goes through `ModelCallClient` (token capture, lineage, exact prefix supply), and a
finished episode becomes one `replay` row. Checkpoint side:

- `prepare(ckpt)` closes admission (episodes park at their next turn boundary) and, at prefix
  level, sends each worker the inventory of its in-flight calls; the receipts become
  continuations;
- `commit(ckpt)` returns the episode records: committed turns, tool state, and the
  continuation of the call in flight (prefix level) - all read at once, between turns;
- `resume(ckpt)` reopens admission (also after an aborted attempt);
- `begin_restore` / `end_restore(records)` load records into a fresh environment; each
  unfinished episode is re-admitted as attempt + 1 from its last committed turn.

The public methods are synchronous (a threaded Ray actor calls them concurrently); they run
their work on one private event loop, which owns the HTTP connection pools.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import Counter
from collections.abc import Callable

from rollout_recovery import faults
from rollout_recovery.config import RolloutRecoveryConfig
from rollout_recovery.data_plane import replay_rows_to_table, table_to_replay_rows
from rollout_recovery.environment.episode import (
    Episode,
    RecordError,
    TallyTool,
    TurnRecord,
    call_seed,
    replay_row,
)
from rollout_recovery.environment.lineage import LineageStore
from rollout_recovery.environment.model_client import ModelCallClient
from rollout_recovery.environment.participant import CheckpointParticipant
from rollout_recovery.environment.token_sink import StoreTokenSink
from rollout_recovery.protocol import (
    XARG_SEED,
    XARG_TEMPERATURE,
    CallIdentity,
    Continuation,
    replay_key,
    rollout_id,
)


class RolloutEnvironment:
    def __init__(self, cfg: RolloutRecoveryConfig, workers: list, store) -> None:
        self.cfg, self.workers, self.store = cfg, workers, store
        self.max_turns = cfg.environment.max_turns
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.sink = sink = StoreTokenSink(store) if store is not None else None
        lineage = LineageStore()
        tc = cfg.token_capture
        self.clients = [
            ModelCallClient(
                w.info.url,
                w.info.served_model_name,
                sink,
                lineage,
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
        self._inflight: dict[str, tuple[int, str, int]] = {}  # rollout -> (worker, call, attempt)
        self._cuts: dict[str, dict] = {}  # this checkpoint's continuations, by rollout
        self._rr = itertools.count()
        self.counts: Counter[str] = Counter()

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _call(self, fn, *args):
        """Run a synchronous step on the loop thread (the participant's event lives there)."""

        async def call():
            return fn(*args)

        return self._run(call())

    # ------------------------------------------------------------------ episodes

    def run_groups(
        self,
        groups: list[tuple[str, list[dict]]],
        seeds: list[list[int]],
        reward_fn: Callable[[str], float],
        weight_version: int,
    ) -> list[tuple]:
        """Run `len(seeds[g])` episodes per (group id, messages); returns, per episode in
        order, (replay row, tokens decoded now, final tool state). Episodes whose row is
        already in `replay` are not run again; restored ones continue from their record."""
        return self._run(self._run_groups(groups, seeds, reward_fn, weight_version))

    async def _run_groups(self, groups, seeds, reward_fn, weight_version):
        done = set(self.store.list("replay"))
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

    async def _existing(self, key: str):
        table, _ = await self.store.aget("replay", [key])
        return table_to_replay_rows(table)[0], 0, None

    async def _episode(self, ep: Episode, reward_fn, weight_version: int, restored: bool):
        worker = next(self._rr) % len(self.clients)
        client = self.clients[worker]
        g = self.cfg.policy.generation
        if restored:
            self.counts["restored_episodes"] += 1
            for t in ep.turns:
                request, reply = ep.messages[: t.request_messages], ep.messages[t.request_messages]
                client.adopt(t.entry, request, reply)
                self.counts["restored_turn_tokens"] += len(t.entry.generated_token_ids)
        self.episodes[ep.rollout_id] = ep
        decoded = 0
        try:
            while len(ep.turns) < self.max_turns:
                turn, call_id = len(ep.turns), ep.next_call_id
                cont, ep.continuation = ep.continuation, None
                if cont is not None and cont.get("call_id", "c0") != call_id:
                    cont = None
                xargs = {XARG_SEED: call_seed(ep.seed, turn), XARG_TEMPERATURE: g.temperature}
                if cont and cont.get("keys"):
                    xargs |= Continuation(**cont).to_request_fields(g.max_new_tokens)
                    self.counts["restored_calls"] += 1
                    self.counts["restored_prefix_tokens"] += cont["tokens"]
                await self.participant.admitted()  # parked while a checkpoint is being taken
                self._inflight[ep.rollout_id] = (worker, call_id, ep.attempt)
                try:
                    res = await client.call(
                        ep.rollout_id,
                        call_id,
                        ep.messages,
                        attempt=ep.attempt,
                        temperature=0.0,  # sampling is the position-keyed sampler's
                        max_tokens=g.max_new_tokens,
                        ignore_eos=self.max_turns == 1,  # a turn of an episode ends at its EOS
                        vllm_xargs=xargs,
                    )
                finally:
                    self._inflight.pop(ep.rollout_id, None)
                n = len(res.entry.generated_token_ids)
                decoded += n
                if cont and cont.get("keys"):
                    self.counts["tail_tokens"] += n - cont["tokens"]
                elif cont is not None:  # in flight at the checkpoint, not cut: decoded again
                    self.counts["regenerated_tokens"] += n
                # The turn boundary: record the turn and apply the tool with no await between,
                # so a checkpoint sees both or neither.
                ep.messages.append(res.assistant_message)
                ep.turns.append(TurnRecord(res.entry, len(ep.messages) - 1))
                if len(ep.turns) < self.max_turns:
                    reply = res.assistant_message.get("content") or ""
                    result = self.tool.apply(ep.state, turn, reply)
                    self.counts["tool_applications"] += 1
                    ep.messages.append({"role": "tool", "name": self.tool.name, "content": result})
            row = replay_row(ep, float(reward_fn("".join(ep.replies()))), weight_version)
            # Durable as soon as it is finished: a crash later does not regenerate it.
            await self.store.aput("replay", replay_rows_to_table([row]))
        finally:
            self.episodes.pop(ep.rollout_id, None)
        return row, decoded, ep.state

    def counters(self) -> dict[str, int]:
        return dict(self.counts)

    # ------------------------------------------------------------------ checkpoints

    def prepare(self, ckpt: str, lease_s: float) -> dict:
        """Close admission and (prefix level) cut every in-flight call. Returns the count of
        calls cut and of calls not cut, by reason."""
        return self._run(self._prepare(ckpt, lease_s))

    async def _prepare(self, ckpt: str, lease_s: float) -> dict:
        self.participant.prepare(ckpt, lease_s)
        self._cuts = {}
        not_cut: Counter[str] = Counter()
        if self.cfg.rollout_recovery.target_level == "prefix":
            per_worker: dict[int, list[dict]] = {}
            for rid, (worker, call_id, attempt) in dict(self._inflight).items():
                per_worker.setdefault(worker, []).append(
                    {"rollout_id": rid, "model_call_id": call_id, "attempt": attempt}
                )
            receipts = await asyncio.gather(*(
                self.workers[w].actor.cut.remote({"checkpoint_id": ckpt, "calls": calls})
                for w, calls in per_worker.items()
            ))  # fmt: skip
            for receipt in receipts:
                for c in receipt["calls"]:
                    # A terminal completion is a whole answer: a resume returns it without
                    # decoding. A call not cut is regenerated after a restore (next attempt).
                    cont = Continuation.from_receipt(c)
                    if not cont.cut:
                        not_cut[c["reason"]] += 1
                    self._cuts[c["rollout_id"]] = cont.to_record()
        self.participant.prepared(ckpt)
        return {"calls_cut": sum(1 for c in self._cuts.values() if "keys" in c),
                "calls_not_cut": dict(not_cut)}  # fmt: skip

    def commit(self, ckpt: str) -> dict:
        """The episode records of this checkpoint and the continuations of in-flight calls;
        then the staging rows that no live call and no continuation needs are deleted."""
        return self._run(self._commit(ckpt))

    async def _commit(self, ckpt: str) -> dict:
        self.participant.commit(ckpt)
        records, continuations = [], {}
        for ep in [*self.episodes.values(), *self.pending.values()]:
            rec = ep.to_record()
            if ep.rollout_id in self.pending:  # not re-admitted yet: its record is unchanged
                cont = ep.continuation
            elif ep.rollout_id in self._inflight:
                _, call_id, attempt = self._inflight[ep.rollout_id]
                cut = self._cuts.get(ep.rollout_id)
                same = cut and (cut["call_id"], cut["attempt"]) == (call_id, attempt)
                cont = cut if same else Continuation(call_id=call_id, attempt=attempt).to_record()
            else:
                cont = None  # parked at a turn boundary
            rec["continuation"] = cont
            records.append(rec)
            if cont is not None:
                continuations[ep.rollout_id] = cont
        live = {(rid, call, a) for rid, (_, call, a) in self._inflight.items()}
        swept = await self._sweep(continuations.values(), live)
        return {"episodes": records, "continuations": continuations, "chunk_rows_swept": swept}

    async def _sweep(self, continuations, live: set[tuple[str, str, int]]) -> int:
        """Delete chunk rows that outlived their call: rows neither named by a continuation
        being kept nor belonging to a call attempt still in flight (a call that finished, was
        aborted, or died with a previous run). Rows must not outlive their call past the next
        checkpoint, or every snapshot carries them forever."""
        if self.store is None:
            return 0
        partition = self.cfg.token_capture.staging_partition
        keep = {k for c in continuations if c for k in c.get("keys", [])}
        doomed = [
            key
            for key in await self.store.alist(partition)
            if key not in keep and CallIdentity.of_chunk_key(key) not in live
        ]
        if doomed:
            await self.store.adelete(partition, doomed)
            self.counts["chunk_rows_swept"] += len(doomed)
        return len(doomed)

    def resume(self, ckpt: str) -> None:
        """End of a checkpoint, committed or aborted: reopen admission."""
        self._call(self.participant.resume, ckpt)

    def begin_restore(self, restore_id: str) -> None:
        """Refused once this environment has served calls (their effects would mix in)."""
        self._call(self.participant.restore, restore_id)

    def end_restore(self, restore_id: str, records: list[dict]) -> int:
        """Load the episode records of a restored snapshot (their token entries come from
        the restored store); returns how many episodes are unfinished. A record that cannot
        be restored exactly fails closed: its episode starts over, counted by reason. Chunk
        rows the records do not name belonged to calls that are gone: they are deleted."""
        entries = self.sink.get_many([t["entry_id"] for rec in records for t in rec["turns"]])
        episodes = []
        for rec in records:
            if rec["turns"] and faults.active("redecode_committed_turns"):
                episodes.append(Episode.restart(rec, self.tool.initial_state()))
                continue
            try:
                episodes.append(Episode.from_record(rec, entries.get))
            except RecordError as err:
                self.counts[f"restore_refused.{err.reason}"] += 1
                episodes.append(Episode.restart(rec, self.tool.initial_state()))

        async def load():
            await self._sweep([ep.continuation for ep in episodes], set())
            self.pending = {ep.rollout_id: ep for ep in episodes}
            self.participant.restored(restore_id)
            return len(self.pending)

        return self._run(load())

    def close(self) -> None:
        async def close_clients():
            for c in self.clients:
                await c.aclose()

        self._run(close_clients())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


class RolloutEnvironmentActor:
    """The Ray actor around `RolloutEnvironment`. Only synchronous methods, so Ray runs them
    on a thread pool (`max_concurrency`) rather than one event loop: a checkpoint's prepare
    must not queue behind a running `run_groups`."""

    def __init__(self, cfg: RolloutRecoveryConfig, workers: list, store) -> None:
        self.env = RolloutEnvironment(cfg, workers, store)

    def run_groups(self, groups, seeds, reward_fn, weight_version: int) -> list[tuple]:
        return self.env.run_groups(groups, seeds, reward_fn, weight_version)

    def prepare(self, ckpt: str, lease_s: float) -> dict:
        return self.env.prepare(ckpt, lease_s)

    def commit(self, ckpt: str) -> dict:
        return self.env.commit(ckpt)

    def resume(self, ckpt: str) -> None:
        self.env.resume(ckpt)

    def begin_restore(self, restore_id: str) -> None:
        self.env.begin_restore(restore_id)

    def end_restore(self, restore_id: str, records: list[dict]) -> int:
        return self.env.end_restore(restore_id, records)

    def counters(self) -> dict[str, int]:
        return self.env.counters()

    def close(self) -> None:
        self.env.close()
