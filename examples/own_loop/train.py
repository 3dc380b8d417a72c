"""A training loop of one's own on rollout_recovery: plain PyTorch, crash-safe rollouts.

    python examples/own_loop/train.py --config examples/own_loop/config.yaml [--restore]
        [--ray-address ADDRESS] [key=value ...]

The same arguments as `rollout-recovery train`. Everything about the model, the optimizer, the
learning-rate schedule, the reward (letters_reward.py) and the checkpoint format is this
file's own; the lines marked `# recovery glue` are all it takes to make it survive a crash:
`--restore` continues from the newest snapshot, with the calls that were in flight resumed
from their prefixes, and the trainer state this loop saved at the same step.

The checkpoint is `model.safetensors` (the weights) and `trainer.pt` (optimizer, schedule and
torch RNG state, `torch.save`). Both are the same bytes for the same state, so a run killed and
restored ends with the same final checkpoint as one that never crashed: the rows of a batch are
sorted before training, and the step uses nothing but tokens, masks and rewards.
"""

from __future__ import annotations

import argparse
import io
import random
import sys
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from transformers import AutoModelForCausalLM

from rollout_recovery.config import load_config
from rollout_recovery.errors import RecoveryError, one_line, unwrapped  # recovery glue
from rollout_recovery.run import TrainingRun, group_id  # recovery glue

MOMENTUM = 0.9
WARMUP_STEPS = 4  # the learning rate climbs from a quarter to its full value over these steps
MAX_GRAD_NORM = 1.0
WORDS = ["river", "lantern", "orchard", "harbor", "meadow", "glacier", "canyon", "village"]


class Policy(torch.nn.Module):
    """The causal LM being trained, with what this loop needs of it: per-token logprobs and
    its weights as safetensors bytes (HF tensor names, as the vLLM workers load them)."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__()
        self.lm = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.lm.train()

    def logprobs(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """log p(ids[:, t] | ids[:, :t]) for t >= 1, shape [batch, time - 1]."""
        logits = self.lm(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    def weights(self) -> bytes:
        # A tied output embedding (tiny://qwen3, small Qwen3s) is the input one: safetensors
        # holds each tensor once, and vLLM ties them again on load.
        skip = {"lm_head.weight"} if self.lm.config.tie_word_embeddings else set()
        state = {k: v.detach().contiguous() for k, v in self.lm.state_dict().items()
                 if k not in skip}  # fmt: skip
        return save_safetensors(state, metadata={"format": "pt"})

    def load_weights(self, data: bytes) -> None:
        state = load_safetensors(data)
        missing, unexpected = self.lm.load_state_dict(state, strict=False)
        tied = ["lm_head.weight"] if self.lm.config.tie_word_embeddings else []
        if unexpected or missing != tied:
            raise ValueError(f"weights do not fit the model: missing {missing}, "
                             f"unexpected {unexpected}")  # fmt: skip


def make_tasks(n: int, seed: int) -> list[dict]:
    """`n` prompts, a pure function of the seed (a restored step must get the same ones)."""
    rng = random.Random(seed)
    return [
        {"messages": [{"role": "user", "content": f"Describe a {rng.choice(WORDS)} in words."}]}
        for _ in range(n)
    ]


def seeds_of(base: int, step: int) -> Callable[[int, int], int]:
    """The sampling seed of each generation of a step: distinct, and the same after a restore."""
    return lambda group, gen: ((base * 1_000_003 + step) * 10_007 + group) * 101 + gen


def batch_tensors(rows: pa.Table) -> tuple[torch.Tensor, ...]:
    """Padded token ids, attention and loss masks and rewards, rows in (group, generation)
    order: a restored run may lease them in another order."""
    rows = rows.sort_by([("group_id", "ascending"), ("generation_index", "ascending")])
    ids, masks = rows.column("token_ids").to_pylist(), rows.column("loss_mask").to_pylist()
    width = max(map(len, ids))
    out_ids = torch.zeros(len(ids), width, dtype=torch.long)
    attn = torch.zeros(len(ids), width, dtype=torch.long)
    mask = torch.zeros(len(ids), width)
    for i, (tok, m) in enumerate(zip(ids, masks, strict=True)):
        out_ids[i, : len(tok)] = torch.tensor(tok)
        attn[i, : len(tok)] = 1
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    rewards = torch.tensor(rows.column("reward").to_pylist(), dtype=torch.float32)
    return out_ids, attn, mask[:, 1:], rewards


def train_step(
    policy: Policy,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    rows: pa.Table,
    group_size: int,
) -> tuple[float, float]:
    """One REINFORCE step with group-normalised advantages on generated tokens only; returns
    (loss, mean reward)."""
    ids, attn, mask, rewards = batch_tensors(rows)
    groups = rewards.view(-1, group_size)
    adv = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)
    logprobs = policy.logprobs(ids, attn)
    loss = -(logprobs * adv.view(-1, 1) * mask).sum() / mask.sum().clamp_min(1.0)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), MAX_GRAD_NORM)
    opt.step()
    sched.step()
    return loss.item(), float(rewards.mean())


def checkpoint_files(
    policy: Policy, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler
) -> dict[str, bytes]:
    buf = io.BytesIO()
    state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
             "torch_rng": torch.get_rng_state()}  # fmt: skip
    torch.save(state, buf)
    return {"model.safetensors": policy.weights(), "trainer.pt": buf.getvalue()}


def load_checkpoint(
    files: dict[str, bytes],
    policy: Policy,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    policy.load_weights(files["model.safetensors"])
    state = torch.load(io.BytesIO(files["trainer.pt"]), weights_only=True)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])


def push_weights(policy: Policy, run: TrainingRun) -> None:  # recovery glue
    """Hand the current weights to the vLLM workers."""
    (run.weights_dir / "model.safetensors").write_bytes(policy.weights())  # recovery glue
    run.push_weights()  # recovery glue


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="YAML config file")
    ap.add_argument("--restore", action="store_true", help="continue the run in checkpoint_dir")
    ap.add_argument("--ray-address", default="local", help="`local`: a private Ray instance")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    g = cfg.grpo
    torch.manual_seed(g.seed)
    group = g.generations_per_prompt
    with TrainingRun.open(cfg, args.restore, args.ray_address) as run:  # recovery glue
        policy = Policy(run.model_dir)  # recovery glue: policy.model_path, local
        opt = torch.optim.SGD(policy.parameters(), lr=g.learning_rate, momentum=MOMENTUM)
        sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25,
                                                  total_iters=WARMUP_STEPS)  # fmt: skip
        if run.checkpoint is not None:  # recovery glue: restored into a later step
            load_checkpoint(run.checkpoint.files, policy, opt, sched)  # recovery glue
            push_weights(policy, run)  # recovery glue
        for step in range(run.start_step, g.steps):  # recovery glue
            run.begin_step(step)  # recovery glue
            tasks = make_tasks(g.prompts_per_step, g.seed * 7919 + step)
            groups = [(group_id(step, i), task) for i, task in enumerate(tasks)]  # recovery glue
            results = run.submit_groups(groups, seeds_of(g.seed, step))  # recovery glue
            lease = run.take_batch(results)  # recovery glue
            lr = sched.get_last_lr()[0]
            loss, reward = train_step(policy, opt, sched, lease.rows, group)  # recovery glue
            run.ack(lease)  # recovery glue
            push_weights(policy, run)  # recovery glue
            run.save_checkpoint(  # recovery glue
                files=checkpoint_files(policy, opt, sched),  # recovery glue
                extra={"trained_steps": step + 1},  # recovery glue
                record={"loss": loss, "mean_reward": reward, "lr": lr},  # recovery glue
            )  # recovery glue
            print(f"step {step + 1}: loss {loss:+.4f}  mean reward {reward:.3f}  lr {lr:.2e}",
                  flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RecoveryError as err:  # recovery glue: a refusal, or fenced
        sys.exit(f"own_loop: {one_line(unwrapped(err))}")  # recovery glue
