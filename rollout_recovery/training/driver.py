"""The shipped GRPO driver: a small, real loop built only on the `RolloutRecovery` API.

Per step: sample `generations_per_prompt` rollouts per prompt at temperature 1 with a distinct
seed per generation (position-keyed sampler: reproducible and resumable), score them with the
toy reward, lease the batch, take one clipped policy-gradient step with AdamW on generated
tokens only, ack the lease, push the new weights, write a trainer checkpoint, then a
data-plane snapshot. One JSON line per step goes to `<checkpoint_dir>/steps.jsonl`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from rollout_recovery.api import SingleController
from rollout_recovery.config import RolloutRecoveryConfig
from rollout_recovery.data_plane.schemas import list_rows
from rollout_recovery.tiny_model import resolve_model_path
from rollout_recovery.training.checkpoint import load_trainer_checkpoint, save_trainer_checkpoint
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


def _batch_digest(table) -> str:
    h = hashlib.sha256()
    keys = table.column("key").to_pylist()
    ids = list_rows(table, "token_ids")
    rewards = table.column("reward").to_pylist()
    for i in sorted(range(len(keys)), key=keys.__getitem__):
        h.update(keys[i].encode())
        h.update(ids[i].tobytes())
        h.update(repr(rewards[i]).encode())
    return h.hexdigest()


def _write_batch(path: Path, table) -> None:
    """The exact training batch of a step (for parity checks), rows sorted by key."""
    import pyarrow as pa
    import pyarrow.compute as pc

    path.parent.mkdir(parents=True, exist_ok=True)
    table = table.take(pc.sort_indices(table, [("key", "ascending")]))
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def _write_states(path: Path, results) -> None:
    """Each episode's final tool state, by replay key (None: finished before a restore)."""
    states = {r.key: s for g in results for r, s in zip(g.rows, g.states, strict=True)}
    path.write_text(json.dumps(states, sort_keys=True))


def _step_line(r: dict) -> str:
    line = (
        f"step {r['step']}: loss {r['loss']:+.4f}  mean reward {r['mean_reward']:.3f}  "
        f"{r['tokens_per_s']:.0f} tok/s  checkpoint {r['checkpoint_s']:.2f}s  "
        f"rollout checkpoints {r['checkpoints']:.0f} (fence {r['fence_hold_s']:.2f}s"
        + (f", {r['checkpoint_failures']:.0f} failed)" if r["checkpoint_failures"] else ")")
    )
    if r["restored_episodes"]:
        line += (
            f"  restored {r['restored_episodes']} episodes / {r['restored_calls']} calls: kept "
            f"{r['restored_turn_tokens']} turn + {r['restored_prefix_tokens']} prefix tokens, "
            f"decoded {r['tail_tokens']} tail + {r['regenerated_tokens']} regenerated"
        )
    return line


def _trainer_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "trainer" / f"step-{step:06d}"


def train(
    cfg: RolloutRecoveryConfig, ray_address: str = "local", restore: bool = False
) -> list[dict]:
    """Run (or, with restore, continue) GRPO. Restore loads the newest published snapshot, the
    trainer checkpoint of the same step, and resumes the step in progress from its ledger."""
    g = cfg.grpo
    torch.manual_seed(g.seed)
    run_dir = Path(cfg.checkpointing.checkpoint_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "steps.jsonl"
    rr = SingleController(cfg, ray_address)
    history = []
    try:
        model = load_policy(resolve_model_path(cfg.policy.model_path))
        opt = torch.optim.AdamW(model.parameters(), lr=g.learning_rate)
        start = 0
        if restore:
            ledger = rr.restore(cfg.rollout_checkpointing.restore_mode)
            if ledger is None:
                print(
                    f"No published snapshot under {run_dir / 'data_plane'}: starting from step 0 "
                    "(checkpointing.save_data_plane=true makes runs restorable)",
                    flush=True,
                )
            else:
                print(f"Selected rollout recovery snapshot: {ledger['snapshot']}", flush=True)
                start = ledger["step"]
                if start > 0:
                    ckpt = _trainer_dir(run_dir, start)
                    if not (ckpt / "meta.json").exists():
                        raise RuntimeError(
                            f"snapshot is for trainer step {start} but {ckpt} is missing; "
                            "restore needs the trainer checkpoint the snapshot followed"
                        )
                    load_trainer_checkpoint(ckpt, model, opt)
                    rr.push_weights(
                        str(export_weights(model, run_dir / "weights")), ledger["weight_version"]
                    )
        bar = tqdm(range(start, g.steps), desc="grpo", unit="step", initial=start, total=g.steps)
        for step in bar:
            rr.set_step(step)
            before = rr.counters()
            t0 = time.monotonic()
            prompts = make_prompts(g.prompts_per_step, seed=g.seed * 1_000_003 + step)
            groups = [(f"s{step:04d}-p{i:03d}", msgs) for i, msgs in enumerate(prompts)]

            def seeds(gi: int, gen: int, step: int = step) -> int:
                return ((g.seed * 1_000_003 + step) * 10_007 + gi) * 101 + gen

            results = rr.submit_groups(groups, seeds, digit_reward)
            gen_s = time.monotonic() - t0
            tokens = sum(r.generated_tokens for r in results)
            lease = rr.take_batch(len(groups) * g.generations_per_prompt)
            _write_batch(run_dir / "batches" / f"step-{step + 1:06d}.arrow", lease.rows)
            _write_states(run_dir / "batches" / f"step-{step + 1:06d}.states.json", results)
            ids, attn, mask, old, rewards = _batch_tensors(lease.rows)
            adv = group_advantages(rewards, g.generations_per_prompt)
            loss = clipped_pg_loss(token_logprobs(model, ids, attn), old, adv, mask)
            opt.zero_grad()
            loss.backward()
            opt.step()
            rr.ack(lease)
            version = rr.push_weights(str(export_weights(model, run_dir / "weights")))
            c0 = time.monotonic()
            save_trainer_checkpoint(
                _trainer_dir(run_dir, step + 1), model, opt,
                {"step": step + 1, "data_cursor": step + 1},
            )  # fmt: skip
            snap = rr.notify_trainer_checkpoint(step + 1)
            keep = cfg.rollout_checkpointing.keep_latest_k + 1
            for old in sorted((run_dir / "trainer").glob("step-*"))[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
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
                "batch_digest": _batch_digest(lease.rows),
                **{k: v - before.get(k, 0) for k, v in rr.counters().items()},
            }
            history.append(record)
            with open(log_path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
            bar.write(_step_line(record))
    finally:
        rr.close()
    return history
