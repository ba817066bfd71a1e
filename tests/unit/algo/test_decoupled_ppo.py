"""Decoupled PPO on a hand-built stale batch (trainer.max_staleness=1): three policies per token.

pi_b sampled the batch (the engines, one update behind), pi_old is the actor at the start of
the update (the proximal policy), pi_theta the policy being optimised. The clip interval is
taken around pi_old, and w = min(pi_old / pi_b, C) reweights each token (detached). Every
number below is a ratio of the listed probabilities, so float64 reproduces it to ~1e-15.
"""

from __future__ import annotations

import pytest
import torch

from bandpo.algo import LossOptions, policy_loss
from bandpo.algo.losses import ratio_interval

# Row 0 (A = +1): tokens a, b; row 1 (A = -1): tokens c, d.
PI_B = torch.tensor([[0.25, 0.4], [0.1, 0.9]], dtype=torch.float64)
PI_OLD = torch.tensor([[0.5, 0.2], [0.3, 0.9]], dtype=torch.float64)
PI_THETA = torch.tensor([[0.7, 0.22], [0.15, 0.99]], dtype=torch.float64)
ADV = torch.tensor([1.0, -1.0], dtype=torch.float64)
MASK = torch.ones(2, 2, dtype=torch.long)
# grpo's interval [0.8, 1.2], C = 2:
#   a: r = 0.7/0.5 = 1.4 > 1.2, A > 0 -> L = -1.2 (clipped, no gradient); w = min(0.5/0.25, 2) = 2   -> -2.4
#   b: r = 0.22/0.2 = 1.1           -> L = -1.1;                                   w = 0.2/0.4 = 0.5 -> -0.55
#   c: r = 0.15/0.3 = 0.5 < 0.8, A < 0 -> L = 0.8 (clipped, no gradient);         w = min(3, 2) = 2 -> 1.6
#   d: r = 0.99/0.9 = 1.1           -> L = 1.1;                                    w = 1             -> 1.1
# token-mean: (-2.4 - 0.55 + 1.6 + 1.1) / 4 = -0.0625
# dL/dlogp = -A w r / 4 where unclipped: b -> -0.5 * 1.1 / 4, d -> 1.1 / 4.
EXPECTED_LOSS = -0.0625
EXPECTED_GRAD = torch.tensor([[0.0, -0.55 / 4], [0.0, 1.1 / 4]], dtype=torch.float64)
OPTS = LossOptions(algorithm="grpo", agg="token-mean", dual_clip=None, tis_cap=2.0)


def test_stale_batch_loss_and_gradient_hand_computed():
    logp = torch.log(PI_THETA).requires_grad_()
    loss, m = policy_loss(logp, torch.log(PI_OLD), ADV, MASK, OPTS, rollout_logprobs=torch.log(PI_B))
    assert loss.item() == pytest.approx(EXPECTED_LOSS, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, EXPECTED_GRAD, rtol=1e-12, atol=1e-15)
    assert m["tis/weight_mean"].item() == pytest.approx((2 + 0.5 + 2 + 1) / 4, rel=1e-12)
    assert m["tis/truncated_frac"].item() == pytest.approx(1 / 4, rel=1e-12)  # c's 3 is capped at 2
    assert m["clip_frac_up"].item() == pytest.approx(1 / 4) and m["clip_frac_down"].item() == pytest.approx(
        1 / 4
    )


def test_interval_is_around_the_proximal_policy_not_the_behaviour_policy():
    # Clipping r against pi_b instead (pi_theta / pi_b: a 2.8, b 0.55, c 1.5, d 1.1) would give another loss.
    behaviour_clipped, _ = policy_loss(
        torch.log(PI_THETA),
        torch.log(PI_B),
        ADV,
        MASK,
        LossOptions(algorithm="grpo", agg="token-mean", dual_clip=None),
    )
    assert behaviour_clipped.item() == pytest.approx((-1.2 - 0.55 + 1.5 + 1.1) / 4, abs=1e-12)
    assert behaviour_clipped.item() != pytest.approx(EXPECTED_LOSS)
    # BandPO's per-token bounds are functions of pi_old's probabilities.
    lo, hi = ratio_interval(torch.log(PI_OLD), "bandpo", delta=0.05, upper_cap=10.0)
    lo_b, _ = ratio_interval(torch.log(PI_B), "bandpo", delta=0.05, upper_cap=10.0)
    assert not torch.allclose(lo, lo_b)
    band = LossOptions(algorithm="bandpo", agg="token-mean", dual_clip=None, upper_cap=10.0, tis_cap=2.0)
    loss, _ = policy_loss(
        torch.log(PI_THETA), torch.log(PI_OLD), ADV, MASK, band, rollout_logprobs=torch.log(PI_B)
    )
    r = PI_THETA / PI_OLD
    w = (PI_OLD / PI_B).clamp(max=2.0)
    a = ADV.unsqueeze(-1)
    expected = (w * torch.maximum(-a * r, -a * r.clamp(lo, hi))).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)


def test_first_optimizer_step_ratio_is_one():
    # At the first step pi_theta = pi_old: the loss is -A w per token, the interval inactive.
    loss, m = policy_loss(
        torch.log(PI_OLD), torch.log(PI_OLD), ADV, MASK, OPTS, rollout_logprobs=torch.log(PI_B)
    )
    assert loss.item() == pytest.approx((-2 - 0.5 + 2 + 1) / 4, abs=1e-12)
    assert m["clip_frac_up"].item() == 0 and m["clip_frac_down"].item() == 0
