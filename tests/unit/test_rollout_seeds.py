"""The GRPO driver's rollout seeds: the values a restored run depends on, and that they reach
the controller without importing torch there (a new controller imported it cold, ~1 s, before
its first resumed call)."""

from __future__ import annotations

import subprocess
import sys

import ray.cloudpickle as cloudpickle

from rollout_recovery.training.seeds import PromptSeeds, StepSeeds, rollout_seed


def test_seed_values_are_the_driver_scheme() -> None:
    assert rollout_seed(3, 2, 1, 4) == ((3 * 1_000_003 + 2) * 10_007 + 1) * 101 + 4
    assert StepSeeds(3, 2)(1, 4) == rollout_seed(3, 2, 1, 4)
    # prompt 5 with 2 prompts per step is step 2, group 1; a retry moves the seed
    assert PromptSeeds(3, 2)(5, 0, 4) == rollout_seed(3, 2, 1, 4)
    assert PromptSeeds(3, 2)(5, 1, 4) == rollout_seed(3, 2, 1, 4) + 7_919
    seeds = {StepSeeds(0, s)(g, n) for s in range(4) for g in range(4) for n in range(8)}
    assert len(seeds) == 4 * 4 * 8


def test_seeds_unpickle_without_torch() -> None:
    blob = cloudpickle.dumps([StepSeeds(7, 1), PromptSeeds(7, 2)])
    code = (
        "import sys, pickle; seeds = pickle.loads(sys.stdin.buffer.read()); "
        "print(seeds[0](0, 1), seeds[1](3, 0, 1), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True,
                         check=True).stdout.split()  # fmt: skip
    assert out == [str(StepSeeds(7, 1)(0, 1)).encode(), str(PromptSeeds(7, 2)(3, 0, 1)).encode(),
                   b"False"]  # fmt: skip
