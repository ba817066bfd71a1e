"""Group-normalised advantages (GRPO): one scalar per response, broadcast over its tokens.

For each prompt's group of G responses with rewards R:
    std variant:     A = (R - mean(R)) / (std(R) + eps)     unbiased std, eps = 1e-6
    no-std variant:  A = R - mean(R)                        (Dr. GRPO)
A group whose rewards are all equal carries no signal: its advantages are exactly 0
(not (R - mean)/eps of a rounding residue, and never NaN).
"""

from __future__ import annotations

import torch

from bandpo.errors import check_choice, check_number

ADVANTAGE_ESTIMATORS = ("grpo", "grpo_no_std")


def check_group_size(group_size, name: str = "group_size") -> None:
    """Responses per prompt (``rollout.n``): an integer >= 2, since a group of one has no baseline."""
    check_number(group_size, name, low=2, integer=True)


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    norm_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Advantages for rewards laid out as consecutive groups.

    Args:
        rewards: [N] rewards (N = B*G); responses of one prompt are contiguous.
        group_size: G, responses per prompt (>= 2: a group of one has no baseline).
        norm_std: divide by the group's unbiased std (+ eps).
        eps: added to the std.

    Returns:
        ``(advantages [N], metrics)`` with the fraction of groups that carry no signal.
    """
    check_group_size(group_size)
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by group_size={group_size}, got shape {tuple(rewards.shape)}"
        )
    grouped = rewards.to(torch.float32).view(-1, group_size)  # [B, G]
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if norm_std:
        centered = centered / (grouped.std(dim=1, unbiased=True, keepdim=True) + eps)
    flat = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)  # [B, 1]
    advantages = torch.where(flat, torch.zeros_like(centered), centered)
    metrics = {"adv/zero_signal_group_frac": flat.float().mean(), "adv/abs_mean": advantages.abs().mean()}
    return advantages.reshape(-1), metrics


def compute_advantages(
    rewards: torch.Tensor, group_size: int, estimator: str = "grpo", eps: float = 1e-6
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dispatch by estimator name (``grpo`` | ``grpo_no_std``)."""
    check_choice(estimator, ADVANTAGE_ESTIMATORS, "advantage estimator")
    return group_advantages(rewards, group_size, norm_std=estimator == "grpo", eps=eps)
