"""Clip-Cov, KL-Cov and no_clip (``bandpo.algo.cov``): the equations on hand-made inputs, the tie rules,
the refusals, and one optimizer step through each. Their equality with verl's code is
``test_cov_entropy_reference.py``."""

from __future__ import annotations

import pytest
import torch

from bandpo.algo.cov import (
    clip_cov_selection,
    clip_cov_tokens,
    kl_cov_selection,
    kl_cov_tokens,
    selection_count,
    token_covariance,
)
from bandpo.algo.losses import policy_loss
from bandpo.algo.options import LossOptions

F64 = torch.float64


def test_selection_count_is_the_floor_of_the_share_and_at_least_one():
    assert selection_count(2e-4, 100) == 1  # 0.02 tokens -> the floor of one
    assert selection_count(0.05, 199) == 9  # floor(9.95)
    assert selection_count(0.5, 10) == 5


def test_covariance_is_centred_over_valid_tokens_only():
    logp = torch.tensor([[-1.0, -3.0, -50.0]], dtype=F64)
    adv = torch.tensor([[1.0, -1.0, 7.0]], dtype=F64)
    maskf = torch.tensor([[1.0, 1.0, 0.0]], dtype=F64)
    # means over the two valid tokens: A 0, log p -2 -> cov = (1)(1), (-1)(-1)
    assert token_covariance(logp, adv, maskf)[0, :2].tolist() == [1.0, 1.0]


def test_kl_cov_ties_go_to_the_earlier_token_row_major():
    cov = torch.tensor([[1.0, 3.0, 3.0], [3.0, 2.0, 0.0]], dtype=F64)
    valid = torch.tensor([[True, True, True], [True, True, False]])
    assert torch.nonzero(kl_cov_selection(cov, valid, 2)).tolist() == [[0, 1], [0, 2]]
    assert torch.nonzero(kl_cov_selection(cov, valid, 3)).tolist() == [[0, 1], [0, 2], [1, 0]]
    # padding is never chosen, even with the largest value
    cov[1, 2] = 99.0
    assert not kl_cov_selection(cov, valid, 5)[1, 2]
    assert not kl_cov_selection(cov, torch.zeros_like(valid), 1).any()


def test_clip_cov_draws_the_first_k_of_a_randperm_over_row_major_candidates():
    candidates = torch.tensor([[True, False, True], [True, True, False]])
    idx = torch.nonzero(candidates)
    g = torch.Generator().manual_seed(5)
    perm = torch.randperm(4, generator=torch.Generator().manual_seed(5))
    expected = {tuple(idx[i].tolist()) for i in perm[:2].tolist()}
    chosen = clip_cov_selection(torch.zeros(2, 3), candidates, 2, generator=g)
    assert {tuple(t) for t in torch.nonzero(chosen).tolist()} == expected
    # fewer candidates than k: all of them
    assert torch.equal(clip_cov_selection(torch.zeros(2, 3), candidates, 10), candidates)
    # the global generator: the same seed, the same draw
    torch.manual_seed(3)
    a = clip_cov_selection(torch.zeros(2, 3), candidates, 1)
    torch.manual_seed(3)
    assert torch.equal(a, clip_cov_selection(torch.zeros(2, 3), candidates, 1))


def test_clip_cov_band_is_strict_and_skips_clipped_and_padding():
    # over the 4 valid tokens mean A = 0 and mean log p = -2: cov = 0 * 0, 1 * 1, 2 * 2, -3 * -3
    adv = torch.tensor([[0.0, 1.0, 2.0, -3.0, 9.0]], dtype=F64)
    logp = torch.tensor([[-2.0, -1.0, 0.0, -5.0, 9.0]], dtype=F64)
    maskf = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]], dtype=F64)
    cov = token_covariance(logp, adv, maskf)[0, :4]
    assert cov.tolist() == [0.0, 1.0, 4.0, 9.0]
    clipped = torch.zeros(1, 5, dtype=torch.bool)
    # band (1, 9): strict, so 1 and 9 are out and 4 is in; the padding never is
    chosen, candidates = clip_cov_tokens(logp, adv, maskf, clipped, 1.0, 1.0, 9.0)
    assert candidates[0].tolist() == [False, False, True, False, False]
    assert torch.equal(chosen, candidates)  # share 1: every candidate
    clipped[0, 2] = True  # already clipped by the interval: no gradient left to remove
    assert not clip_cov_tokens(logp, adv, maskf, clipped, 1.0, 1.0, 9.0)[1].any()


def _inputs(seed=0, n=4, r=16):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, r, generator=g, dtype=F64) * 4
    old = logp + 0.3 * torch.randn(n, r, generator=g, dtype=F64)
    adv = torch.randn(n, generator=g, dtype=F64)
    mask = torch.ones(n, r, dtype=F64)
    mask[1, 10:] = 0
    return logp, old, adv, mask


def test_no_clip_is_minus_a_r_with_nothing_cut():
    logp, old, adv, mask = _inputs()
    lp = logp.clone().requires_grad_(True)
    loss, m = policy_loss(
        lp, old, adv, mask, LossOptions(algorithm="no_clip", dual_clip=None, agg="token-mean")
    )
    r = torch.exp(logp - old)
    expected = ((-adv[:, None] * r) * mask).sum() / mask.sum()
    assert torch.allclose(loss, expected, rtol=1e-14, atol=0)  # the same sum, possibly reordered
    assert float(m["clip_frac_up"]) == 0 and float(m["clip_frac_down"]) == 0
    loss.backward()
    assert torch.allclose(lp.grad, (-adv[:, None] * r) * mask / mask.sum(), rtol=1e-14, atol=0)


def test_kl_cov_penalises_exactly_its_selected_tokens():
    logp, old, adv, mask = _inputs(1)
    lp = logp.clone().requires_grad_(True)
    opts = LossOptions(algorithm="kl_cov", dual_clip=None, agg="token-mean", cov_ratio=0.1, kl_cov_coef=0.5)
    loss, m = policy_loss(lp, old, adv, mask, opts)
    chosen = kl_cov_tokens(logp, adv.unsqueeze(-1).expand_as(logp), mask, 0.1)
    n = int(mask.sum())
    assert int(chosen.sum()) == int(0.1 * n) and float(m["cov/selected_frac"]) == int(0.1 * n) / n
    r = torch.exp(logp - old)
    per = -adv[:, None] * r + 0.5 * (logp - old).abs() * chosen
    assert torch.allclose(loss, (per * mask).sum() / mask.sum(), rtol=1e-14, atol=0)


def test_clip_cov_without_candidates_is_grpo_without_the_dual_clip():
    logp, old, adv, mask = _inputs(2)
    kw = dict(dual_clip=None, agg="token-mean")
    # an empty band: no candidate, so nothing beyond grpo's clip is cut
    cc, _ = policy_loss(
        logp, old, adv, mask, LossOptions(algorithm="clip_cov", clip_cov_lb=100.0, clip_cov_ub=101.0, **kw)
    )
    grpo, _ = policy_loss(logp, old, adv, mask, LossOptions(algorithm="grpo", **kw))
    assert float(cc) == float(grpo)


@pytest.mark.parametrize(
    "name, option, match",
    [
        (
            "grpo",
            {"cov_ratio": 0.1},
            "cov_ratio does not apply to algorithm=grpo .it applies to clip_cov and kl_cov only",
        ),
        (
            "kl_cov",
            {"clip_cov_lb": 0.5},
            "clip_cov_lb does not apply to algorithm=kl_cov .it applies to clip_cov only",
        ),
        ("kl_cov", {"eps_low": 0.2}, "kl_cov leaves the ratio unclipped"),
        ("no_clip", {"eps_high": 0.2}, "no_clip is the control that leaves the ratio unclipped"),
        ("clip_cov", {"cov_ratio": 0.0}, "cov_ratio must be > 0"),
        ("clip_cov", {"clip_cov_lb": 5.0}, "clip_cov_lb must be < clip_cov_ub, got 5.0 and 5.0"),
        ("kl_cov", {"kl_cov_coef": -1.0}, "kl_cov_coef must be >= 0"),
    ],
)
def test_options_that_do_not_apply_are_refused_with_the_reason(name, option, match):
    with pytest.raises(ValueError, match=match):
        LossOptions(algorithm=name, dual_clip=None, **option)


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov", "no_clip"])
def test_one_optimizer_step_through_each_method_with_the_entropy_options(name):
    # a tiny softmax policy over 5 tokens at 12 positions, 3 rows: loss, backward, step, all finite
    torch.manual_seed(0)
    logits = torch.nn.Parameter(torch.randn(3, 12, 5))
    tokens = torch.randint(0, 5, (3, 12))
    with torch.no_grad():
        old = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    adv = torch.tensor([1.0, -0.5, 0.25])
    mask = torch.ones(3, 12)
    opt = torch.optim.SGD([logits], lr=0.5)
    options = LossOptions(
        algorithm=name,
        dual_clip=None,
        cov_ratio=0.2 if name != "no_clip" else None,
        top_entropy_quantile=0.5,
        entropy_coef=0.01,
    )
    for _ in range(2):
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(-1, tokens[..., None])[..., 0]
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        loss, metrics = policy_loss(logp, old, adv, mask, options, entropy=entropy)
        opt.zero_grad()
        loss.backward()
        assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
        opt.step()
    assert 0 < float(metrics["top_entropy/kept_frac"]) <= 1
