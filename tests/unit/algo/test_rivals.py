"""The rivals' surrogates (DPPO-TV/-KL, GSPO, CISPO, SAPO): hand-computed losses and gradients.

Inputs are float64 and every expected number is a few exact operations on them, so values agree
to rounding (rel 1e-12) unless a test says otherwise.
"""

from __future__ import annotations

import math

import pytest
import torch

from bandpo.algo import LossOptions, policy_loss
from bandpo.config import compose, loss_options

# Two sequences, A = +1 and A = -1; row 1's last position is padding.
ADV = torch.tensor([1.0, -1.0], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def _probs(old, new):
    old = torch.log(torch.tensor(old, dtype=torch.float64))
    logp = torch.log(torch.tensor(new, dtype=torch.float64)).requires_grad_()
    return logp, old


def _run(logp, old, agg="token-mean", **kw):
    loss, m = policy_loss(logp, old, ADV, MASK, LossOptions(agg=agg, dual_clip=None, **kw))
    loss.backward()
    return loss.item(), logp.grad, m


# DPPO: old / new probabilities of each token. (0,0) rose by 0.2, (1,0) fell by 0.2: outside both
# regions. (0,2) is a rare token whose probability went 0.01 -> 0.1 (ratio 10, which GRPO clips):
# TV 0.09 <= 0.15 keeps it; its binary KL 0.01 ln 0.1 + 0.99 ln(0.99/0.9) = 0.0713 > 0.05 masks it.
DPPO_OLD = [[0.5, 0.5, 0.01], [0.5, 0.5, 0.5]]
DPPO_NEW = [[0.7, 0.6, 0.1], [0.3, 0.45, 0.5]]


@pytest.mark.parametrize(
    "algorithm, kept, up, down",
    [
        # kept tokens: (row, col, ratio); L = -A r there, 0 where masked; token-mean over 5 tokens.
        ("dppo_tv", [(0, 1, 1.2), (0, 2, 10.0), (1, 1, 0.9)], 1, 1),
        # KL: (0,0) D = -0.5 ln(4 .7 .3) = 0.0872 > 0.05 masked; (0,1) D = -0.5 ln .96 = 0.0204 kept;
        # (1,0) D = 0.0872, fell with A < 0: masked; (1,1) D = -0.5 ln .99 = 0.0050 kept.
        ("dppo_kl", [(0, 1, 1.2), (1, 1, 0.9)], 2, 1),
    ],
)
def test_dppo_hand_computed(algorithm, kept, up, down):
    """Equal to verl's ``dppo_tv`` / ``dppo_kl`` (verl/trainer/ppo/core_algos.py) on these inputs:
    the same masks (checked against its source: A > 0 kept where p - p' <= eps_high, resp. binary
    KL <= eps_high or p <= p'; mirrored for A <= 0) and the same gradient -A min(r, C) M grad log pi,
    which the last assertion checks by differentiating verl's per-token form -A sg(w) M log pi."""
    logp, old = _probs(DPPO_OLD, DPPO_NEW)
    loss, grad, m = _run(logp, old, algorithm=algorithm)
    adv = {0: 1.0, 1: -1.0}
    assert loss == pytest.approx(sum(-adv[i] * r for i, _, r in kept) / 5, rel=1e-12)
    expected = torch.zeros(2, 3, dtype=torch.float64)
    for i, j, r in kept:
        expected[i, j] = -adv[i] * r / 5
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)
    assert m["clip_frac_up"].item() == pytest.approx(up / 5) and m["clip_frac_down"].item() == pytest.approx(
        down / 5
    )
    # verl's form: same gradient.
    lp2 = logp.detach().clone().requires_grad_()
    keep = (expected != 0).double()
    w = torch.exp(lp2.detach() - old)
    (-(ADV[:, None] * w * keep * lp2) * MASK).sum().div(5).backward()
    torch.testing.assert_close(lp2.grad, expected, rtol=1e-12, atol=1e-15)


def test_dppo_ratio_cap_truncates_the_weight():
    # C = 2: the rare token's weight 10 -> 2 (its gradient kept, scaled); others below C unchanged.
    logp, old = _probs(DPPO_OLD, DPPO_NEW)
    loss, grad, _ = _run(logp, old, algorithm="dppo_tv", ratio_cap=2.0)
    assert loss == pytest.approx((-1.2 - 2.0 + 0.9) / 5, rel=1e-12)
    assert grad[0, 2].item() == pytest.approx(-2.0 / 5, rel=1e-12)


def test_gspo_clips_whole_sequences_on_the_length_normalised_ratio():
    """GSPO-token with seq-mean-token-mean; equal to verl's ``gspo`` on these inputs
    (checked against its source: s = exp(mean log-ratio), token ratio sg(s) pi / sg(pi), the clipped
    max, seq-mean-token-mean)."""
    # Row 0 (A = +1) log-ratios 0.3, -0.1, 0.1: mean 0.1, s = e^0.1 = 1.10517 inside [0.8, 1.2] although
    # its first token alone (e^0.3 = 1.35) would be clipped. Row 1 (A = -1): 0.5, 0.3 -> s = e^0.4, above
    # 1 + eps with A < 0: the max keeps the unclipped -A s.
    old = torch.zeros(2, 3, dtype=torch.float64)
    logp = torch.tensor([[0.3, -0.1, 0.1], [0.5, 0.3, 7.0]], dtype=torch.float64).requires_grad_()
    loss, grad, m = _run(logp, old, agg="seq-mean-token-mean", algorithm="gspo", eps_low=0.2, eps_high=0.2)
    s0, s1 = math.exp(0.1), math.exp(0.4)
    assert loss == pytest.approx((-s0 + s1) / 2, rel=1e-12)
    # d/dlogp_t of the token ratio is s; per-sequence token mean (1/|y|), then / 2 sequences.
    expected = torch.tensor([[-s0 / 6] * 3, [s1 / 4, s1 / 4, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=0)
    # The padded 7.0 does not enter row 1's mean. A clipped sequence: row 0 at mean 0.3 -> s > 1.2.
    logp = torch.tensor([[0.4, 0.2, 0.3], [0.0, 0.0, 0.0]], dtype=torch.float64).requires_grad_()
    loss, grad, m = _run(logp, old, agg="seq-mean-token-mean", algorithm="gspo", eps_low=0.2, eps_high=0.2)
    assert loss == pytest.approx((-1.2 + 1.0) / 2, rel=1e-12)
    assert grad[0].abs().sum().item() == 0.0 and m["clip_frac_up"].item() == pytest.approx(3 / 5)


def test_cispo_clips_the_weight_and_keeps_every_gradient():
    """Equal to verl's ``cispo`` on these inputs in gradient (checked against its source: per-token
    -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi); the value here is -A w (module docstring)."""
    # ratios (new / old): row 0 (A = +1) 2.0, 0.5, 1.1; row 1 (A = -1) 0.1, 1.5.
    old = torch.zeros(2, 3, dtype=torch.float64)
    logp = torch.log(torch.tensor([[2.0, 0.5, 1.1], [0.1, 1.5, 1.0]], dtype=torch.float64)).requires_grad_()
    loss, grad, m = _run(logp, old, algorithm="cispo", eps_low=1.0, eps_high=0.28)
    w = torch.tensor([[1.28, 0.5, 1.1], [0.1, 1.28, 0.0]], dtype=torch.float64)  # no lower bound
    assert loss == pytest.approx((-1.28 - 0.5 - 1.1 + 0.1 + 1.28) / 5, rel=1e-12)
    torch.testing.assert_close(grad, -ADV[:, None] * w / 5, rtol=1e-12, atol=0)
    assert grad[0, 0] != 0  # GRPO would have cut this token (r = 2 > 1.2, A > 0)
    assert m["clip_frac_up"].item() == pytest.approx(2 / 5) and m["clip_frac_down"].item() == 0.0


def test_sapo_soft_gate():
    """f(r) = (4 / tau) sigmoid(tau (r - 1)), L = -A f, tau 1 (A > 0) / 1.05 (A <= 0); equal to verl's
    ``sapo`` gate on these inputs (checked against its source)."""
    old = torch.zeros(2, 3, dtype=torch.float64)
    ratios = [[1.0, 2.0, 0.5], [0.5, 1.0, 1.0]]
    logp = torch.log(torch.tensor(ratios, dtype=torch.float64)).requires_grad_()
    loss, grad, m = _run(logp, old, algorithm="sapo", eps_low=None, eps_high=None)

    def sig(x):
        return 1.0 / (1.0 + math.exp(-x))

    exp_loss, exp_grad = 0.0, torch.zeros(2, 3, dtype=torch.float64)
    for i, (a, tau) in enumerate(((1.0, 1.0), (-1.0, 1.05))):
        for j in range(3 - i):
            r = ratios[i][j]
            g = sig(tau * (r - 1.0))
            exp_loss += -a * 4.0 / tau * g / 5
            exp_grad[i, j] = -a * 4.0 * g * (1.0 - g) * r / 5  # df/dr = 4 g (1 - g); dr/dlogp = r
    assert loss == pytest.approx(exp_loss, rel=1e-12)
    torch.testing.assert_close(grad, exp_grad, rtol=1e-12, atol=0)
    # On-policy (r = 1) the gate's slope is 1: the plain policy gradient -A / T.
    assert grad[0, 0].item() == pytest.approx(-1.0 / 5, rel=1e-12)
    assert m["clip_frac_up"].item() == m["clip_frac_down"].item() == 0.0


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl", "gspo", "cispo", "sapo"])
def test_each_rival_is_one_override_away(name):
    o = loss_options(compose([f"algorithm={name}", "algorithm.kl_coef=0"]))
    assert o.algorithm == name and o.dual_clip is None
    logp, old = _probs(DPPO_OLD, DPPO_NEW)
    loss, m = policy_loss(logp, old, ADV, MASK, o)
    loss.backward()
    assert torch.isfinite(loss) and bool(torch.isfinite(logp.grad).all())


@pytest.mark.parametrize(
    "kw, message",
    [
        (
            dict(algorithm="dppo_tv"),
            "dual_clip does not apply to algorithm=dppo_tv .the dual clip is the clipped surrogate",
        ),
        (
            dict(algorithm="grpo", ratio_cap=2.0),
            "ratio_cap does not apply to algorithm=grpo .it applies to dppo_tv and dppo_kl only",
        ),
        (
            dict(algorithm="cispo", dual_clip=None, tau_pos=1.0),
            "tau_pos does not apply to algorithm=cispo .it applies to sapo only",
        ),
        (dict(algorithm="sapo", dual_clip=None, eps_low=0.2), "eps_low does not apply to algorithm=sapo"),
        (
            dict(algorithm="gspo", dual_clip=None, agg="token-mean"),
            "agg must be seq-mean-token-mean with algorithm=gspo",
        ),
        (dict(algorithm="dppo_kl", dual_clip=None, ratio_cap=0.0), "ratio_cap must be > 0"),
        (dict(algorithm="sapo", dual_clip=None, tau_neg=-1.0), "tau_neg must be > 0"),
        (
            dict(algorithm="dppo"),
            "algorithm must be one of grpo, clip_higher, bandpo, dppo_tv, dppo_kl, gspo, cispo, sapo",
        ),
    ],
)
def test_inapplicable_options_are_refused_by_name(kw, message):
    with pytest.raises(ValueError, match=message):
        LossOptions(**kw)


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl", "gspo", "cispo"])
def test_zero_advantage_tokens_are_not_counted_as_cut(name):
    # An all-equal group has A = 0: no gradient, and no share in the cut fractions (as for the clip),
    # although (0,0) and (1,0) moved past DPPO's regions and the ratio 10 token past CISPO's bound.
    logp, old = _probs(DPPO_OLD, DPPO_NEW)
    opts = LossOptions(algorithm=name, dual_clip=None)
    loss, m = policy_loss(logp, old, torch.zeros(2, dtype=torch.float64), MASK, opts)
    assert loss.item() == 0.0 and m["clip_frac_up"].item() == m["clip_frac_down"].item() == 0.0
