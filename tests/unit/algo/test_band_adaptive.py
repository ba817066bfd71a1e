"""Entropy-adaptive Band: the radius formula, its bounds, and the per-token KL table family
against the exact float64 bisection reference."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from bandpo.algo import LossOptions, adaptive_delta, band_bounds, band_bounds_per_token, policy_loss
from bandpo.algo.band import kl_roots_logit

# One family range for every KL test here (the family is built once per range and cached).
RANGE = (0.005, 0.5)


def test_radius_hand_computed():
    ent = torch.tensor([0.0, 0.3, 0.6, 1e9], dtype=torch.float64)
    # batch norm, scale = mean entropy 0.3: h = H / (H + 0.3) = 0, 1/2, 2/3, ~1.
    got = adaptive_delta(ent, delta_min=0.0125, delta_max=0.2, scale=0.3, norm="batch")
    want = [0.0125, math.sqrt(0.0125 * 0.2), 0.0125 ** (1 / 3) * 0.2 ** (2 / 3), 0.2]
    assert got.tolist() == pytest.approx(want, rel=1e-9)
    assert got[1].item() == pytest.approx(0.05, rel=1e-12)  # mean entropy -> delta when dmin dmax = delta^2
    # logv norm, scale = log V = 2: h = H / 2 clamped to 1 -> 0, 0.15, 0.3, 1.
    got = adaptive_delta(ent, delta_min=0.01, delta_max=0.1, scale=2.0, norm="logv")
    assert got.tolist() == pytest.approx([0.01, 0.01 * 10**0.15, 0.01 * 10**0.3, 0.1], rel=1e-12)


@pytest.mark.parametrize("norm", ["batch", "logv"])
def test_radius_bounded_and_monotone_in_entropy(norm):
    ent = torch.sort(torch.rand(5000, generator=torch.Generator().manual_seed(0)) * 15.0).values
    d = adaptive_delta(ent, delta_min=0.01, delta_max=0.3, scale=1.5, norm=norm)
    assert bool((d >= 0.01 * (1 - 1e-12)).all() and (d <= 0.3 * (1 + 1e-12)).all())
    assert bool((d.diff() >= 0).all())
    # The radius carries no gradient.
    ent_g = ent.clone().requires_grad_()
    assert not adaptive_delta(ent_g, delta_min=0.01, delta_max=0.3, scale=1.5, norm=norm).requires_grad


def test_off_or_degenerate_gives_fixed_delta():
    x = torch.log(torch.rand(64, 50, generator=torch.Generator().manual_seed(1)).clamp(min=1e-6)).double()
    ent = torch.rand_like(x) * 3
    d = adaptive_delta(ent, delta_min=0.05, delta_max=0.05, scale=1.0)
    assert torch.allclose(d, torch.full_like(d, 0.05), rtol=1e-15, atol=0)
    for div in ("tv", "chi2"):  # the same closed form with a tensor delta: exact
        for a, b in zip(band_bounds_per_token(x, div, d, (0.05, 0.05)), band_bounds(x, div, 0.05)):
            torch.testing.assert_close(a, b, rtol=1e-14, atol=0)
    # KL: the family at a single node is a one-node table (Lagrange weight 1 at sigma = 0).
    for a, b in zip(band_bounds_per_token(x, "kl", d, (0.05, 0.05)), band_bounds(x, "kl", 0.05)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=0)
    # band_adaptive="none" ignores old_entropy: the loss is the fixed-delta loss, bit for bit.
    logp = (x + 0.1).clamp(max=0).requires_grad_()
    adv, mask = torch.randn(64, dtype=torch.float64), torch.ones_like(x)
    base, _ = policy_loss(logp, x, adv, mask, LossOptions(algorithm="bandpo", delta=0.05))
    off, m = policy_loss(
        logp, x, adv, mask, LossOptions(algorithm="bandpo", delta=0.05, band_adaptive="none"), old_entropy=ent
    )
    assert off.item() == base.item() and "band/delta_mean" not in m


def _reference_kl(x: torch.Tensor, delta: torch.Tensor):
    """Exact per-token (lower, upper) from the float64 bisection of KL(Bern(p) || Bern(q)) = delta."""
    t = x - torch.log(-torch.expm1(x))  # logit p
    log_q_hi, log_q_lo = kl_roots_logit(t, delta, steps=80)  # bracket 1e3 / 2^80: below float64's ulp of v
    return torch.exp(log_q_lo - x), torch.exp(log_q_hi - x)


def test_kl_family_matches_reference():
    # Random (p, delta) pairs over the whole logit range and the family's delta range, plus the
    # grid nodes' midpoints where cubic interpolation in log delta is worst. The tolerances are
    # 3x the measured maxima (upper 1.7e-6, lower 1.5e-5): the cubic Lagrange error in log delta
    # is (hs^4 / 24) |d^4 B / ds^4| with hs = log(2)/4, and a B error reaches lower multiplied
    # by log(1/lower) <= 20 where lower > 2e-9; below e^-20 the clamped ratio never reaches it.
    gen = torch.Generator().manual_seed(2)
    n = 20000
    t = torch.rand(n, generator=gen, dtype=torch.float64) * 84 - 42
    log_d = math.log(RANGE[0]) + torch.rand(n, generator=gen, dtype=torch.float64) * math.log(
        RANGE[1] / RANGE[0]
    )
    x, d = torch.nn.functional.logsigmoid(t), log_d.exp()
    lo, hi = band_bounds_per_token(x, "kl", d, RANGE)
    lo_ref, hi_ref = _reference_kl(x, d)
    assert ((hi - hi_ref).abs() / hi_ref).max().item() < 5e-6
    big = lo_ref > 2e-9
    assert ((lo - lo_ref).abs() / lo_ref)[big].max().item() < 5e-5
    assert (lo - lo_ref).abs()[~big].max().item() < 2e-9 * 5e-5 * 20
    # float32 on the same (rounded) inputs: t = logit(p) and its cell position carry float32
    # rounding, ~4e-6 each in t for |t| <= 40 (eps32 * 40, half an ulp of (t + 40) * 16); a t
    # error reaches a bound times |d log(bound) / dt| <= |log bound| <= 20 where lower > 2e-9
    # (-log lower ~ delta / p = delta e^-t): 20 * 8e-6 = 1.6e-4. Measured: 4e-5.
    x32, d32 = x.float(), d.float()
    for a, b in zip(
        band_bounds_per_token(x32, "kl", d32, RANGE),
        band_bounds_per_token(x32.double(), "kl", d32.double(), RANGE),
    ):
        ok = b > 2e-9
        assert ((a.double() - b).abs() / b)[ok].max().item() < 2e-4
        assert a.dtype == torch.float32


@pytest.mark.parametrize("div", ["kl", "tv", "chi2"])
def test_bounds_contain_one_and_widen_with_delta(div):
    gen = torch.Generator().manual_seed(3)
    x = -torch.rand(20000, generator=gen, dtype=torch.float64) * 25
    d = torch.exp(math.log(RANGE[0]) + torch.rand(20000, generator=gen, dtype=torch.float64) * math.log(100))
    lo, hi = band_bounds_per_token(x, div, d, RANGE)
    assert bool((lo <= 1).all() and (hi >= 1).all() and (lo >= 0).all())
    lo2, hi2 = band_bounds_per_token(x, div, d * 1.1, RANGE)  # clamped into RANGE where above it
    assert bool((hi2 >= hi * (1 - 1e-6)).all() and (lo2 <= lo * (1 + 1e-6) + 1e-300).all())


def test_edge_inputs_and_clamp():
    x = torch.tensor([-math.inf, 0.0, 1e-7, math.nan], dtype=torch.float64)
    d = torch.full_like(x, 0.05)
    lo, hi = band_bounds_per_token(x, "kl", d, RANGE)
    assert lo[0].item() == 0.0 and hi[0].item() == math.inf
    assert hi[1].item() == pytest.approx(1.0, abs=1e-12) and lo[1].item() == pytest.approx(
        math.exp(-0.05), rel=1e-8
    )
    assert hi[2].item() == pytest.approx(1.0, abs=1e-12)
    assert math.isnan(lo[3].item()) and math.isnan(hi[3].item())
    # A radius outside the family's range is clamped into it (delta_max lies between two nodes:
    # interpolation error, within the reference test's tolerance).
    big = band_bounds_per_token(x[1:2] - 2.0, "kl", torch.tensor([5.0], dtype=torch.float64), RANGE)
    at_max = band_bounds(x[1:2] - 2.0, "kl", RANGE[1])
    torch.testing.assert_close(big[1], at_max[1], rtol=5e-6, atol=0)


def test_policy_loss_adaptive_uses_per_token_radius():
    gen = torch.Generator().manual_seed(4)
    old = torch.log(torch.rand(4, 6, generator=gen, dtype=torch.float64).clamp(min=1e-3))
    ent = torch.rand(4, 6, generator=gen, dtype=torch.float64) * 2
    logp = (old + 0.5 * torch.randn(4, 6, generator=gen, dtype=torch.float64)).clamp(max=0).requires_grad_()
    adv, mask = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64), torch.ones(4, 6)
    opts = LossOptions(
        algorithm="bandpo",
        divergence="tv",
        band_adaptive="entropy",
        delta_min=0.01,
        delta_max=0.2,
        entropy_scale=1.0,
        dual_clip=None,
        agg="token-mean",
    )
    loss, m = policy_loss(logp, old, adv, mask, opts, old_entropy=ent)
    # Hand: TV band with delta_t per token, L = max(-A r, -A clip(r)).
    dt = 0.01 * (0.2 / 0.01) ** (ent / (ent + 1.0))
    p, r = old.exp(), (logp - old).exp()
    lo, hi = (1 - dt / p).clamp(min=0), torch.minimum(1 + dt / p, 1 / p)
    a = adv[:, None]
    want = torch.maximum(-a * r, -a * torch.minimum(torch.maximum(r, lo), hi)).mean()
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert m["band/delta_mean"].item() == pytest.approx(dt.mean().item(), rel=1e-12)
    with pytest.raises(ValueError, match="bandpo only"):
        policy_loss(logp, old, adv, mask, replace(opts, algorithm="grpo"), old_entropy=ent)
    with pytest.raises(ValueError, match="needs old_entropy"):
        policy_loss(logp, old, adv, mask, opts, old_entropy=None)
    with pytest.raises(ValueError, match="band_adaptive must be one of none, entropy"):
        policy_loss(logp, old, adv, mask, replace(opts, band_adaptive="entropic"), old_entropy=ent)
