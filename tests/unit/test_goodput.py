"""Goodput from the engines' records: what was decoded again, and which fault it is charged to."""

from __future__ import annotations

import pytest

from rollout_recovery.testing.campaign.goodput import Fault, account, executions, unrecorded


def rec(rollout: str, attempt: int, prefix: int, decoded: int, at: float, call: str = "c0"):
    return {"rollout_id": rollout, "model_call_id": call, "attempt": attempt,
            "prefix_tokens": prefix, "decoded_tokens": decoded, "first_token_at": at}  # fmt: skip


def test_a_fault_free_run_decodes_each_token_once() -> None:
    execs = executions([rec("r0", 0, 0, 100, 1.0), rec("r1", 0, 0, 80, 1.1)])
    out = account(execs, [], trained_tokens=180)
    assert (out["decoded"], out["decoded_again"], out["goodput"]) == (180, 0, 1.0)
    assert out["decoded_not_trained"] == 0


def test_a_resumed_call_loses_only_what_it_decoded_past_its_cut() -> None:
    # Attempt 0 decoded 50 tokens, the cut kept 40; attempt 1 resumed from 40 after the fault.
    execs = executions([rec("r0", 0, 0, 50, 1.0), rec("r0", 1, 40, 60, 3.0)])
    out = account(execs, [Fault(2.0, "job_kill")], trained_tokens=100)
    assert out["decoded_again"] == 10
    assert out["lost_by_kind"] == {"job_kill": {"faults": 1, "tokens_lost": 10}}
    assert out["goodput"] == pytest.approx(100 / 110)


def test_a_regenerated_call_loses_everything_it_had_decoded() -> None:
    execs = executions([rec("r0", 0, 0, 50, 1.0), rec("r0", 0, 0, 100, 3.0)])
    out = account(execs, [Fault(2.0, "controller_kill")], trained_tokens=100)
    assert out["decoded_again"] == 50
    assert out["lost_per_fault"] == [50]


def test_a_reading_taken_twice_counts_once_at_its_longest() -> None:
    execs = executions([rec("r0", 0, 0, 30, 1.0), rec("r0", 0, 0, 70, 1.0), rec("r1", 0, 0, 0, 0)])
    assert [(e.decoded, e.rollout_id) for e in execs] == [(70, "r0")]


def test_decoding_again_is_charged_to_the_last_fault_before_it() -> None:
    execs = executions(
        [rec("r0", 0, 0, 50, 1.0), rec("r0", 1, 20, 40, 5.0), rec("r1", 0, 0, 10, 2.5)]
    )
    faults = [Fault(2.0, "worker_kill"), Fault(4.0, "store_shard_kill")]
    out = account(execs, faults, trained_tokens=70)
    assert out["lost_per_fault"] == [0, 30]
    assert out["lost_by_kind"]["worker_kill"]["tokens_lost"] == 0


def test_decoding_again_without_a_fault_is_its_own_count() -> None:
    execs = executions([rec("r0", 0, 0, 50, 1.0), rec("r0", 1, 0, 50, 2.0)])
    out = account(execs, [], trained_tokens=50)
    assert out["decoded_again_without_fault"] == 50
    assert out["goodput"] == 0.5


def test_tokens_decoded_but_never_trained_are_lost_to_no_fault() -> None:
    execs = executions([rec("r0", 0, 0, 50, 1.0), rec("r1", 0, 0, 30, 1.0)])
    out = account(execs, [], trained_tokens=50)
    assert (out["decoded_again"], out["decoded_not_trained"]) == (0, 30)


def test_a_trained_prefix_without_its_reading_is_reported_missing() -> None:
    """Only the resumed tail was read (the first attempt's reading was lost): 40 tokens of the
    trained 100 are not in any record, and goodput would be over 1 without this check."""
    execs = executions([rec("r0", 1, 40, 60, 3.0), rec("r1", 0, 0, 30, 1.0)])
    assert unrecorded(execs, {"r0": 100, "r1": 30, "r2": 5}) == {"r0": 40, "r2": 5}
