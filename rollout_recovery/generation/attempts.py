"""What the engine did for each identified call attempt: the evidence that a call resumed.

With a deterministic sampler a call that silently started over returns exactly what a resumed
call returns, so a recovery claim cannot be checked on outputs. Each worker therefore keeps,
per call attempt (rollout id, model call id, attempt), what happened inside it:

- `resume`: `none` (no continuation came with it), `resumed`, or `refused` with the reason
  the continuation failed closed for (the call was then decoded from scratch);
- `prefix_tokens`: staged tokens spliced into the engine prompt instead of being decoded;
- `decoded_tokens`: tokens the engine sampled for this attempt, summed from the engine core's
  outputs (`new_token_ids` of every step), never derived from the request;
- `finish_reason` once the attempt ended (`abort` when it was cancelled).

The log is bounded: past `max_records` the attempts changed longest ago are dropped and
counted. Readers page through it with `since` (every change bumps a record's `seq`), so a
caller can collect the finished attempts of a run without missing or repeating one while the
log is in use.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Literal

from pydantic import BaseModel

from rollout_recovery.protocol import CallIdentity

ResumeVerdict = Literal["none", "resumed", "refused"]


class AttemptRecord(BaseModel):
    """One call attempt as its worker's engine saw it (the wire form)."""

    rollout_id: str
    model_call_id: str
    attempt: int
    resume: ResumeVerdict = "none"
    refused_reason: str | None = None
    prefix_tokens: int = 0
    decoded_tokens: int = 0
    requests: int = 0  # engine requests made for it (a client retry adds one)
    finished: bool = False
    finish_reason: str | None = None
    seq: int = 0  # the log's change counter at this record's last change
    first_token_at: float | None = None  # wall time the engine sampled its first token


class AttemptPage(BaseModel):
    """Records changed after `since`, in change order; `next` is the cursor for the next read."""

    attempts: list[AttemptRecord]
    dropped: int  # attempts evicted from the log so far (oldest first)
    next: int


@dataclass
class _Entry:
    resume: ResumeVerdict = "none"
    refused_reason: str | None = None
    prefix_tokens: int = 0
    decoded_tokens: int = 0
    requests: int = 0
    finished: bool = False
    finish_reason: str | None = None
    seq: int = 0
    first_token_at: float | None = None


class AttemptLog:
    """Bounded, thread-safe: the engine's output hook and the resume path both write it."""

    def __init__(self, max_records: int = 100_000) -> None:
        if max_records < 1:
            raise ValueError("max_records must be >= 1")
        self.max_records = max_records
        self.dropped = 0
        self._seq = 0
        self._lock = threading.Lock()
        self._entries: OrderedDict[CallIdentity, _Entry] = OrderedDict()

    def _entry(self, identity: CallIdentity) -> _Entry:
        """The attempt's entry, moved to the newest end (the log is kept in change order, so
        a read walks back only over what changed and eviction drops the stalest)."""
        entry = self._entries.get(identity)
        if entry is None:
            entry = self._entries[identity] = _Entry()
            while len(self._entries) > self.max_records:
                self._entries.popitem(last=False)
                self.dropped += 1
        else:
            self._entries.move_to_end(identity)
        self._seq += 1
        entry.seq = self._seq
        return entry

    def verdict(
        self,
        identity: CallIdentity,
        resume: ResumeVerdict,
        reason: str | None = None,
        prefix_tokens: int = 0,
    ) -> None:
        """What the worker decided about the attempt's continuation."""
        with self._lock:
            entry = self._entry(identity)
            entry.resume, entry.refused_reason, entry.prefix_tokens = resume, reason, prefix_tokens

    def started(self, identity: CallIdentity) -> None:
        """The engine accepted a request for this attempt."""
        with self._lock:
            entry = self._entry(identity)
            entry.requests += 1
            entry.finished, entry.finish_reason = False, None

    def decoded(self, identity: CallIdentity, n: int) -> None:
        """The engine core returned `n` newly sampled tokens for this attempt."""
        if n:
            with self._lock:
                entry = self._entry(identity)
                entry.decoded_tokens += n
                if entry.first_token_at is None:  # when a resumed call's tail began (bench)
                    entry.first_token_at = time.time()

    def finished(self, identity: CallIdentity, reason: str | None) -> None:
        with self._lock:
            entry = self._entry(identity)
            entry.finished, entry.finish_reason = True, reason

    def decoded_tokens(self, identity: CallIdentity) -> int:
        """Tokens the engine has sampled for this attempt so far (0 when unknown)."""
        with self._lock:
            entry = self._entries.get(identity)
            return entry.decoded_tokens if entry is not None else 0

    def read(self, since: int = 0, limit: int | None = None) -> AttemptPage:
        """Records whose last change came after `since`, oldest change first (at most
        `limit`; read again from `next` for the rest)."""
        with self._lock:
            changed = []
            for ident, e in reversed(self._entries.items()):
                if e.seq <= since:
                    break
                changed.append((ident, e))
            changed.reverse()
            more = limit is not None and len(changed) > limit
            if more:
                changed = changed[:limit]
            records = [
                AttemptRecord(
                    rollout_id=ident.rollout_id,
                    model_call_id=ident.model_call_id,
                    attempt=ident.attempt,
                    **asdict(e),
                )
                for ident, e in changed
            ]
            nxt = changed[-1][1].seq if more else max(since, self._seq)
            return AttemptPage(attempts=records, dropped=self.dropped, next=nxt)
