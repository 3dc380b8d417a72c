"""An episode function with a bug in its own effect, for the train failure tests: the run must
end in one line naming the effect function, followed by this file's frames only."""

from __future__ import annotations


def divide(a, b):
    return a / b


async def divides_by_zero(ctx, task):
    """One real model call, then an effect that raises."""
    reply = await ctx.chat(task["messages"], max_tokens=8)
    return await ctx.effect("divide", divide, len(reply.token_ids), 0)
