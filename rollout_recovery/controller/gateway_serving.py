"""The standalone gateway's run: rollouts opened, served and finished over HTTP by harnesses
outside the job (docs/gateway.md), checkpointed on the cadence until the operator stops it;
then one last checkpoint keeps every open rollout, so a restore reopens them."""

from __future__ import annotations

import asyncio
import secrets
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the facade calls in; this module never imports it at load time
    from rollout_recovery.api import RolloutRecovery


def serve_gateway(rr: RolloutRecovery, stop: threading.Event, token: str | None) -> dict | None:
    """Serve until `stop` is set; the last checkpoint's metrics, None if it failed. The URL and
    token are set on `rr` first, so another thread can announce them while this one serves."""
    rr.gateway_token = token or secrets.token_urlsafe(24)
    rr.gateway_url = rr.env.start_gateway(rr.gateway_token, rr.state.weight_version)

    async def until_stopped() -> None:
        while not stop.is_set():
            await asyncio.sleep(0.1)

    rr._loop.run(rr.coordinator.alongside(until_stopped()))
    return rr._loop.run(rr.coordinator.counted("shutdown"))
