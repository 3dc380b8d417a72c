"""The benchmark scripts' pure logic: target verdicts, step interleaving, figures in GB/s."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_store
from bench_common import (
    MET,
    MISSED,
    NOT_MEASURED,
    SKIPPED,
    Target,
    check_targets,
    percentile,
    targets_ok,
)


def test_target_verdicts_at_and_around_the_bound():
    low = Target("ratio", ">=", 1.5, "a ratio")
    assert low.verdict(1.5) == MET and low.verdict(1.49) == MISSED
    high = Target("bytes", "<=", 1.1, "bytes")
    assert high.verdict(1.1) == MET and high.verdict(1.2) == MISSED
    assert low.verdict(None) == NOT_MEASURED and low.verdict(float("nan")) == NOT_MEASURED
    assert low.verdict(None, skipped=True) == SKIPPED


def test_unmeasured_target_fails_the_run_unless_skipped_on_purpose():
    targets = [Target("a", ">=", 1.0, "a"), Target("b", ">=", 1.0, "b")]
    rows = check_targets(targets, {"a": 2.0})
    assert [r["verdict"] for r in rows] == [MET, NOT_MEASURED] and not targets_ok(rows)
    rows = check_targets(targets, {"a": 2.0}, skipped=frozenset({"b"}))
    assert [r["verdict"] for r in rows] == [MET, SKIPPED] and targets_ok(rows)
    assert not targets_ok(check_targets(targets, {"a": 0.5, "b": 2.0}))
    assert rows[0]["target"] == ">= 1" and rows[0]["measured"] == 2.0


def test_percentile_interpolates_like_numpy():
    xs = [float(x) for x in range(1, 101)]
    assert percentile(xs, 50) == pytest.approx(50.5)
    assert percentile(xs, 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0


def test_interleave_rotates_the_order_and_times_every_step():
    order: list[str] = []
    steps = {name: (lambda n=name: order.append(n)) for name in ("ours", "tq", "raw")}
    for k in range(3):
        measured = bench_store.interleave(steps, k)
        assert set(measured) == {"ours", "tq", "raw"} and min(measured.values()) >= 0
    assert order == ["ours", "tq", "raw", "tq", "raw", "ours", "raw", "ours", "tq"]


def test_dense_rebuilds_the_payload_and_refuses_ragged_rows():
    ids = np.arange(12, dtype=np.int32).reshape(3, 4)
    table = bench_store.to_table("t", ids, -np.ones((3, 4), np.float32))
    np.testing.assert_array_equal(bench_store.dense(table.slice(1), "token_ids", np.int32), ids[1:])
    bench_store.check_digests(table, ids)
    with pytest.raises(AssertionError, match="row 1"):
        bench_store.check_digests(table, ids[[0, 2, 1]])
    ragged = pa.table({"token_ids": pa.array([[1, 2], [3]], pa.list_(pa.int32()))})
    with pytest.raises(ValueError, match="unequal"):
        bench_store.dense(ragged, "token_ids", np.int32)


def test_summary_uses_payload_bytes_for_every_system():
    steps = ("put", "get", "snapshot", "restore")
    res = {
        "seconds": {
            "ours": {s: [1.0, 2.0, 3.0] for s in steps},
            "tq": {s: [4.0] for s in steps},
            "raw": {"snapshot": [0.5]},
        },
        "put_convert_s": [0.25],
        "snapshot_file_bytes": 2_100_000_000,
        "save_bytes": 2_200_000_000,
    }
    s = bench_store.summarize(2_000_000_000, res)
    assert s["ours_put_gbps"] == pytest.approx(1.0) and s["tq_put_gbps"] == pytest.approx(0.5)
    assert all(s[f"ratio_{step}"] == pytest.approx(2.0) for step in steps)
    assert s["raw_write_gbps"] == pytest.approx(4.0) and s["snapshot_over_raw"] == 0.25
    assert s["snapshot_bytes_over_payload"] == pytest.approx(1.05)
    assert s["tq_save_bytes_over_payload"] == pytest.approx(1.1)
