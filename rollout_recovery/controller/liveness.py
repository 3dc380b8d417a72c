"""The liveness watch: a step that makes no progress stops with a named reason and what to run
next, instead of waiting forever (docs/errors.md, "A run that makes no progress").

While a step's episodes run, the controller asks the environment every
`liveness.check_interval_s` what they are doing (`EnvironmentProgress`). The step is moving
while a model call is in flight or moving off a dead worker (failover bounds that wait by
`failover.replacement_wait_s`) or an effect runs, and whenever a call starts or is answered or
an episode finishes. It stops with `RunStalled`, counted as `run_stalled.<reason>`, when
for `liveness.stall_timeout_s`:

- `no_progress`: none of that happened (the episodes wait on something that is neither a model
  call nor an effect, or the step waits for episodes that are not running);
- `environment_unresponsive`: the environment did not answer at all;
- `restored_unclaimed`: episodes a restore brought back waited for a step to take them (a
  restore that hands episodes to no one; the shipped driver refuses that case before it
  starts).

The checkpoint cadence that does not stop when its step ends is the coordinator's
`checkpoint_stuck` (controller/coordinator.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from rollout_recovery.config import LivenessConfig
from rollout_recovery.errors import RunStalled
from rollout_recovery.protocol import EnvironmentProgress

T = TypeVar("T")
NEXT = (
    "The run stopped; the last snapshot and the token log hold its work: continue it with "
    "`train --restore` (in your own loop: `RolloutRecovery.restore()` in a new controller)"
)


def stalled(
    reason: str, step: int, quiet_s: float, cfg: LivenessConfig, last: EnvironmentProgress | None
) -> RunStalled:
    """The one-line error of a stalled step: the reason, what the environment reported last,
    and what to run next."""
    limit = f"liveness.stall_timeout_s={cfg.stall_timeout_s:g}"
    quiet = f"{quiet_s:.0f}" if quiet_s >= 10 else f"{quiet_s:.1f}"
    if reason == "environment_unresponsive":
        what = f"the environment did not answer the progress check for {quiet} s"
    elif reason == "restored_unclaimed":
        what = (
            f"{last.restored_waiting} restored episodes (e.g. {last.restored_example}) waited "
            f"{last.restored_waiting_s:.0f} s for a step to run them; submit the groups the "
            "restored snapshot holds first (the shipped driver does)"
        )
    else:
        running = last.episodes_running if last is not None else 0
        what = (
            f"for {quiet} s no model call was in flight, no effect ran, no call started "
            f"or ended and no episode finished ({running} episode{'' if running == 1 else 's'} "
            "unfinished)"
        )
    return RunStalled(
        reason, f"step {step} stalled (run_stalled.{reason}, {limit}): {what}. {NEXT}"
    )


async def watch_step(
    work: Awaitable[T],
    progress: Callable[[], Awaitable[EnvironmentProgress]],
    cfg: LivenessConfig,
    step: int,
) -> T:
    """`work`'s result, or RunStalled once the environment (`progress`) showed no progress for
    `cfg.stall_timeout_s`; the work is cancelled then. No watch when the timeout is None."""
    work = asyncio.ensure_future(work)
    if cfg.stall_timeout_s is None:
        return await work
    last: EnvironmentProgress | None = None
    moved_at = answered_at = time.monotonic()
    try:
        while True:
            await asyncio.wait({work}, timeout=cfg.check_interval_s)
            if work.done():
                return work.result()
            now = time.monotonic()
            try:
                async with asyncio.timeout(cfg.check_interval_s):
                    seen = await progress()
            except TimeoutError:
                seen = None
            if seen is not None:
                answered_at = now
                busy = seen.calls_in_flight or seen.calls_moving or seen.effects_running
                if busy or last is None or seen.events != last.events:
                    moved_at = now
                last = seen
                if seen.restored_waiting and seen.restored_waiting_s >= cfg.stall_timeout_s:
                    raise stalled("restored_unclaimed", step, now - moved_at, cfg, seen)
            if now - answered_at >= cfg.stall_timeout_s:
                raise stalled("environment_unresponsive", step, now - answered_at, cfg, last)
            if now - moved_at >= cfg.stall_timeout_s:
                raise stalled("no_progress", step, now - moved_at, cfg, last)
    finally:
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
