"""Policy loss: hand-computed values, exact zero gradient where clipped, micro-batch sums."""

from __future__ import annotations

import math

import pytest
import torch

from bandpo.algo import LossOptions, aggregate, kl_penalty, policy_loss

# Two sequences: seq 0 (A = +1) has ratios 1.5, 0.5, 1.0; seq 1 (A = -1) has 0.5, 1.5, pad.
RATIOS = [[1.5, 0.5, 1.0], [0.5, 1.5, 1.0]]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
ADV = torch.tensor([1.0, -1.0])
OLD_P = 0.5  # every token's old probability (so TV band at delta 0.05 is [0.9, 1.1])


def _inputs():
    old = torch.full((2, 3), math.log(OLD_P), dtype=torch.float64)
    logp = (old + torch.tensor(RATIOS, dtype=torch.float64).log()).requires_grad_()
    return logp, old


# Per-token L = max(-A r, -A clip(r)) worked by hand:
#   grpo [0.8, 1.2]:         seq0: -1.2 (clipped), -0.5, -1.0   seq1: 0.8 (clipped), 1.5
#   clip_higher [0.8, 1.28]: seq0: -1.28,         -0.5, -1.0   seq1: 0.8,           1.5
#   bandpo tv, p=.5 [0.9, 1.1]: seq0: -1.1,       -0.5, -1.0   seq1: 0.9,           1.5
# token-mean: sum/5; seq-mean-token-mean: (sum0/3 + sum1/2)/2; seq-mean-token-sum: sum/2;
# seq-mean-token-sum-norm: sum/(2*3).
EXPECTED = {
    "grpo": {
        "token-mean": -0.4 / 5,
        "seq-mean-token-mean": (-2.7 / 3 + 2.3 / 2) / 2,
        "seq-mean-token-sum": -0.4 / 2,
        "seq-mean-token-sum-norm": -0.4 / 6,
    },
    "clip_higher": {
        "token-mean": -0.48 / 5,
        "seq-mean-token-mean": (-2.78 / 3 + 2.3 / 2) / 2,
        "seq-mean-token-sum": -0.48 / 2,
        "seq-mean-token-sum-norm": -0.48 / 6,
    },
    "bandpo": {
        "token-mean": -0.2 / 5,
        "seq-mean-token-mean": (-2.6 / 3 + 2.4 / 2) / 2,
        "seq-mean-token-sum": -0.2 / 2,
        "seq-mean-token-sum-norm": -0.2 / 6,
    },
}


@pytest.mark.parametrize("algorithm", list(EXPECTED))
@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_hand_computed(algorithm, agg):
    logp, old = _inputs()
    loss, m = policy_loss(
        logp, old, ADV, MASK, LossOptions(algorithm=algorithm, divergence="tv", delta=0.05, agg=agg)
    )
    assert loss.item() == pytest.approx(EXPECTED[algorithm][agg], abs=1e-12)
    assert m["clip_frac_up"].item() == pytest.approx(1 / 5) and m["clip_frac_down"].item() == pytest.approx(
        1 / 5
    )


def test_gradient_is_zero_exactly_where_clipped():
    logp, old = _inputs()
    loss, _ = policy_loss(logp, old, ADV, MASK, LossOptions(algorithm="grpo", agg="token-mean"))
    loss.backward()
    g = logp.grad
    assert g[0, 0] == 0 and g[1, 0] == 0 and g[1, 2] == 0  # clipped up, clipped down, padding
    # Unclipped tokens: dL/dlogp = -A r / T (T = 5 tokens).
    assert g[0, 1].item() == pytest.approx(-0.5 / 5) and g[0, 2].item() == pytest.approx(-1.0 / 5)
    assert g[1, 1].item() == pytest.approx(1.5 / 5)


def test_dual_clip_engages_only_for_negative_advantage():
    old = torch.zeros(2, 1, dtype=torch.float64) + math.log(0.5)
    logp = (old + math.log(12.0)).requires_grad_()  # ratio 12 > c = 10
    loss, m = policy_loss(
        logp,
        old,
        torch.tensor([1.0, -1.0]),
        torch.ones(2, 1),
        LossOptions(algorithm="grpo", agg="token-mean", dual_clip=10.0),
    )
    # A = +1: max(-12, -1.2) = -1.2 (clipped); A = -1: min(max(12, 1.2), 10) = 10 (dual clip).
    assert loss.item() == pytest.approx((-1.2 + 10.0) / 2)
    assert m["clip_frac_dual"].item() == pytest.approx(0.5)
    loss.backward()
    assert (logp.grad == 0).all()
    loss_nodual, _ = policy_loss(
        logp,
        old,
        torch.tensor([1.0, -1.0]),
        torch.ones(2, 1),
        LossOptions(algorithm="grpo", agg="token-mean", dual_clip=None),
    )
    assert loss_nodual.item() == pytest.approx((-1.2 + 12.0) / 2)


@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
@pytest.mark.parametrize("algorithm", ["grpo", "bandpo", "dcpo"])
def test_micro_batches_sum_to_full_batch(agg, algorithm):
    gen = torch.Generator().manual_seed(0)
    n, length = 8, 7
    old = -torch.rand(n, length, generator=gen, dtype=torch.float64) * 4
    logp = (old + 0.3 * torch.randn(n, length, generator=gen, dtype=torch.float64)).requires_grad_()
    mask = (torch.rand(n, length, generator=gen) > 0.3).long()
    mask[:, 0] = 1
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    opts = LossOptions(algorithm=algorithm, agg=agg, kl_coef=0.0)
    norm = dict(num_tokens=mask.sum().item(), num_seqs=n, max_len=length)
    full, _ = policy_loss(logp, old, adv, mask, opts, **norm)
    full.backward()
    g_full = logp.grad.clone()
    logp.grad = None
    total = 0.0
    for rows in torch.arange(n).split(3):
        part, _ = policy_loss(logp[rows], old[rows], adv[rows], mask[rows], opts, **norm)
        part.backward()
        total += part.item()
    assert total == pytest.approx(full.item(), abs=1e-12)
    torch.testing.assert_close(logp.grad, g_full, rtol=0, atol=1e-12)


def test_k3_gradient_is_finite_far_from_the_reference():
    # ref - logp = 100 overflows exp in float32 (> 88.7); the log-ratio is clamped to [-20, 20] first,
    # so the value is the clamp's 10 and the gradient is 0 (both clamps saturated), not NaN.
    logp = torch.tensor([-101.0, -1.0, -1.0, -30.0], requires_grad=True)
    ref = torch.tensor([-1.0, -1.5, -0.5, -1.0])
    k3 = kl_penalty(logp, ref, "k3")
    k3.sum().backward()
    assert bool(torch.isfinite(logp.grad).all()) and logp.grad[0].item() == 0.0
    assert k3[0].item() == 10.0 and k3[3].item() == 10.0  # d = 100 and d = 29: beyond the clamp
    # In the normal range the values and gradients are the unclamped estimator's: d = -0.5, 0.5,
    # dk3/dlogp = -(e^d - 1); float32, so rel 1e-6.
    for i, d in ((1, -0.5), (2, 0.5)):
        assert k3[i].item() == pytest.approx(math.exp(d) - d - 1, rel=1e-6)
        assert logp.grad[i].item() == pytest.approx(-(math.exp(d) - 1), rel=1e-6)


def test_kl_estimators_and_term():
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    d = ref - logp  # [-0.5, 1.0]
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), -d)
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), 0.5 * d**2)
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.exp(d) - d - 1)
    lp = logp.clone().requires_grad_()
    loss, m = policy_loss(
        lp,
        logp,
        torch.zeros(1),
        torch.ones(1, 2),
        LossOptions(algorithm="grpo", agg="token-mean", kl_coef=0.1),
        ref_logprobs=ref,
    )
    assert loss.item() == pytest.approx(0.1 * (torch.exp(d) - d - 1).mean().item())
    assert m["kl_ref"].item() == pytest.approx((torch.exp(d) - d - 1).mean().item())
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, logp, torch.zeros(1), torch.ones(1, 2), LossOptions(kl_coef=0.1))


def test_entropy_bonus_and_metric():
    logp, old = _inputs()
    ent = torch.full((2, 3), 2.0, dtype=torch.float64)
    base, _ = policy_loss(logp, old, ADV, MASK, LossOptions(algorithm="grpo", agg="token-mean"))
    loss, m = policy_loss(
        logp, old, ADV, MASK, LossOptions(algorithm="grpo", agg="token-mean", entropy_coef=0.01), entropy=ent
    )
    assert loss.item() == pytest.approx(base.item() - 0.01 * 2.0)
    assert m["entropy"].item() == pytest.approx(2.0)


def test_band_keeps_tail_gradient_that_clipping_kills():
    # A low-probability token (p = 0.02) pushed to ratio 2 with A > 0: clip_higher clips it,
    # BandPO's band (upper ~ 3.4 at p = 0.02, KL delta 0.05) keeps its gradient.
    old = torch.tensor([[math.log(0.02)]], dtype=torch.float64)
    for algorithm, zero in (("clip_higher", True), ("bandpo", False)):
        logp = (old + math.log(2.0)).requires_grad_()
        loss, m = policy_loss(logp, old, torch.ones(1), torch.ones(1, 1), LossOptions(algorithm=algorithm))
        loss.backward()
        assert (logp.grad.item() == 0) == zero, algorithm
        assert m["clip_frac_bin/0.01-0.1"].item() == (1.0 if zero else 0.0)


def test_bad_names_list_valid_choices():
    logp, old = _inputs()
    with pytest.raises(ValueError, match="grpo, clip_higher, bandpo"):
        policy_loss(logp, old, ADV, MASK, LossOptions(algorithm="ppo2"))
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(logp, MASK, "mean")
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(logp, old, "k4")
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logp, old, ADV, MASK, LossOptions(dual_clip=0.5))
