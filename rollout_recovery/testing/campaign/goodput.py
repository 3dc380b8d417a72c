"""Goodput of a run under faults, counted from the engines' own call-attempt records.

An engine's record of one call attempt says where it started (`prefix_tokens`: what it was
resumed from) and how many tokens it sampled (`decoded_tokens`), and when its first token came
(`first_token_at`). One attempt can be read several times (before a fault, from the run's
evidence log), and a restore from an older snapshot can run an attempt number again, so an
*execution* is keyed by the attempt and its first token's time, keeping its longest reading.

Per call, every execution covers token positions [prefix, prefix + decoded). A position that a
later execution samples again is work lost; it is charged to the last fault before that later
execution's first token (the fault that made the call run again). Positions sampled once but
never trained (a rollout the run dropped) are lost too, charged to no fault.

goodput = tokens trained / tokens decoded, both counted in generated tokens.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from rollout_recovery.testing.campaign.engine_evidence import union


@dataclass(frozen=True)
class Execution:
    """One call attempt as an engine ran it."""

    rollout_id: str
    call_id: str
    attempt: int
    start: int  # the prefix it was resumed from, in generated tokens
    decoded: int
    first_token_at: float

    @property
    def end(self) -> int:
        return self.start + self.decoded


@dataclass(frozen=True)
class Fault:
    at: float  # wall clock (time.time()), as the engines' first_token_at
    kind: str


def executions(records: Iterable[dict]) -> list[Execution]:
    """The distinct executions in any number of readings of the engines' records."""
    longest: dict[tuple, Execution] = {}
    for r in records:
        if not r.get("first_token_at") or not r.get("decoded_tokens"):
            continue  # sampled nothing
        e = Execution(
            r["rollout_id"],
            r["model_call_id"],
            r["attempt"],
            r.get("prefix_tokens") or 0,
            r["decoded_tokens"],
            r["first_token_at"],
        )
        key = (e.rollout_id, e.call_id, e.attempt, round(e.first_token_at, 6))
        if key not in longest or e.decoded > longest[key].decoded:
            longest[key] = e
    return sorted(longest.values(), key=lambda e: e.first_token_at)


def _covered(intervals: list[tuple[int, int]], start: int, end: int) -> int:
    """How many positions of [start, end) the intervals cover."""
    return sum(max(0, min(e, end) - max(s, start)) for s, e in union(intervals))


def account(execs: list[Execution], faults: list[Fault], trained_tokens: int) -> dict:
    """Tokens decoded, trained and lost (in total, per fault and per kind of fault)."""
    faults = sorted(faults, key=lambda f: f.at)
    times = [f.at for f in faults]
    per_fault = [0] * len(faults)
    before_any = 0  # decoded again with no fault before it (a bug in a fault-free run)
    by_call: dict[tuple[str, str], list[Execution]] = defaultdict(list)
    for e in execs:
        by_call[(e.rollout_id, e.call_id)].append(e)
    covered = 0
    for runs in by_call.values():
        seen: list[tuple[int, int]] = []
        for e in sorted(runs, key=lambda x: x.first_token_at):
            again = _covered(seen, e.start, e.end)
            if again:
                i = bisect.bisect_left(times, e.first_token_at) - 1
                if i >= 0:
                    per_fault[i] += again
                else:
                    before_any += again
            seen.append((e.start, e.end))
        covered += _covered(seen, 0, max(end for _, end in seen))
    decoded = sum(e.decoded for e in execs)
    kinds: dict[str, dict[str, int]] = defaultdict(lambda: {"faults": 0, "tokens_lost": 0})
    for f, lost in zip(faults, per_fault, strict=True):
        kinds[f.kind]["faults"] += 1
        kinds[f.kind]["tokens_lost"] += lost
    return {
        "decoded": decoded,
        "trained": trained_tokens,
        "goodput": trained_tokens / decoded if decoded else 1.0,
        "decoded_again": sum(per_fault) + before_any,
        "decoded_again_without_fault": before_any,
        "decoded_not_trained": covered - trained_tokens,
        "lost_per_fault": per_fault,
        "lost_by_kind": dict(kinds),
    }


def unrecorded(execs: list[Execution], trained: dict[str, int]) -> dict[str, int]:
    """Trained rollouts whose trained tokens the records do not all show decoded: rollout id ->
    tokens missing (a reading was lost, so goodput would count too few tokens decoded)."""
    spans: dict[str, dict[str, list[tuple[int, int]]]] = defaultdict(lambda: defaultdict(list))
    for e in execs:
        spans[e.rollout_id][e.call_id].append((e.start, e.end))
    out = {}
    for rollout, tokens in trained.items():
        calls = spans.get(rollout, {})
        seen = sum(_covered(iv, 0, max(end for _, end in iv)) for iv in calls.values())
        if seen < tokens:
            out[rollout] = tokens - seen
    return out
