"""Truncated importance sampling for the rollout/trainer mismatch: hand-computed weights."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from bandpo.algo import LossOptions, policy_loss, tis_weights

# pi_old / pi_rollout per token: 0.5/0.25 = 2, 0.2/0.4 = 0.5, 0.9/0.9 = 1, 0.3/0.1 = 3; row 1's
# last position is padding (rollout logprob -inf there must not give NaN).
OLD = torch.log(torch.tensor([[0.5, 0.2], [0.9, 0.3]], dtype=torch.float64))
ROLLOUT = torch.log(torch.tensor([[0.25, 0.4], [0.9, 0.1]], dtype=torch.float64))
MASK = torch.tensor([[1, 1], [1, 0]])


def test_weights_hand_computed():
    w, mean, frac = tis_weights(OLD, ROLLOUT, 1.5, MASK.double())
    # The padded position gets weight 1 (log-ratio 0 there); the loss masks it anyway.
    torch.testing.assert_close(
        w, torch.tensor([[1.5, 0.5], [1.0, 1.0]], dtype=torch.float64), rtol=1e-12, atol=0
    )
    assert mean.item() == pytest.approx((1.5 + 0.5 + 1.0) / 3, rel=1e-12)
    assert frac.item() == pytest.approx(1 / 3, rel=1e-12)  # the padded 3 is not counted
    rollout = ROLLOUT.clone()
    rollout[1, 1] = -math.inf
    w, _, _ = tis_weights(OLD, rollout, 2.0, MASK.double())
    assert bool(torch.isfinite(w).all())


@pytest.mark.parametrize("algorithm", ["grpo", "clip_higher", "bandpo"])
def test_loss_is_weighted_per_token_and_weights_carry_no_gradient(algorithm):
    # Ratios 1 (logp = old): no clipping, so L = -A per token and dL/dlogp = -A / count.
    logp = OLD.clone().requires_grad_()
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    opts = LossOptions(algorithm=algorithm, agg="token-mean", dual_clip=None, tis_cap=1.5)
    loss, m = policy_loss(logp, OLD, adv, MASK, opts, rollout_logprobs=ROLLOUT)
    # token-mean over 3 valid tokens: (-1 * 1.5 + -1 * 0.5 + 2 * 1.0) / 3 = 0.
    assert loss.item() == pytest.approx(0.0, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.5, -0.5], [2.0, 0.0]], dtype=torch.float64) / 3)
    assert m["tis/weight_mean"].item() == pytest.approx(1.0) and m[
        "tis/truncated_frac"
    ].item() == pytest.approx(1 / 3)
    off, m_off = policy_loss(
        OLD.clone(), OLD, adv, MASK, replace(opts, tis_cap=None), rollout_logprobs=ROLLOUT
    )
    assert off.item() == pytest.approx((-1 - 1 + 2) / 3) and "tis/weight_mean" not in m_off


def test_bad_arguments():
    with pytest.raises(ValueError, match="needs rollout_logprobs"):
        policy_loss(OLD, OLD, torch.ones(2), MASK, LossOptions(tis_cap=2.0))
    with pytest.raises(ValueError, match="tis_cap must be"):
        policy_loss(OLD, OLD, torch.ones(2), MASK, LossOptions(tis_cap=0.5), rollout_logprobs=ROLLOUT)
