"""Group-normalised advantages against hand-computed values."""

import math

import pytest
import torch

from bandpo.algo import compute_advantages, group_advantages


def test_hand_computed_std_and_no_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv, m = group_advantages(rewards, 4)
    # group 0: mean 0.5, unbiased std sqrt(1/3); group 1: all equal -> exactly 0.
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a, 0, 0, 0, 0]), rtol=1e-6, atol=0)
    assert m["adv/zero_signal_group_frac"].item() == 0.5
    adv, _ = compute_advantages(rewards, 4, "grpo_no_std")
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))


def test_flat_group_is_exactly_zero_never_nan():
    rewards = torch.full((6,), 0.1)  # mean of 0.1s is not exactly 0.1 in float32
    adv, _ = group_advantages(rewards, 3)
    assert (adv == 0).all()


def test_bad_inputs():
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        group_advantages(torch.ones(4), 1)
    with pytest.raises(ValueError, match="divisible"):
        group_advantages(torch.ones(5), 2)
    with pytest.raises(ValueError, match="grpo, grpo_no_std"):
        compute_advantages(torch.ones(4), 2, "rloo")


def test_trainer_rejects_rows_not_grouped_by_prompt():
    from bandpo.trainer.dynamic_sampling import check_groups

    check_groups(torch.tensor([0, 0, 1, 1, 2, 2]), 3, 2)
    with pytest.raises(RuntimeError, match="contiguous groups of rollout.n=2"):
        check_groups(torch.tensor([0, 1, 0, 1, 2, 2]), 3, 2)  # interleaved: groups would mix prompts
