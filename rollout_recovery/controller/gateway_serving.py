"""The standalone gateway's run: rollouts opened, served and finished over HTTP by harnesses
outside the job (docs/gateway.md), checkpointed on the cadence until the operator stops it;
then one last checkpoint keeps every open rollout, so a restore reopens them."""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the facade calls in; this module never imports it at load time
    from rollout_recovery.controller.job import Job


def serve_gateway(job: Job, stop: threading.Event, token: str | None) -> dict | None:
    """Serve until `stop` is set; the last checkpoint's metrics, None if it failed. The gateway
    is on the job first (`Job.gateway`), so another thread can announce it while this one
    serves."""
    job.start_gateway(token)

    async def until_stopped() -> None:
        while not stop.is_set():
            await asyncio.sleep(0.1)

    job.loop.run(job.coordinator.alongside(until_stopped()))
    return job.loop.run(job.coordinator.counted("shutdown"))
