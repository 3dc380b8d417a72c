"""A checkpoint fence on a worker: while held, terminal writes and chunk deletes wait.

Decoding never waits on it. The fence has a lease so a controller that disappears cannot hold
it forever, and epochs make a late `end` of an already released fence a no-op.

Epochs are integers in [0, MAX_EPOCH]. A fence may begin at the highest epoch the worker has
seen (renewing or re-taking it) or at a newer one at most MAX_EPOCH_ADVANCE above it; a fresh
worker counts as having seen epoch 0. Without the bound, one stray huge epoch would make every
later fence of the run "older" and be refused until the worker restarts. The controller uses
epochs 1, 2, 3, ... on a fresh worker per run, well inside the rule.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass

MAX_EPOCH = 2**53 - 1
"""Largest epoch: above 2**53 integers stop surviving a JSON client that reads numbers as
floats, so two sides could disagree about which epoch is held."""

MAX_EPOCH_ADVANCE = 1024
"""How far past the highest epoch seen a new fence may jump (room for a controller that
skipped epochs in failed attempts, none for a typo or a corrupt counter)."""


def check_epoch(epoch: object) -> int:
    """`epoch` if it is an integer in [0, MAX_EPOCH]; ValueError otherwise (a bool is no
    epoch, though Python counts it as an int)."""
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch <= MAX_EPOCH:
        raise ValueError(f"fence epoch must be an integer in [0, 2**53 - 1] (got {epoch!r})")
    return epoch


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
        self.highest_epoch = 0  # a fresh worker may take any epoch up to MAX_EPOCH_ADVANCE
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
        """Hold the fence for `epoch` (extends the lease if already held for it).

        ValueError when the epoch breaks the module's rule or the lease is not a positive
        finite number of seconds; nothing changes then.
        """
        check_epoch(epoch)
        number = isinstance(lease_s, int | float) and not isinstance(lease_s, bool)
        if not number or not 0 < lease_s < math.inf:
            raise ValueError(f"lease_s must be a positive finite number (got {lease_s!r})")
        if epoch < self.highest_epoch:
            raise ValueError(
                f"fence epoch {epoch} is older than the highest epoch seen ({self.highest_epoch}); "
                "epochs never go back"
            )
        ceiling = self.highest_epoch + MAX_EPOCH_ADVANCE
        if epoch > ceiling:
            raise ValueError(
                f"fence epoch {epoch} is too far ahead: a new epoch may be at most "
                f"MAX_EPOCH_ADVANCE={MAX_EPOCH_ADVANCE} above the highest epoch seen "
                f"({self.highest_epoch}), so at most {ceiling}"
            )
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
        if self._epoch != check_epoch(epoch):
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
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    await self._released.wait()

    def state(self) -> FenceState:
        held = self.held
        left = max(0.0, self._expires_at - time.monotonic()) if held else None
        return FenceState(epoch=self._epoch, held=held, expires_in_s=left)
