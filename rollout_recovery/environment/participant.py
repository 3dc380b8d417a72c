"""The environment's side of the checkpoint protocol, as a small state machine.

    idle -> preparing -> prepared -> committed -> idle      (a checkpoint)
    idle -> restored -> idle                                (a restore, before serving)

`prepare(ckpt)` closes admission: calls already running go on, new ones wait at their turn
boundary until the checkpoint ends. Every later step must name the same checkpoint id (a late
message from an aborted attempt is refused). A prepare holds a lease: if the controller
disappears, admission reopens by itself when it expires. A restore is refused once the
environment has served calls, since their effects would be mixed with the restored state.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from enum import StrEnum


class ParticipantState(StrEnum):
    IDLE = "idle"
    PREPARING = "preparing"
    PREPARED = "prepared"
    COMMITTED = "committed"
    RESTORED = "restored"


class ProtocolError(RuntimeError):
    pass


class CheckpointParticipant:
    def __init__(self) -> None:
        self.state = ParticipantState.IDLE
        self.checkpoint_id: str | None = None
        self.calls_served = 0
        self._open = asyncio.Event()
        self._open.set()
        self._lease_until = 0.0
        self.lease_expiries = 0

    def _expect(self, ckpt: str, *states: ParticipantState) -> None:
        self._expire()
        if self.checkpoint_id != ckpt or self.state not in states:
            raise ProtocolError(
                f"checkpoint {ckpt!r} cannot move on from {self.state} "
                f"(current checkpoint {self.checkpoint_id!r})"
            )

    def _expire(self) -> None:
        if (
            self.state != ParticipantState.IDLE
            and self.checkpoint_id
            and (time.monotonic() >= self._lease_until)
        ):
            self.lease_expiries += 1
            self._reset()

    def _reset(self) -> None:
        self.state, self.checkpoint_id = ParticipantState.IDLE, None
        self._open.set()

    def prepare(self, ckpt: str, lease_s: float) -> None:
        self._expire()
        if self.state != ParticipantState.IDLE:
            raise ProtocolError(f"prepare {ckpt!r} while {self.state} ({self.checkpoint_id!r})")
        self.state, self.checkpoint_id = ParticipantState.PREPARING, ckpt
        self._lease_until = time.monotonic() + lease_s
        self._open.clear()

    def prepared(self, ckpt: str) -> None:
        self._expect(ckpt, ParticipantState.PREPARING)
        self.state = ParticipantState.PREPARED

    def commit(self, ckpt: str) -> None:
        self._expect(ckpt, ParticipantState.PREPARED)
        self.state = ParticipantState.COMMITTED

    def reopen(self, ckpt: str) -> None:
        """End of a checkpoint (committed, or aborted at any step): reopen admission."""
        self._expect(
            ckpt, ParticipantState.PREPARING, ParticipantState.PREPARED, ParticipantState.COMMITTED
        )
        self._reset()

    def restore(self, ckpt: str) -> None:
        if self.calls_served:
            raise ProtocolError(
                f"refusing to restore {ckpt!r}: this environment already served "
                f"{self.calls_served} calls; restore into a fresh environment"
            )
        if self.state != ParticipantState.IDLE:
            raise ProtocolError(f"restore {ckpt!r} while {self.state}")
        self.state, self.checkpoint_id = ParticipantState.RESTORED, ckpt
        self._lease_until = float("inf")

    def restored(self, ckpt: str) -> None:
        self._expect(ckpt, ParticipantState.RESTORED)
        self._reset()

    async def admitted(self) -> None:
        """Wait at a turn boundary until admission is open (or the lease expired)."""
        while not self._open.is_set():
            self._expire()
            if self._open.is_set():
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.05):
                    await self._open.wait()
        self.calls_served += 1
