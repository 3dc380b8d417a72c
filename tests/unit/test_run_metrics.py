"""One counts vocabulary: the controller's, the environment's and the workers' counts merge
into the names the step log and the controller's Prometheus endpoint both show."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from rollout_recovery.controller.metrics import FIXED, RunMetrics, worker_totals

ENV = {"restored_calls": 2, "restore_refused.missing_entry": 1, "capture.supply.supplied": 5,
       "lineage.resolve.resolved": 4, "lease_expiries": 1}  # fmt: skip
WORKERS = [
    {"resume.resumed": 2, "resume.prefix_tokens": 30, "resume.digest_mismatch": 1,
     "cut.durable_prefix": 3, "lock_hold_us_max": 700},
    {"resume.resumed": 1, "resume.decoded_tokens": 9, "cut.durable_prefix": 1,
     "lock_hold_us_max": 900},
]  # fmt: skip


def test_worker_tallies_sum_keep_maxima_and_split_resume_verdicts():
    total = worker_totals(WORKERS)
    assert total["worker.cut.durable_prefix"] == 4 and total["worker.resume.prefix_tokens"] == 30
    assert total["worker.lock_hold_us_max"] == 900  # a maximum, not a sum
    assert total["worker_resumes_accepted"] == 3 and total["worker_resumes_refused"] == 1


def test_collect_names_every_source_with_fixed_names_always_present():
    metrics = RunMetrics()
    metrics.add("checkpoints")
    metrics.add("fence_hold_s", 0.25)
    counts = metrics.collect(ENV, WORKERS)
    assert list(counts)[: len(FIXED)] == list(FIXED)
    assert counts["checkpoints"] == 1 and counts["fence_hold_s"] == 0.25
    assert counts["tail_tokens"] == 0  # nothing happened: still reported, so steps diff
    assert counts["capture.supply.supplied"] == 5 and counts["lease_expiries"] == 1
    assert counts["restore_refused.missing_entry"] == 1
    assert counts["worker_resumes_refused"] == 1
    assert "worker_resumes_accepted" not in metrics.collect(ENV, None)  # capture off


def _series(text: str) -> dict[tuple[str, str], float]:
    return {
        (s.name, s.labels.get("name", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_prometheus_text_carries_the_same_counts():
    metrics = RunMetrics()
    metrics.add("checkpoints", 2)
    counts = metrics.collect(ENV, WORKERS)
    series = _series(metrics.prometheus_text(counts))
    assert series[("rollout_recovery_run_checkpoints", "")] == 2
    assert series[("rollout_recovery_run_restore_refused", "missing_entry")] == 1
    assert series[("rollout_recovery_run_capture", "supply.supplied")] == 5
    assert series[("rollout_recovery_run_worker", "cut.durable_prefix")] == 4
    assert len(series) == len(counts)


def test_the_controller_serves_its_counts_over_http():
    metrics = RunMetrics()
    seen = {"checkpoints": 1}
    url = metrics.serve(lambda: dict(seen))
    try:
        first = _series(httpx.get(url, timeout=10).text)
        seen["checkpoints"] = 3  # read at scrape time, not when served
        second = _series(httpx.get(url, timeout=10).text)
    finally:
        metrics.stop()
    assert first[("rollout_recovery_run_checkpoints", "")] == 1
    assert second[("rollout_recovery_run_checkpoints", "")] == 3
