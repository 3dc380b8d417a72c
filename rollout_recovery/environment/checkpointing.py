"""The environment's side of a checkpoint and a restore: prepare, commit, sweep, load.

- `prepare(ckpt)` closes admission (model calls park at their next turn boundary) and, at
  prefix level, has the worker pool cut each worker's in-flight calls; each receipt is kept on
  the call it cut;
- `commit(ckpt, episodes)` returns the episode records (journals, each call's token entry, the
  continuation of the call in flight), all read at once between steps, and sweeps stale
  staging rows;
- `load(restore_id, episodes)` takes a restored snapshot's episodes: each one's call that was
  in flight waits on its continuation.

Which staged chunk rows a sweep keeps is decided from the calls' `InflightCall` objects alone
(environment/inflight.py). With several environments, environment `index` of `count` sweeps
only its own rollouts' rows (`environment_of`): the others' are not its to judge.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from rollout_recovery.config import EnvironmentActorConfig
from rollout_recovery.crashpoints import crash_point
from rollout_recovery.environment.episode import EpisodeState
from rollout_recovery.environment.inflight import CallTable
from rollout_recovery.environment.participant import CheckpointParticipant
from rollout_recovery.generation.pool import WorkerPool
from rollout_recovery.protocol import (
    CallIdentity,
    CallRef,
    CheckpointRecords,
    Continuation,
    CutInventory,
    environment_of,
)


class EnvironmentCheckpoints:
    """One environment's checkpoint side; every method runs on the environment's loop."""

    def __init__(
        self,
        cfg: EnvironmentActorConfig,
        workers: WorkerPool,
        store,
        calls: CallTable,
        participant: CheckpointParticipant,
        counts: Counter[str],
        index: int = 0,
        count: int = 1,
    ) -> None:
        self.cfg, self.workers, self.store, self.calls = cfg, workers, store, calls
        self.participant, self.counts = participant, counts
        self.index, self.count = index, count

    def owns(self, rollout: str) -> bool:
        """Whether rollout `rollout` is this environment's (`environment_of`)."""
        return environment_of(rollout, self.count) == self.index

    async def prepare(self, ckpt: str, lease_s: float) -> dict:
        """Close admission and (prefix level) cut every in-flight call. Returns the count of
        calls cut and of calls not cut, by reason."""
        self.participant.prepare(ckpt, lease_s)
        self.calls.clear_cuts()
        cut, not_cut = 0, Counter[str]()
        if self.cfg.rollout_recovery.target_level == "prefix":
            refs: dict[int, list[CallRef]] = {}
            for call in self.calls.in_flight():
                refs.setdefault(call.worker, []).append(CallRef(**call.attempt._asdict()))
            inventories = {w: CutInventory(checkpoint_id=ckpt, calls=r) for w, r in refs.items()}
            for receipt in await self.workers.cut(inventories):
                for c in receipt["calls"]:
                    # A terminal completion is a whole answer: a resume returns it without
                    # decoding. A call not cut is regenerated after a restore (next attempt).
                    cont = Continuation.from_receipt(c)
                    if cont.cut:
                        cut += 1
                    else:
                        not_cut[c["reason"]] += 1
                    self.calls.record_cut(c["rollout_id"], cont)
        self.participant.prepared(ckpt)
        return {"calls_cut": cut, "calls_not_cut": dict(not_cut)}

    async def commit(self, ckpt: str, episodes: Iterable[EpisodeState]) -> CheckpointRecords:
        """The records of `episodes` (this environment's, running or restored) with the
        continuations of their calls; then the staging rows no call needs are deleted."""
        self.participant.commit(ckpt)
        out = CheckpointRecords()
        for ep in episodes:
            rec = ep.to_record(self.calls.continuation(ep.rollout_id))
            out.episodes.append(rec)
            if rec.continuation is not None:
                out.continuations[ep.rollout_id] = rec.continuation
        out.chunk_rows_swept = await self.sweep()
        return out

    async def sweep(self) -> int:
        """Delete chunk rows that outlived their call: rows neither named by a continuation a
        call still needs nor belonging to a call attempt still live (a call that finished, was
        aborted, or died with a previous run). Rows must not outlive their call past the next
        checkpoint, or every snapshot carries them forever. Only this environment's rows are
        considered (`owns`; a row of no call's shape is environment 0's)."""
        if self.store is None:
            return 0
        partition = self.cfg.token_capture.staging_partition
        keep, live = self.calls.kept()
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

    async def load(self, restore_id: str, episodes: list[EpisodeState]) -> None:
        """Take a restored snapshot's episodes: the call each had in flight waits on the
        continuation its record brought (taken over from the episode state); rows no such
        continuation names are swept."""
        for ep in episodes:
            if ep.continuation is not None:
                self.calls.wait_on(ep.rollout_id, ep.continuation, moved=False)
                ep.continuation = None
        await self.sweep()
        self.participant.restored(restore_id)
