"""Episode functions that stop making progress, for the liveness tests."""

from __future__ import annotations

import asyncio


async def stuck_after_one_call(ctx, task):
    """One real model call, then a wait on something the run cannot see (neither a model call
    nor an effect): the step makes no progress from there on."""
    await ctx.chat(task["messages"], max_tokens=8)
    await asyncio.Event().wait()
