"""One vocabulary for what a run counts, from the controller, the environment and the workers.

`RunMetrics.collect` merges them into one flat mapping, the same names in the step log
(`steps.jsonl`, as per-step differences) and, as Prometheus text, on the controller's
`/metrics` endpoint (`RunMetrics.serve`). Names:

- controller: `checkpoints`, `checkpoint_failures`, `fence_hold_s`, `release_errors`,
  `worker_failures.<cause>`, `workers_replaced`, `worker_replacement_s`,
  `worker_replacement_failures` (docs/failover.md), `run_stalled.<reason>` (a step that made
  no progress, docs/errors.md);
- environment: `restored_episodes`, `restored_calls`, `restored_prefix_tokens`,
  `restored_turn_tokens`, `tail_tokens`, `regenerated_tokens`, `effects.executed` and
  `effects.replayed` (episode effects run, and answered from a journal),
  `journal.chat_replayed` (model calls answered from a journal), `replay_diverged.<reason>`
  (a replay that asked for other steps than its journal: the episode started over),
  `chunk_rows_swept`, `lease_expiries`, `restore_refused.<reason>` (an episode record that
  started over), `capture.<event>` (model-call capture: resolutions, prefix supply, capture
  failures), `lineage.resolve.<outcome>`, and for calls moved off a dead worker
  `migrations.<cause>`, `migration.resumed`, `migration.from_scratch`,
  `migration.token_log_tokens`, `migration.tail_tokens`, `migration.token_log_refused.<reason>`,
  `migration_failed.<reason>`;
- workers (summed; `*_max` as the maximum): `worker_resumes_accepted`,
  `worker_resumes_refused`, and `worker.<name>` for every worker tally (`cut.<disposition>`,
  `cut_failure.<reason>`, `resume.<outcome>`, `terminal_rows`,
  `token_log.rows`, `token_log.tokens`, `token_log.lag_p50_max`, `token_log.lag_p99_max`, ...).

In Prometheus a dotted name `family.rest` is the series `rollout_recovery_run_family` with the
label `name="rest"`; an undotted one is `rollout_recovery_run_<name>`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import GaugeMetricFamily

FIXED = (
    "checkpoints",
    "checkpoint_failures",
    "fence_hold_s",
    "restored_episodes",
    "restored_calls",
    "restored_prefix_tokens",
    "restored_turn_tokens",
    "tail_tokens",
    "regenerated_tokens",
    "effects.executed",
    "effects.replayed",
)  # always present (zero when nothing happened), so step logs can be diffed
RESUME_ACCEPTED = (
    "resume.resumed",
    "resume.finished_without_decoding",
    "resume.prefix_tokens",
    "resume.decoded_tokens",
)  # a worker's counts of accepted resumes and their tokens; every other resume.* is a refusal
PREFIX = "rollout_recovery_run_"


def worker_totals(tallies: Iterable[dict[str, float]]) -> dict[str, float]:
    """The workers' tallies summed (maxima kept as maxima), with the resume verdicts."""
    total: Counter[str] = Counter()
    for tally in tallies:
        for name, value in tally.items():
            key = f"worker.{name}"
            total[key] = max(total[key], value) if name.endswith("_max") else total[key] + value
    resumes = {k.removeprefix("worker."): v for k, v in total.items() if ".resume." in f".{k}"}
    accepted = resumes.get("resume.resumed", 0)
    refused = sum(v for k, v in resumes.items() if k not in RESUME_ACCEPTED)
    return dict(total) | {"worker_resumes_accepted": accepted, "worker_resumes_refused": refused}


class RunMetrics:
    """The controller's own counters, and the merged view of a run's counts."""

    def __init__(self) -> None:
        self.controller: Counter[str] = Counter()
        self._source: Callable[[], dict[str, float]] = lambda: dict(self.controller)
        self._server = None

    def add(self, name: str, value: float = 1) -> None:
        self.controller[name] += value

    def collect(
        self, environment: dict[str, float], workers: Iterable[dict[str, float]] | None
    ) -> dict[str, float]:
        """The run's counts: fixed names first, then every other name reported."""
        merged = dict(environment) | dict(self.controller)
        if workers is not None:
            merged |= worker_totals(workers)
        return {k: merged.get(k, 0) for k in FIXED} | merged

    def prometheus_text(self, counts: dict[str, float]) -> str:
        """`counts` in the Prometheus text format."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Snapshot(lambda: counts))
        return generate_latest(registry).decode()

    def serve(self, source: Callable[[], dict[str, float]], host: str = "127.0.0.1") -> str:
        """Serve `source()` as Prometheus text on an ephemeral port; returns the URL."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Snapshot(source))
        self._server, _ = start_http_server(0, addr=host, registry=registry)
        return f"http://{host}:{self._server.server_port}/metrics"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Snapshot:
    """A Prometheus collector over a mapping of counts, read at scrape time."""

    def __init__(self, source: Callable[[], dict[str, float]]) -> None:
        self.source = source

    def collect(self):
        families: dict[str, GaugeMetricFamily] = {}
        for name, value in sorted(self.source().items()):
            family, _, rest = name.partition(".")
            metric = PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", family)
            if metric not in families:
                labels = ["name"] if rest else []
                families[metric] = GaugeMetricFamily(metric, f"run count: {family}", labels=labels)
            families[metric].add_metric([rest] if rest else [], float(value))
        yield from families.values()
