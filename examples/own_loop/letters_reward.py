"""The own loop's reward: the share of letters in what the model wrote.

Named in config.yaml as `environment.reward: letters_reward:reward`. The rollout environment (a
Ray actor) imports it by that name: Ray puts the training script's directory on its workers'
`sys.path`, as Python puts it on the script's own.
"""

from __future__ import annotations


def reward(task: dict, result: dict) -> float:
    """Letters among the reply's non-space characters (0 for an empty reply): dense, so the
    generations of one prompt differ and their advantages are not all zero."""
    chars = [c for c in result["text"] if not c.isspace()]
    return sum(c.isascii() and c.isalpha() for c in chars) / len(chars) if chars else 0.0
