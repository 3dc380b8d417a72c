"""The shipped GRPO driver: a small, real loop built only on the public `TrainingRun` API
(run.py), the config, the errors and its own training modules (policy, loss, checkpoint
format): everything a loop of the user's own would have.

Per step: sample `generations_per_prompt` rollouts per prompt at temperature 1 with a distinct
seed per generation (position-keyed sampler: reproducible and resumable), score them with the
toy reward, lease the batch, take one clipped policy-gradient step with AdamW on generated
tokens only, ack the lease, push the new weights, then save the trainer checkpoint, which the
run pairs with a data-plane snapshot and logs in `<checkpoint_dir>/steps.jsonl`.

The old logprobs of the policy-gradient ratio are the trainer's own (one deterministic forward
pass, detached), not the ones the workers sampled with: those differ by float noise with the
batch shape a worker happened to decode in, so a restored run would train on slightly other
numbers than the uninterrupted one. With one optimizer step per batch the ratio is then 1 and
the step depends only on the tokens, masks and rewards, which recovery reproduces exactly; the
final trainer checkpoint is the same bytes however often the run was killed. The generation
logprobs are still required (a row without them is refused) and their gap to the trainer's is
logged: a large gap means the workers served other weights than the trainer holds.

Restore (`restore=True`): `TrainingRun.open` claims the location, chooses the snapshot and its
paired trainer checkpoint (or refuses in one line, deleting nothing) and restores the
rollouts; the driver loads the checkpoint's files into its model and optimizer and pushes
their weights before the first step.

Asynchronous GRPO (`grpo.async_grpo.enabled`): a `Producer` keeps up to
`max_groups_in_flight` groups open; each step trains on the first `prompts_per_step` finished
groups no older than `max_trajectory_age_steps`, weights its tokens by the truncated importance
ratio against the behaviour logprobs (training/grpo.py), pushes the new weights into the calls
in flight and saves the producer's cursor with its checkpoint.
"""

from __future__ import annotations

import numpy as np
import torch
from tqdm import tqdm

from rollout_recovery.config import RolloutRecoveryConfig
from rollout_recovery.errors import CheckpointWriteError, RecoveryError
from rollout_recovery.run import TrainingRun, group_id
from rollout_recovery.trainer.producer import CURSOR_KEY, Cursor, Producer
from rollout_recovery.training.checkpoint import load_state, state_files
from rollout_recovery.training.grpo import clipped_pg_loss, group_advantages, importance_weights
from rollout_recovery.training.policy import export_weights, load_policy, token_logprobs
from rollout_recovery.training.seeds import PromptSeeds, StepSeeds


class TrainingDataError(RecoveryError):
    """A training batch cannot be trained on as it is."""


def _batch_tensors(table):
    """Pad the leased rows, grouped as generated (group id, then generation index). Every row
    must carry its generation logprobs."""
    order = sorted(
        range(table.num_rows),
        key=lambda i: (table.column("group_id")[i].as_py(),
                       table.column("generation_index")[i].as_py()),
    )  # fmt: skip
    missing = table.column("logprobs").is_null().to_pylist()
    if any(missing):
        key = table.column("key")[missing.index(True)].as_py()
        raise TrainingDataError(
            f"replay row {key} has no generation logprobs; a training row must carry the "
            "logprobs its tokens were sampled with (token capture records them with each call)"
        )
    ids, masks, lps = ([np.asarray(v) for v in table.column(c).to_pylist()]
                       for c in ("token_ids", "loss_mask", "logprobs"))  # fmt: skip
    rewards = table.column("reward").to_numpy()
    width = max(len(ids[i]) for i in order)
    out_ids = torch.zeros(len(order), width, dtype=torch.long)
    attn = torch.zeros(len(order), width, dtype=torch.long)
    mask = torch.zeros(len(order), width)
    gen = torch.zeros(len(order), width)
    for row, i in enumerate(order):
        n = len(ids[i])
        out_ids[row, :n] = torch.from_numpy(ids[i].astype(np.int64))
        attn[row, :n] = 1
        mask[row, :n] = torch.from_numpy(masks[i].astype(np.float32))
        gen[row, :n] = torch.from_numpy(lps[i].astype(np.float32))
    # token_logprobs predicts position t from t-1: align masks and logprobs to [:, 1:].
    return out_ids, attn, mask[:, 1:], gen[:, 1:], torch.tensor(rewards[order], dtype=torch.float32)


def grpo_step(
    model, opt, table, group_size: int, importance_cap: float | None = None
) -> tuple[float, float, float, dict]:
    """One policy-gradient step on a leased batch; returns (loss, mean reward, the mean
    absolute gap between generation and trainer logprobs on generated tokens, and the
    importance weights' figures). With `importance_cap` each token is weighted by its
    truncated importance ratio against the behaviour logprobs (asynchronous GRPO)."""
    ids, attn, mask, gen, rewards = _batch_tensors(table)
    adv = group_advantages(rewards, group_size)
    new = token_logprobs(model, ids, attn)
    old = new.detach()  # the trainer's own: the step is independent of the batch shape served
    weights, figures = None, {}
    if importance_cap is not None:
        weights = importance_weights(old, gen, importance_cap)
        w = weights[mask.bool()]
        figures = {"importance_weight_mean": float(w.mean()),
                   "importance_weight_capped": int((w >= importance_cap).sum())}  # fmt: skip
    loss = clipped_pg_loss(new, old, adv, mask, weights=weights)
    opt.zero_grad()
    loss.backward()
    opt.step()
    gap = ((old - gen).abs() * mask).sum() / mask.sum().clamp_min(1.0)
    return loss.item(), float(rewards.mean()), float(gap), figures


def _step_line(r: dict) -> str:
    ckpt = "n/a" if r.get("checkpoint_s") is None else f"{r['checkpoint_s']:.2f}s"
    line = (
        f"step {r['step']}: loss {r['loss']:+.4f}  mean reward {r['mean_reward']:.3f}  "
        f"{r['tokens_per_s']:.0f} tok/s  checkpoint {ckpt}  "
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


def train(
    cfg: RolloutRecoveryConfig, ray_address: str = "local", restore: bool = False
) -> list[dict]:
    """Run (or, with restore, continue) GRPO. A fresh run refuses a location that already
    holds a run; restore continues the run from its newest usable snapshot and the trainer
    checkpoint paired with it. The death of an actor the job needs is restored from in this
    process (`TrainingRun.keep_running`, `failover.max_restores`); a step done again replaces
    its record."""
    g = cfg.grpo
    history: dict[int, dict] = {}

    def loop(run: TrainingRun) -> None:
        torch.manual_seed(g.seed)
        model = load_policy(run.model_dir)
        opt = torch.optim.AdamW(model.parameters(), lr=g.learning_rate)
        if run.checkpoint is not None:
            load_state(run.checkpoint.files, model, opt)
            _export(model, run)
            run.push_weights()
        producer = _producer(cfg, run) if g.async_grpo.enabled else None
        bar = tqdm(range(run.start_step, g.steps), desc="grpo", unit="step",
                   initial=run.start_step, total=g.steps)  # fmt: skip
        for step in bar:
            if producer is None:
                record = _train_step(cfg, run, model, opt, step)
            else:
                record = _train_step_async(cfg, run, model, opt, step, producer)
            history[step] = record
            bar.write(_step_line(record))

    TrainingRun.keep_running(cfg, loop, restore=restore, ray_address=ray_address)
    return [history[step] for step in sorted(history)]


def _producer(cfg: RolloutRecoveryConfig, run: TrainingRun) -> Producer:
    """Asynchronous dispatch, from the restored checkpoint's cursor when there is one. A
    prompt's later attempts sample with other seeds than its first."""
    g = cfg.grpo
    extra = run.checkpoint.extra if run.checkpoint is not None else {}
    cursor = Cursor.model_validate(extra[CURSOR_KEY]) if CURSOR_KEY in extra else None
    seeds = PromptSeeds(g.seed, g.prompts_per_step)
    return Producer(run, seeds, cursor, run.restored_groups())


def _export(model, run: TrainingRun) -> None:
    """The weights the workers reload, into the run's weights directory."""
    try:
        export_weights(model, run.weights_dir)
    except OSError as err:
        raise CheckpointWriteError(
            f"cannot write the weights to push to {run.weights_dir}: {err.strerror or err}; "
            "free space or fix permissions there, then continue with `train --restore`"
        ) from None


def _train_step(cfg, run: TrainingRun, model, opt, step: int) -> dict:
    g = cfg.grpo
    run.begin_step(step)
    tasks = run.tasks(step)
    groups = [(group_id(step, i), task) for i, task in enumerate(tasks)]
    results = run.submit_groups(groups, StepSeeds(g.seed, step))
    lease = run.take_batch(results)
    loss, reward, gap, _ = grpo_step(model, opt, lease.rows, g.generations_per_prompt)
    run.ack(lease)
    _export(model, run)
    run.push_weights()
    record = {"loss": loss, "mean_reward": reward, "rollout_logprob_gap": gap}
    return run.save_checkpoint(state_files(model, opt), {"data_cursor": step + 1}, record)


def _train_step_async(cfg, run: TrainingRun, model, opt, step: int, producer: Producer) -> dict:
    """One asynchronous step: keep the open groups topped up, train on the first finished
    ones young enough, push the weights into the calls in flight, checkpoint with the cursor."""
    g = cfg.grpo
    run.begin_step(step)
    producer.fill()
    results = producer.take(g.prompts_per_step)
    ages = [producer.age(r) for r in results]
    lease = run.take_batch(results)
    cap = g.async_grpo.importance_ratio_cap
    loss, reward, gap, figures = grpo_step(model, opt, lease.rows, g.generations_per_prompt, cap)
    run.ack(lease)
    producer.trained(results)
    _export(model, run)
    run.push_weights()
    record = {"loss": loss, "mean_reward": reward, "rollout_logprob_gap": gap, **figures,
              "groups": [r.group_id for r in results], "age_max": max(ages),
              "groups_dropped_stale": producer.cursor.dropped_stale}  # fmt: skip
    extra = {"data_cursor": step + 1, CURSOR_KEY: producer.cursor.model_dump()}
    return run.save_checkpoint(state_files(model, opt), extra, record)
