"""bench_scale's pure helpers: the expected work a crash loses, and the figures it reports."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from bench_scale import change_plan, expected_tokens_lost, in_flight, mean_durable_age


def test_no_snapshot_ages_from_the_round_start():
    # The age rises from 0 to 10 over the round: its mean is half the round.
    assert mean_durable_age(0.0, 10.0, []) == pytest.approx(5.0)
    assert expected_tokens_lost(100.0, 0.0, 10.0, []) == pytest.approx(500.0)


def test_evenly_spaced_snapshots_halve_the_interval():
    # Publishes every 2 s from t=2: each 2 s piece has mean age 1.
    assert mean_durable_age(0.0, 10.0, [2.0, 4.0, 6.0, 8.0]) == pytest.approx(1.0)
    assert expected_tokens_lost(1000.0, 0.0, 10.0, [2, 4, 6, 8]) == pytest.approx(1000.0)


def test_uneven_snapshots_weigh_long_gaps_quadratically():
    # Pieces of 1 s and 9 s: (1/2 + 81/2) / 10 = 4.1 s.
    assert mean_durable_age(0.0, 10.0, [1.0]) == pytest.approx(4.1)
    assert mean_durable_age(0.0, 10.0, [9.0]) == pytest.approx(4.1)


def test_publishes_outside_the_round_and_unsorted_input():
    # Outside the window they do not count; order does not matter.
    assert mean_durable_age(10.0, 20.0, [5.0, 25.0]) == pytest.approx(5.0)
    assert mean_durable_age(0.0, 10.0, [8.0, 2.0, 6.0, 4.0]) == pytest.approx(1.0)


def test_empty_window_is_nan():
    assert math.isnan(mean_durable_age(3.0, 3.0, []))
    assert math.isnan(expected_tokens_lost(10.0, 4.0, 3.0, [3.5]))


def test_in_flight_counts_calls_cut_and_not_cut():
    m = {"calls_cut": 100, "calls_not_cut": {"unknown_call": 150, "zero_generated_tokens": 6}}
    assert in_flight(m) == 256
    assert in_flight({"calls_cut": 3}) == 3
    assert in_flight({"calls_cut": 0, "calls_not_cut": None}) == 0


def test_change_plan_keeps_the_store_size():
    replaced, new, deleted = change_plan(10_000, 1000)
    assert (replaced, new, deleted) == (500, 500, 500)
    assert new == deleted
    # More changes than rows: never more existing rows touched than there are.
    replaced, new, deleted = change_plan(10, 100)
    assert replaced + deleted <= 10 and replaced + new == 100
