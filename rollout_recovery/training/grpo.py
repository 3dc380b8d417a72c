"""GRPO math: group-normalised advantages and a clipped policy-gradient loss.

Only generated tokens carry loss (the mask is 0 on prompt and environment tokens). The ratio
is taken against the logprobs the rollout was sampled with (recorded by the workers), so a
step is an honest off-policy correction even when weights moved during generation.
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
) -> torch.Tensor:
    """PPO-style clipped surrogate over masked tokens, averaged over all masked tokens.

    new/old logprobs and mask are [batch, time]; advantages are per sequence [batch].
    """
    mask = mask.to(new_logprobs.dtype)
    ratio = torch.exp(new_logprobs - old_logprobs)
    adv = advantages.unsqueeze(1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip, 1 + clip) * adv
    per_token = -torch.minimum(unclipped, clipped)
    return (per_token * mask).sum() / mask.sum().clamp_min(1.0)
