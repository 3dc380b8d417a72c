"""What the step log says of one step, gathered while it runs: one state object per step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rollout_recovery.protocol import GroupResult


@dataclass
class StepFigures:
    step: int
    before: dict[str, float]  # the run's counts when the step began
    t0: float = field(default_factory=time.monotonic)
    gen_s: float = 0.0  # until its groups were generated
    tokens: int = 0  # decoded for them
    wait_s: float = 0.0  # the trainer waited for finished groups (asynchronous GRPO)
    batch_digest: str | None = None

    def generated(self, results: list[GroupResult]) -> None:
        self.tokens = sum(r.generated_tokens for r in results)
        self.gen_s = time.monotonic() - self.t0

    def line(
        self, step: int, record: dict, weight_version: int, push_s: float,
        counters: dict[str, float],
    ) -> dict:  # fmt: skip
        """The step's log line before its checkpoint: `record` (the loop's) and the figures,
        the run's counts as this step's increments."""
        return {
            "step": step,
            **record,
            "generated_tokens": self.tokens,
            "tokens_per_s": self.tokens / self.gen_s if self.gen_s else 0.0,
            "weight_version": weight_version,
            "batch_digest": self.batch_digest,
            "trainer_wait_s": self.wait_s,
            "push_s": push_s,
            **{k: v - self.before.get(k, 0) for k, v in counters.items()},
        }
