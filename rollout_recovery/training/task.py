"""A toy task with a rule-based reward that the tiny random model can improve on quickly.

Each prompt asks for digits; the reward is the fraction of the generated text's characters
that are ASCII digits (0 when nothing was generated). A random policy emits digits sometimes,
so groups sampled at temperature 1 have varied rewards and GRPO has a signal from step one.
"""

from __future__ import annotations

import random

PROMPT_TEMPLATES = [
    "What is {a} + {b}?",
    "Write the number {a} in digits.",
    "Count to {a}.",
    "Reply with digits only: {a} {b}",
]


def make_prompts(n: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = rng.choice(PROMPT_TEMPLATES).format(a=rng.randrange(100), b=rng.randrange(100))
        out.append([{"role": "user", "content": text}])
    return out


def digit_reward(text: str) -> float:
    chars = [c for c in text if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0
