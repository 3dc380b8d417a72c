"""The per-attempt engine evidence log: cursor reads, bounded memory, verdicts."""

from __future__ import annotations

import pytest

from rollout_recovery.generation.attempts import AttemptLog
from rollout_recovery.protocol import CallIdentity


def test_records_what_happened_per_attempt():
    log = AttemptLog()
    a0, a1 = CallIdentity("r", "c0", 0), CallIdentity("r", "c0", 1)
    log.started(a0)
    log.decoded(a0, 3)
    log.decoded(a0, 2)
    log.finished(a0, "abort")
    log.verdict(a1, "resumed", prefix_tokens=5)
    log.started(a1)
    log.decoded(a1, 4)
    log.finished(a1, "length")
    got = {r.attempt: r for r in log.read().attempts}
    assert (got[0].resume, got[0].decoded_tokens, got[0].finish_reason) == ("none", 5, "abort")
    assert (got[1].resume, got[1].prefix_tokens, got[1].decoded_tokens) == ("resumed", 5, 4)
    assert got[1].requests == 1 and got[1].finished


def test_cursor_returns_each_change_once_in_order():
    log = AttemptLog()
    a, b = CallIdentity("r", "c0", 0), CallIdentity("s", "c0", 0)
    log.started(a)
    page = log.read()
    assert [r.rollout_id for r in page.attempts] == ["r"]
    log.started(b)
    log.decoded(a, 1)
    page2 = log.read(page.next)
    assert [r.rollout_id for r in page2.attempts] == ["s", "r"]
    assert log.read(page2.next).attempts == []
    first = log.read(0, limit=1)
    assert len(first.attempts) == 1 and log.read(first.next).attempts != []


def test_bounded_and_counts_what_it_dropped():
    log = AttemptLog(max_records=2)
    for i in range(5):
        log.started(CallIdentity(f"r{i}", "c0", 0))
    page = log.read()
    assert [r.rollout_id for r in page.attempts] == ["r3", "r4"] and page.dropped == 3
    log.decoded(CallIdentity("r3", "c0", 0), 1)  # r3 changed last: r4 is the stalest now
    log.started(CallIdentity("r5", "c0", 0))
    assert [r.rollout_id for r in log.read().attempts] == ["r3", "r5"]
    with pytest.raises(ValueError):
        AttemptLog(max_records=0)


def test_first_token_at_is_when_the_first_token_was_sampled_and_stays(monkeypatch):
    clock = iter([100.0, 200.0, 300.0])
    monkeypatch.setattr("rollout_recovery.generation.attempts.time.time", lambda: next(clock))
    log = AttemptLog()
    a = CallIdentity("r", "c0", 1)
    log.verdict(a, "resumed", prefix_tokens=5)
    log.started(a)
    log.decoded(a, 0)  # an output without new tokens is no first token
    assert log.read().attempts[0].first_token_at is None
    log.decoded(a, 2)
    log.decoded(a, 3)
    [rec] = log.read().attempts
    assert rec.first_token_at == 100.0 and rec.decoded_tokens == 5
