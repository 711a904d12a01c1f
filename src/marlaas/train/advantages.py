"""Group-relative advantages: the only place a reward becomes a training signal.

Pure function over tensors; the group axis is always the last one (`_G`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from marlaas.errors import ConfigError


def group_advantages(rewards_G: Tensor, scale: bool, eps: float = 1e-6) -> Tensor:
    """Outcome-supervised GRPO advantages, one per sample, same shape as `rewards_G`.

    Shao et al. 2024 (DeepSeekMath, sec. 4.1.2, outcome supervision):
    `A_i = (r_i - mean(r)) / std(r)`, the statistics taken over the `G` samples of one
    prompt. With `scale=False` the division by the std is dropped (Dr. GRPO, Liu et al.
    2025, Fig. 1): the std scaling up-weights prompts that are nearly always (or nearly
    never) solved, a question-level difficulty bias.

    Args:
        rewards_G: `[G]` (one group) or `[N, G]` (N groups of G samples each). Integer or
            bool rewards are converted to float32.
        scale: divide by the group std (GRPO) or not (Dr. GRPO).
        eps: added to the std before dividing, as in the reference implementations.

    The std is the unbiased (Bessel-corrected) sample std, as `torch.std` computes it.
    A group whose rewards are all equal carries no signal and gets exactly zero
    advantages: the centring is zeroed explicitly rather than trusting `r - mean(r)` to
    round to zero, which, divided by `eps`, would turn a rounding error into a large
    advantage. This also covers `G == 1` (whose unbiased std is undefined).
    """
    if rewards_G.dim() not in (1, 2) or rewards_G.shape[-1] == 0:
        raise ConfigError(
            f"rewards must have shape [G] or [N, G] with G >= 1, got {tuple(rewards_G.shape)}"
        )
    if eps < 0:
        raise ConfigError(f"eps must be >= 0, got {eps}")
    rewards = rewards_G if rewards_G.is_floating_point() else rewards_G.float()
    mean = rewards.mean(dim=-1, keepdim=True)
    flat = rewards.amax(dim=-1, keepdim=True) == rewards.amin(dim=-1, keepdim=True)
    centred = torch.where(flat, torch.zeros_like(rewards), rewards - mean)
    if not scale:
        return centred
    # A flat group divides by 1, not by its zero std: 0 / (0 + eps) is fine, 0 / 0 is not.
    std = rewards.std(dim=-1, keepdim=True) if rewards.shape[-1] > 1 else torch.ones_like(mean)
    return centred / (torch.where(flat, torch.ones_like(std), std) + eps)
