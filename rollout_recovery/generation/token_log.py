"""Continuous token logging: each in-flight call's new tokens become chained chunk rows
every K tokens (`token_capture.log_interval_tokens`) and/or every T seconds
(`log_interval_s`), so a worker that dies loses at most about one interval per call.

The rows are the same chain a checkpoint cut extends (`CutService.log_calls`): a cut then stages
only what the token log has not, a resume validates token log rows exactly like cut rows, and a
finished call's rows are deleted with its terminal row as before. Decoding never waits for the
token log: the capture hook only nudges it (under the capture lock, no I/O), and the staging
runs as a task on the worker's loop. No fence is involved: the rows only add to a call's chain.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from rollout_recovery.generation.capture import CapturedCall
from rollout_recovery.generation.cut import CutService

LAG_SAMPLE_S = 0.1  # how often each in-flight call's token log lag is sampled


class TokenLog:
    """The token log task of one worker; off until an interval is configured."""

    def __init__(
        self,
        service: CutService,
        interval_tokens: int | None = None,
        interval_s: float | None = None,
    ) -> None:
        self.service = service
        self.interval_tokens, self.interval_s = interval_tokens, interval_s
        self._due = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        service.capture.on_stepped = self.nudge

    @property
    def enabled(self) -> bool:
        return self.interval_tokens is not None or self.interval_s is not None

    def configure(self, interval_tokens: int | None, interval_s: float | None = None) -> None:
        """Change the intervals (benchmarks compare several in one run); None turns one off."""
        self.interval_tokens, self.interval_s = interval_tokens, interval_s
        self._wake()

    def start(self) -> None:
        """Start the token log task on the running loop (the worker's)."""
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def nudge(self, calls: list[CapturedCall]) -> None:
        """Runs under the capture lock after an engine step: wake the task once a call has
        `interval_tokens` tokens not yet durable. Reads counters only."""
        k = self.interval_tokens
        if k is None or self._due.is_set():
            return
        for call in calls:
            if not call.finished and call.not_durable(call.num_generated()) >= k:
                self._wake()
                return

    def _wake(self) -> None:
        if self._loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._due.set()
        else:
            self._loop.call_soon_threadsafe(self._due.set)

    def _is_due(self, call: CapturedCall, new_tokens: int, now: float) -> bool:
        if self.interval_tokens is not None and new_tokens >= self.interval_tokens:
            return True
        return self.interval_s is not None and now - call.staged_at >= self.interval_s

    async def _run(self) -> None:
        next_sample = 0.0
        while True:
            timeout = LAG_SAMPLE_S
            if self.interval_s is not None:
                timeout = min(timeout, self.interval_s / 2)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._due.wait()
            self._due.clear()
            if time.monotonic() >= next_sample:  # the lag, on a clock (also with the token log off)
                self.service.sample_log_lag()
                next_sample = time.monotonic() + LAG_SAMPLE_S
            if not self.enabled:
                continue
            try:
                await self.service.log_calls(self._is_due)
            except Exception as err:  # a failed pass is counted; the next one tries again
                self.service.metrics.tally[f"token_log_failure.{type(err).__name__}"] += 1
