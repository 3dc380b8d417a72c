"""The built-in task as an episode function: digit prompts, a tally tool between turns, and the
share of digits as the reward.

With `environment.max_turns` 1 it is single-turn GRPO (each call decodes its full budget). With
more, after each call but the last the tally tool adds the reply's digits (plus one) to a
running tally and answers with it: a pure effect, so its result depends only on its arguments
and the journal is what makes it happen once per turn.
"""

from __future__ import annotations

import json
import random
from typing import Any

PROMPT_TEMPLATES = [
    "What is {a} + {b}?",
    "Write the number {a} in digits.",
    "Count to {a}.",
    "Reply with digits only: {a} {b}",
]


def tasks(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = rng.choice(PROMPT_TEMPLATES).format(a=rng.randrange(100), b=rng.randrange(100))
        out.append({"messages": [{"role": "user", "content": text}]})
    return out


def digit_share(text: str) -> float:
    """The fraction of the text's non-space characters that are ASCII digits (0 when empty)."""
    chars = [c for c in text if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


def reward(task: dict, result: dict) -> float:
    return digit_share(result["text"])


def add_to_tally(tally: int, turn: int, reply: str) -> dict[str, int]:
    return {"tally": tally + sum(c.isdigit() for c in reply) + 1, "turn": turn}


async def episode(ctx, task: dict) -> dict[str, Any]:
    messages = [dict(m) for m in task["messages"]]
    replies, effects, tally = [], [], 0
    for turn in range(ctx.max_turns):
        # A single-turn call decodes its whole budget; a turn of an episode ends at its EOS.
        reply = await ctx.chat(messages, ignore_eos=ctx.max_turns == 1)
        messages.append(reply.message)
        replies.append(reply.content)
        if turn + 1 < ctx.max_turns:
            applied = await ctx.effect("tally", add_to_tally, tally, turn, reply.content)
            tally = applied["tally"]
            effects.append(applied["turn"])
            messages.append(
                {"role": "tool", "name": "tally", "content": json.dumps({"tally": tally})}
            )
    return {"text": "".join(replies), "tally": tally, "effects": effects}
