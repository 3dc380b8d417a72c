"""Worker metrics: Prometheus series (served on vLLM's own /metrics) plus a plain snapshot.

The series live in prometheus_client's default registry, which vLLM's /metrics route exposes,
so no second endpoint is needed. `snapshot()` gives the same numbers to Ray callers.
"""

from __future__ import annotations

from collections import Counter as _Tally
from collections import deque

from prometheus_client import Counter, Histogram

_BUCKETS_US = (10, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 50000)


class WorkerMetrics:
    """One instance per worker process (prometheus series are process-global)."""

    _instance: WorkerMetrics | None = None

    def __new__(cls) -> WorkerMetrics:
        if cls._instance is None:
            inst = super().__new__(cls)
            inst._init()
            cls._instance = inst
        return cls._instance

    def _init(self) -> None:
        self.tally: _Tally[str] = _Tally()
        self.cuts = Counter(
            "rollout_recovery_cut_calls", "Calls in cut inventories, by disposition and reason",
            ["disposition", "reason"],
        )  # fmt: skip
        self.restored = Counter(
            "rollout_recovery_restored_calls", "Resume attempts, by outcome", ["outcome"]
        )
        self.restored_tokens = Counter(
            "rollout_recovery_restored_prefix_tokens", "Prefix tokens resumed instead of decoded"
        )
        self.progress_reads = Counter("rollout_recovery_progress_reads", "Locked progress reads")
        self.lock_wait = Histogram(
            "rollout_recovery_lock_wait_us", "Wait for the capture lock (us)", buckets=_BUCKETS_US
        )
        self.lock_hold = Histogram(
            "rollout_recovery_lock_hold_us", "Capture lock hold per cut (us)", buckets=_BUCKETS_US
        )
        self.lock_holds: deque[float] = deque(maxlen=100_000)  # per cut, for exact percentiles
        self.fence_hold = Counter("rollout_recovery_fence_hold_seconds", "Seconds fences held")
        self.terminal_rows = Counter("rollout_recovery_terminal_rows", "Terminal rows staged")
        self.deferred_deletes = Counter(
            "rollout_recovery_deferred_deletes", "Chunk deletes that waited for a fence"
        )
        self.retired_rows = Counter(
            "rollout_recovery_retired_chunk_rows",
            "Earlier attempts' chunk rows deleted after a resume answered without decoding",
        )
        self.token_log_rows = Counter("rollout_recovery_token_log_rows", "Chunk rows logged")
        self.token_log_tokens = Counter(
            "rollout_recovery_token_log_tokens", "Tokens made durable by the token log"
        )
        self.token_log_segments = Counter(
            "rollout_recovery_token_log_segments",
            "Token log segments written to checkpoint storage",
        )
        self.log_lag_tokens = Histogram(
            "rollout_recovery_token_log_lag_tokens",
            "Tokens of an in-flight call decoded but not yet durable, sampled per token log pass",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
        )
        self.log_lags: deque[int] = deque(maxlen=100_000)
        self.resume_decoded = Counter(
            "rollout_recovery_resume_decoded_tokens",
            "Tokens the engine decoded for resumed calls (their tails)",
        )

    def cut(self, disposition: str, reason: str | None) -> None:
        self.cuts.labels(disposition, reason or "").inc()
        self.tally[f"cut.{disposition}"] += 1
        if reason:
            self.tally[f"cut_failure.{reason}"] += 1

    def restore(self, outcome: str, prefix_tokens: int = 0) -> None:
        self.restored.labels(outcome).inc()
        self.tally[f"resume.{outcome}"] += 1
        if prefix_tokens:
            self.restored_tokens.inc(prefix_tokens)
            self.tally["resume.prefix_tokens"] += prefix_tokens

    def lock(self, wait_us: float, hold_us: float) -> None:
        self.progress_reads.inc()
        self.lock_wait.observe(wait_us)
        self.lock_hold.observe(hold_us)
        self.lock_holds.append(hold_us)
        self.tally["progress_reads"] += 1
        self.tally["lock_hold_us_max"] = max(self.tally["lock_hold_us_max"], int(hold_us))

    def lock_hold_samples(self) -> list[float]:
        """The last 100,000 cuts' lock holds (us), oldest first."""
        return list(self.lock_holds)

    def count(self, name: str, n: int = 1) -> None:
        series = {
            "terminal_rows": self.terminal_rows,
            "deferred_deletes": self.deferred_deletes,
            "retired_chunk_rows": self.retired_rows,
            "resume.decoded_tokens": self.resume_decoded,
            "token_log.rows": self.token_log_rows,
            "token_log.tokens": self.token_log_tokens,
            "token_log.segments": self.token_log_segments,
        }
        series[name].inc(n)
        self.tally[name] += n

    def log_lag(self, tokens: int) -> None:
        self.log_lag_tokens.observe(tokens)
        self.log_lags.append(tokens)

    def log_lag_percentiles(self) -> dict[str, float]:
        """p50 and p99 of the sampled token log lag (tokens), for the run's counts."""
        if not self.log_lags:
            return {}
        lags = sorted(self.log_lags)

        def at(q: float) -> float:
            return float(lags[min(len(lags) - 1, int(q * len(lags)))])

        return {"token_log.lag_p50_max": at(0.5), "token_log.lag_p99_max": at(0.99)}

    def fence_seconds(self, seconds: float) -> None:
        self.fence_hold.inc(seconds)

    def snapshot(self) -> dict[str, float]:
        return dict(self.tally) | self.log_lag_percentiles()
