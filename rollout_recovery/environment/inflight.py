"""Each episode's model call as the environment tracks it: one object per call, in one map.

An episode makes one model call at a time, so a call's state is one `InflightCall`, keyed by
rollout id in a `CallTable`. The object exists while the call holds anything the data plane
must keep or a checkpoint must record:

    waiting --admitted--> in flight --answered--> (gone)
       ^                      |
       |                   its worker died
       +------ moved ------ lost

- waiting: the continuation its next attempt resumes from - a restored episode's call that
  was in flight at the checkpoint, or a moved call's newest verified prefix (`moved`);
- in flight: the attempt a worker is running, on which worker, and the cut prefix it resumes
  from (its chunk rows are read while it runs);
- lost: the attempt whose worker died and the prefix it resumed from, until the next attempt
  is in flight (its rows are where the next attempt resumes from).

A checkpoint's cut receipt is kept on the call it cut. What a checkpoint records for a call
(`checkpoint_continuation`) and which staged chunk rows a sweep keeps (`CallTable.kept`) are
worked out from these objects alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from rollout_recovery.protocol import CallIdentity, Continuation


@dataclass
class InflightCall:
    rollout_id: str
    waiting: Continuation | None = None  # what the next attempt resumes from
    moved: bool = False  # `waiting` is a failover's (not a restore's)
    worker: int | None = None  # the worker running `attempt`
    attempt: CallIdentity | None = None  # the attempt in flight
    resumed_from: Continuation | None = None  # the cut prefix `attempt` resumes from
    lost: CallIdentity | None = None  # the attempt whose worker died
    lost_resumed_from: Continuation | None = None  # the cut prefix `lost` resumed from
    cut: Continuation | None = None  # this checkpoint's receipt for `attempt`

    @property
    def in_flight(self) -> bool:
        return self.attempt is not None

    @property
    def moving(self) -> bool:
        """Between a lost worker and the next attempt being in flight."""
        return self.lost is not None or (self.moved and self.waiting is not None)

    def idle(self) -> bool:
        """Nothing left to keep or record: the object can go."""
        return self.waiting is None and self.attempt is None and self.lost is None

    def checkpoint_continuation(self) -> Continuation | None:
        """What a checkpoint records for this call: the continuation it waits on, its cut, or
        (in flight or lost, not cut) its identity alone - the next attempt decodes it again."""
        if self.waiting is not None:
            return self.waiting
        if self.lost is not None:
            return Continuation(call_id=self.lost.model_call_id, attempt=self.lost.attempt)
        if self.attempt is None:
            return None
        cut, call = self.cut, self.attempt
        if cut is not None and (cut.call_id, cut.attempt) == (call.model_call_id, call.attempt):
            return cut
        return Continuation(call_id=call.model_call_id, attempt=call.attempt)

    def kept_keys(self) -> set[str]:
        """Chunk keys this call still needs: those of its recorded continuation and of the
        prefixes its running or lost attempt resumes from."""
        held = (self.checkpoint_continuation(), self.resumed_from, self.lost_resumed_from)
        return {k for c in held if c is not None for k in c.keys or []}

    def live_attempts(self) -> set[CallIdentity]:
        """Attempts whose own rows are still being written or read."""
        return {a for a in (self.attempt, self.lost) if a is not None}


class CallTable:
    """Every episode's call of one environment, by rollout id; the transitions above."""

    def __init__(self) -> None:
        self._calls: dict[str, InflightCall] = {}

    def __contains__(self, rollout: object) -> bool:
        return rollout in self._calls

    def __len__(self) -> int:
        return len(self._calls)

    def __iter__(self) -> Iterator[InflightCall]:
        return iter(list(self._calls.values()))

    def get(self, rollout: str) -> InflightCall | None:
        return self._calls.get(rollout)

    def _of(self, rollout: str) -> InflightCall:
        return self._calls.setdefault(rollout, InflightCall(rollout))

    def _tidy(self, call: InflightCall) -> None:
        if call.idle():
            self._calls.pop(call.rollout_id, None)

    def wait_on(self, rollout: str, continuation: Continuation | None, moved: bool) -> None:
        """The call's next attempt resumes from `continuation` (restored or moved)."""
        call = self._of(rollout)
        call.waiting, call.moved = continuation, moved
        call.lost = call.lost_resumed_from = None
        self._tidy(call)

    def start(self, rollout: str, worker: int, attempt: CallIdentity, cont: Continuation | None):
        """`attempt` is in flight on `worker`, resuming from `cont` when it is cut."""
        call = self._of(rollout)
        call.waiting, call.moved, call.lost, call.lost_resumed_from = None, False, None, None
        call.worker, call.attempt = worker, attempt
        call.resumed_from = cont if cont is not None and cont.cut else None

    def lose(self, rollout: str) -> None:
        """The attempt in flight lost its worker: its rows stay until the next attempt."""
        call = self._of(rollout)
        call.lost, call.lost_resumed_from = call.attempt, call.resumed_from

    def forget_loss(self, rollout: str) -> None:
        """The loss was not a worker's death after all (or the call gives up)."""
        call = self._calls.get(rollout)
        if call is not None:
            call.lost = call.lost_resumed_from = None
            self._tidy(call)

    def ended(self, rollout: str) -> None:
        """The attempt in flight came back (answered, failed or lost)."""
        call = self._calls.get(rollout)
        if call is not None:
            call.worker = call.attempt = call.resumed_from = call.cut = None
            self._tidy(call)

    def drop(self, rollout: str) -> None:
        """The episode ended or starts over: nothing of its call is kept."""
        self._calls.pop(rollout, None)

    def record_cut(self, rollout: str, cut: Continuation) -> None:
        call = self._calls.get(rollout)
        if call is not None:
            call.cut = cut

    def clear_cuts(self) -> None:
        for call in self._calls.values():
            call.cut = None

    def continuation(self, rollout: str) -> Continuation | None:
        call = self._calls.get(rollout)
        return call.checkpoint_continuation() if call is not None else None

    def kept(self) -> tuple[set[str], set[CallIdentity]]:
        """The chunk keys every call still needs, and every live attempt (the sweep's)."""
        keys: set[str] = set()
        live: set[CallIdentity] = set()
        for call in self._calls.values():
            keys |= call.kept_keys()
            live |= call.live_attempts()
        return keys, live

    def in_flight(self) -> list[InflightCall]:
        return [c for c in self._calls.values() if c.in_flight]
