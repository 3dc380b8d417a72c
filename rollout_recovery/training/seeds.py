"""The sampler seed of every rollout the GRPO driver asks for: a pure function of `grpo.seed`,
the step, the group and the generation, so a restored run samples what the uninterrupted one
would have.

These live apart from the driver because they travel to the controller with each group (Ray
pickles them by reference to their module) and the driver imports torch, which the controller
never needs: a new controller, after the old one died, would import it cold before its first
resumed call (about 1 s)."""

from __future__ import annotations

from dataclasses import dataclass


def rollout_seed(base: int, step: int, group: int, gen: int) -> int:
    """The seed of generation `gen` of group `group` in step `step` (distinct per triple)."""
    return ((base * 1_000_003 + step) * 10_007 + group) * 101 + gen


@dataclass(frozen=True)
class StepSeeds:
    """Seeds of one synchronous step's groups: `(group, gen) -> seed`."""

    base: int
    step: int

    def __call__(self, group: int, gen: int) -> int:
        return rollout_seed(self.base, self.step, group, gen)


@dataclass(frozen=True)
class PromptSeeds:
    """Seeds of the asynchronous producer's prompts: `(prompt, attempt, gen) -> seed`, prompt
    numbers running across steps; a prompt's later attempts sample with other seeds."""

    base: int
    prompts_per_step: int

    def __call__(self, prompt: int, attempt: int, gen: int) -> int:
        step, group = divmod(prompt, self.prompts_per_step)
        return rollout_seed(self.base, step, group, gen) + 7_919 * attempt
