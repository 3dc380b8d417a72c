"""GRPO math: group-normalised advantages, a clipped policy-gradient loss, and the truncated
importance weights of asynchronous GRPO.

Only generated tokens carry loss (the mask is 0 on prompt and environment tokens). The clipped
ratio is taken against the trainer's own logprobs before the step (the driver's docstring says
why). Tokens sampled by older weights than the trainer's (asynchronous GRPO: stale groups,
weights pushed into calls in flight) are weighted by the truncated importance ratio between
the trainer's logprobs and the behaviour logprobs the workers sampled with
(`importance_weights`; docs/async_grpo.md).
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean(group)) / (std(group) + eps), for rewards laid out group after group."""
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    g = rewards.view(-1, group_size)
    adv = (g - g.mean(dim=1, keepdim=True)) / (g.std(dim=1, unbiased=False, keepdim=True) + eps)
    return adv.view(-1)


def clipped_pg_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 0.2,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """PPO-style clipped surrogate over masked tokens, averaged over all masked tokens (each
    token's term times its `weights`, when given).

    new/old logprobs, mask and weights are [batch, time]; advantages are per sequence [batch].
    """
    mask = mask.to(new_logprobs.dtype)
    ratio = torch.exp(new_logprobs - old_logprobs)
    adv = advantages.unsqueeze(1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip, 1 + clip) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if weights is not None:
        per_token = per_token * weights
    return (per_token * mask).sum() / mask.sum().clamp_min(1.0)


def importance_weights(
    trainer_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, cap: float
) -> torch.Tensor:
    """Per token, min(pi_trainer / pi_behaviour, cap), without gradient: the truncated
    importance weight of a token the workers sampled with other weights than the trainer's."""
    ratio = torch.exp(trainer_logprobs.detach() - behaviour_logprobs)
    return torch.clamp(ratio, max=cap)
