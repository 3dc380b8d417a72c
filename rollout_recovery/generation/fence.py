"""A checkpoint fence on a worker: while held, terminal writes and chunk deletes wait.

Decoding never waits on it. The fence has a lease so a controller that disappears cannot hold
it forever, and epochs make a late `end` of an already released fence a no-op.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass


@dataclass
class FenceState:
    epoch: int | None
    held: bool
    expires_in_s: float | None


class Fence:
    def __init__(self, on_release=None) -> None:
        self._on_release = on_release  # called with the seconds the fence was held
        self._epoch: int | None = None
        self._expires_at = 0.0
        self._released = asyncio.Event()
        self._released.set()
        self._expiry_task: asyncio.Task | None = None
        self.highest_epoch = -1
        self.hold_seconds_total = 0.0
        self._held_since = 0.0

    def _release(self) -> None:
        if self._epoch is not None:
            held = time.monotonic() - self._held_since
            self.hold_seconds_total += held
            if self._on_release is not None:
                self._on_release(held)
        self._epoch = None
        self._released.set()
        if self._expiry_task is not None and self._expiry_task is not asyncio.current_task():
            self._expiry_task.cancel()
        self._expiry_task = None

    def begin(self, epoch: int, lease_s: float) -> FenceState:
        """Hold the fence for `epoch` (extends the lease if already held for it)."""
        if lease_s <= 0:
            raise ValueError("lease_s must be > 0")
        if epoch < self.highest_epoch:
            raise ValueError(f"fence epoch {epoch} is older than {self.highest_epoch}")
        if self._epoch is not None and self._epoch != epoch:
            self._release()  # a newer epoch supersedes a stale one
        if self._epoch is None:
            self._held_since = time.monotonic()
        self.highest_epoch = epoch
        self._epoch = epoch
        self._expires_at = time.monotonic() + lease_s
        self._released.clear()
        if self._expiry_task is not None:
            self._expiry_task.cancel()
        self._expiry_task = asyncio.get_running_loop().create_task(self._expire(epoch))
        return self.state()

    async def _expire(self, epoch: int) -> None:
        while self._epoch == epoch:
            delay = self._expires_at - time.monotonic()
            if delay <= 0:
                self._release()
                return
            await asyncio.sleep(delay)

    def end(self, epoch: int) -> bool:
        """Release `epoch`; a late end of a released or superseded epoch is a no-op (False)."""
        if self._epoch != epoch:
            return False
        self._release()
        return True

    @property
    def held(self) -> bool:
        if self._epoch is not None and time.monotonic() >= self._expires_at:
            self._release()
        return self._epoch is not None

    async def wait_released(self) -> None:
        while self.held:
            try:
                await asyncio.wait_for(self._released.wait(), timeout=0.5)
            except TimeoutError:
                continue

    def state(self) -> FenceState:
        held = self.held
        left = max(0.0, self._expires_at - time.monotonic()) if held else None
        return FenceState(epoch=self._epoch, held=held, expires_in_s=left)
