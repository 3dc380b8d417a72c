"""The shipped GRPO driver: a small, real loop built only on the `RolloutRecovery` API.

Per step: sample `generations_per_prompt` rollouts per prompt at temperature 1 with a distinct
seed per generation (position-keyed sampler: reproducible and resumable), score them with the
toy reward, lease the batch, take one clipped policy-gradient step with AdamW on generated
tokens only, ack the lease, push the new weights, write a trainer checkpoint, then a
data-plane snapshot. One JSON line per step goes to `<checkpoint_dir>/steps.jsonl`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from rollout_recovery.api import RolloutRecovery
from rollout_recovery.config import RolloutRecoveryConfig
from rollout_recovery.data_plane.schemas import list_rows
from rollout_recovery.training.checkpoint import save_trainer_checkpoint
from rollout_recovery.training.grpo import clipped_pg_loss, group_advantages
from rollout_recovery.training.policy import export_weights, load_policy, token_logprobs
from rollout_recovery.training.task import digit_reward, make_prompts


def _batch_tensors(table):
    """Pad the leased rows, grouped as generated (group id, then generation index)."""
    order = sorted(
        range(table.num_rows),
        key=lambda i: (table.column("group_id")[i].as_py(),
                       table.column("generation_index")[i].as_py()),
    )  # fmt: skip
    ids, masks, lps = (list_rows(table, c) for c in ("token_ids", "loss_mask", "logprobs"))
    rewards = table.column("reward").to_numpy()
    width = max(len(ids[i]) for i in order)
    out_ids = torch.zeros(len(order), width, dtype=torch.long)
    attn = torch.zeros(len(order), width, dtype=torch.long)
    mask = torch.zeros(len(order), width)
    old = torch.zeros(len(order), width)
    for row, i in enumerate(order):
        n = len(ids[i])
        out_ids[row, :n] = torch.from_numpy(ids[i].astype(np.int64))
        attn[row, :n] = 1
        mask[row, :n] = torch.from_numpy(masks[i].astype(np.float32))
        old[row, :n] = torch.from_numpy(lps[i].astype(np.float32))
    # token_logprobs predicts position t from t-1: align masks and old logprobs to [:, 1:].
    return out_ids, attn, mask[:, 1:], old[:, 1:], torch.tensor(rewards[order], dtype=torch.float32)


def train(cfg: RolloutRecoveryConfig, ray_address: str = "local") -> list[dict]:
    g = cfg.grpo
    torch.manual_seed(g.seed)
    run_dir = Path(cfg.checkpointing.checkpoint_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "steps.jsonl"
    rr = RolloutRecovery(cfg, ray_address).start()
    history = []
    try:
        model = load_policy(rr.model_dir)
        opt = torch.optim.AdamW(model.parameters(), lr=g.learning_rate)
        bar = tqdm(range(g.steps), desc="grpo", unit="step")
        for step in bar:
            t0 = time.monotonic()
            prompts = make_prompts(g.prompts_per_step, seed=g.seed * 1_000_003 + step)
            groups = [(f"s{step:04d}-p{i:03d}", msgs) for i, msgs in enumerate(prompts)]

            def seeds(gi: int, gen: int, step: int = step) -> int:
                return ((g.seed * 1_000_003 + step) * 10_007 + gi) * 101 + gen

            results = rr.submit_groups(groups, seeds, digit_reward)
            gen_s = time.monotonic() - t0
            tokens = sum(r.generated_tokens for r in results)
            lease = rr.take_batch(len(groups) * g.generations_per_prompt)
            ids, attn, mask, old, rewards = _batch_tensors(lease.rows)
            adv = group_advantages(rewards, g.generations_per_prompt)
            loss = clipped_pg_loss(token_logprobs(model, ids, attn), old, adv, mask)
            opt.zero_grad()
            loss.backward()
            opt.step()
            rr.ack(lease)
            version = rr.push_weights(export_weights(model, run_dir / "weights"))
            c0 = time.monotonic()
            save_trainer_checkpoint(run_dir / "trainer", model, opt,
                                    {"step": step + 1, "data_cursor": step + 1})  # fmt: skip
            snap = rr.notify_trainer_checkpoint(step + 1)
            ckpt_s = time.monotonic() - c0
            record = {
                "step": step + 1,
                "loss": loss.item(),
                "mean_reward": float(rewards.mean()),
                "generated_tokens": tokens,
                "tokens_per_s": tokens / gen_s if gen_s else 0.0,
                "weight_version": version,
                "checkpoint_s": ckpt_s,
                "snapshot_s": snap["snapshot_s"],
            }
            history.append(record)
            with open(log_path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
            bar.write(
                f"step {step + 1}: loss {record['loss']:+.4f}  mean reward "
                f"{record['mean_reward']:.3f}  {record['tokens_per_s']:.0f} tok/s  "
                f"checkpoint {ckpt_s:.2f}s"
            )
    finally:
        rr.close()
    return history
