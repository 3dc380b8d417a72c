"""Benchmark asynchronous GRPO against synchronous, side by side in one run.

    .venv/bin/python scripts/bench_async.py --json bench_results/async.json [--steps 8]

Each mode runs the shipped driver (`training/driver.py`, in this process, its own job) on the
same model, task and step shape (`--prompts` groups of 4 per step, `--tokens` new tokens per
call, `--steps` steps), in a fresh location:

- `sync`: generate, then train, then push (no rollout snapshots);
- `async`: `grpo.async_grpo.enabled`, weights pushed into the calls in flight;
- `async-boundaries`: the same with `in_flight_weight_updates: false` (a push waits for the calls
  in flight to end);
- `async-prefix`: `async` with prefix-level recovery: snapshots every `--interval` s while
  groups generate and the trainer trains.

Figures per mode, over the steps after the first (which pays the engines' first-call costs),
from each step's line in `steps.jsonl`: trained tokens per second (tokens of the groups trained
on, over the steps' wall time: equal units for every mode), the trainer's idle share (the time
it waited for rollouts: the whole generation in `sync`, `trainer_wait_s` in the asynchronous
modes), the push time per step, and the rollout snapshots and their fence hold per step. The
ratio column is each mode's tokens/s over `sync`'s. `--rounds R` runs the modes R times, in a
rotated order each round, and reports medians.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_common import write_result  # noqa: E402

from rollout_recovery.generation.engine_setup import CPU_ENGINE_ENV  # noqa: E402

os.environ.update(CPU_ENGINE_ENV)
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

MODES = {
    "sync": ["grpo.async_grpo.enabled=false"],
    "async": ["grpo.async_grpo.enabled=true"],
    "async-boundaries": [
        "grpo.async_grpo.enabled=true",
        "grpo.async_grpo.in_flight_weight_updates=false",
    ],
    "async-prefix": [
        "grpo.async_grpo.enabled=true",
        "rollout_recovery.target_level=prefix",
        "checkpointing.save_data_plane=true",
    ],
}


def run_mode(args, name: str, where: Path) -> dict:
    from rollout_recovery.config import load_config
    from rollout_recovery.training.driver import train

    cfg = load_config(
        str(REPO / "configs" / "grpo_tiny_cpu.yaml"),
        [f"checkpointing.checkpoint_dir={where / name}", f"grpo.steps={args.steps}",
         f"grpo.prompts_per_step={args.prompts}", "grpo.generations_per_prompt=4",
         f"policy.generation.max_new_tokens={args.tokens}", "token_capture.enabled=true",
         f"rollout_checkpointing.snapshot_attempt_interval_s={args.interval}", *MODES[name]],
    )  # fmt: skip
    t0 = time.monotonic()
    history = train(cfg)
    wall = time.monotonic() - t0
    steps = history[1:]  # the first step pays the engines' first-call costs
    step_s = sum(h["step_s"] for h in steps)
    idle = sum(h["trainer_wait_s"] if name != "sync" else h["generation_s"] for h in steps)
    return {
        "tokens_per_s": sum(h["generated_tokens"] for h in steps) / step_s,
        "trainer_idle_share": idle / step_s,
        "step_s": step_s / len(steps),
        "push_s": sum(h["push_s"] for h in steps) / len(steps),
        "snapshots_per_step": sum(h.get("checkpoints", 0) for h in steps) / len(steps),
        "fence_hold_s_per_step": sum(h.get("fence_hold_s", 0) for h in steps) / len(steps),
        "groups_dropped_stale": history[-1].get("groups_dropped_stale", 0),
        "age_max": max((h.get("age_max", 0) for h in history), default=0),
        "wall_s": wall,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="bench_results/async.json")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    names = list(MODES)
    rounds: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                rounds[name].append(run_mode(args, name, Path(tmp) / f"round-{r}"))
    result = {n: {k: statistics.median(x[k] for x in rounds[n]) for k in rounds[n][0]}
              for n in names}  # fmt: skip
    base = result["sync"]["tokens_per_s"]
    for n in names:
        result[n]["ratio_to_sync"] = result[n]["tokens_per_s"] / base
    print(f"\nasynchronous GRPO ({args.steps} steps of {args.prompts} groups x 4 calls x "
          f"{args.tokens} tokens; medians of {args.rounds} round(s); steps after the "
          "first)")  # fmt: skip
    head = ("mode", "tokens/s", "ratio", "idle", "step s", "push s", "snaps/step", "fence s",
            "stale", "age")  # fmt: skip
    print(f"{head[0]:<18}" + "".join(f"{h:>11}" for h in head[1:]))
    for n in names:
        f = result[n]
        cells = (f"{f['tokens_per_s']:.0f}", f"{f['ratio_to_sync']:.2f}",
                 f"{f['trainer_idle_share']:.0%}", f"{f['step_s']:.2f}", f"{f['push_s']:.3f}",
                 f"{f['snapshots_per_step']:.1f}", f"{f['fence_hold_s_per_step']:.3f}",
                 f"{f['groups_dropped_stale']:.0f}", f"{f['age_max']:.0f}")  # fmt: skip
        print(f"{n:<18}" + "".join(f"{c:>11}" for c in cells))
    write_result(args.json, {"args": vars(args), "modes": result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
