"""Assertions on what a worker's engine did for a call attempt (its `call_attempts` record):
the only evidence that tells a resumed call from one silently decoded from scratch."""

from __future__ import annotations


def attempt_record(worker, rollout: str, attempt: int, call: str = "c0") -> dict:
    page = worker.call_attempts(0)
    found = [
        r
        for r in page["attempts"]
        if (r["rollout_id"], r["model_call_id"], r["attempt"]) == (rollout, call, attempt)
    ]
    assert len(found) == 1, f"no engine record of {rollout}/{call}/a{attempt}"
    return found[0]


def assert_resumed(worker, rollout: str, attempt: int, prefix: int, length: int) -> dict:
    """The worker resumed the attempt from `prefix` staged tokens and its engine decoded
    exactly the rest of the call's `length` tokens."""
    rec = attempt_record(worker, rollout, attempt)
    assert rec["resume"] == "resumed", rec
    assert rec["prefix_tokens"] == prefix, rec
    assert rec["decoded_tokens"] == length - prefix, rec
    assert rec["finished"], rec
    return rec


def assert_from_scratch(worker, rollout: str, attempt: int, reason: str, length: int) -> dict:
    """The continuation was refused for `reason` and the engine decoded the whole call."""
    rec = attempt_record(worker, rollout, attempt)
    assert (rec["resume"], rec["refused_reason"]) == ("refused", reason), rec
    assert rec["prefix_tokens"] == 0, rec
    assert rec["decoded_tokens"] == length, rec
    assert rec["finished"], rec
    return rec
