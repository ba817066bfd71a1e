"""DCPO's dynamic adaptive clipping: hand-computed bounds, the paper's constraint solved numerically,
edge inputs, and the loss against a slow per-token reference.

Recipe thresholds throughout unless stated: eps_low 0.16 (4 eps_low = 0.64), eps_high 0.20 (4 eps_high
= 0.8). Inputs are float64, so closed forms agree to rounding (rel 1e-12).
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from bandpo.algo import LossOptions, dac_bounds, policy_loss, ratio_interval
from bandpo.config import compose, loss_options
from bandpo.errors import ConfigError

EPS_LOW, EPS_HIGH = 0.16, 0.20


def _log(values) -> torch.Tensor:
    return torch.log(torch.tensor(values, dtype=torch.float64))


@pytest.mark.parametrize(
    "q, lower, upper",
    [
        # q = 1:    1 - 0.64/1 = 0.36 -> lower = 0.5 + 0.5 * 0.6 = 0.8
        #           upper = 0.5 + 0.5 sqrt(1 + 0.8/1) = 0.5 + 0.5 * 1.34164079 = 1.17082039
        (1.0, 0.8, 0.5 + 0.5 * math.sqrt(1.8)),
        # q = 0.8:  1 - 0.64/0.8 = 0.2 -> lower = 0.5 + 0.5 sqrt(0.2) = 0.72360680
        #           upper = 0.5 + 0.5 sqrt(1 + 0.8/0.8) = 0.5 + 0.5 sqrt(2) = 1.20710678
        (0.8, 0.5 + 0.5 * math.sqrt(0.2), 0.5 + 0.5 * math.sqrt(2.0)),
        # q = 0.64: 1 - 0.64/0.64 = 0 -> lower = 0.5 (the kink)
        #           upper = 0.5 + 0.5 sqrt(1 + 0.8/0.64) = 0.5 + 0.5 sqrt(2.25) = 0.5 + 0.75 = 1.25
        (0.64, 0.5, 1.25),
        # q = 0.5:  1 - 0.64/0.5 = 1 - 1.28 = -0.28, floored at 0 -> lower = 0.5
        #           upper = 0.5 + 0.5 sqrt(1 + 0.8/0.5) = 0.5 + 0.5 sqrt(2.6) = 1.30622577
        (0.5, 0.5, 0.5 + 0.5 * math.sqrt(2.6)),
        # q = 0.01: 1 - 64 < 0 -> lower = 0.5; upper = 0.5 + 0.5 sqrt(1 + 80) = 0.5 + 4.5 = 5: the new probability
        #           may reach 0.05 and fall to 0.005, the paper's own table (q(x) = 0.01, eps 0.16 / 0.2).
        (0.01, 0.5, 5.0),
    ],
)
def test_hand_computed_bounds(q, lower, upper):
    lo, hi = dac_bounds(_log([q]), EPS_LOW, EPS_HIGH)
    assert lo.item() == pytest.approx(lower, rel=1e-12) and hi.item() == pytest.approx(upper, rel=1e-12)


def test_cap_clamps_only_the_upper_bound():
    # q = 0.001: upper = 0.5 + 0.5 sqrt(1 + 800) = 14.6509717 > 10 -> 10; q = 0.01 (upper 5) is below the cap.
    # The cap binds where sqrt(1 + 0.8/q) > 19, i.e. q < 0.8 / 360 = 1/450.
    x = _log([0.001, 1 / 450 * 0.999, 1 / 450 * 1.001, 0.01])
    lo, hi = dac_bounds(x, EPS_LOW, EPS_HIGH, upper_cap=10.0)
    _, bare = dac_bounds(x, EPS_LOW, EPS_HIGH)
    assert bare[0].item() == pytest.approx(0.5 + 0.5 * math.sqrt(801.0), rel=1e-12)
    assert (
        hi.tolist()[:2] == [10.0, 10.0] and 9.9 < hi[2].item() < 10.0 and hi[3].item() == pytest.approx(5.0)
    )
    torch.testing.assert_close(lo, torch.full((4,), 0.5, dtype=torch.float64), rtol=0, atol=0)


def test_floor_for_small_q():
    # For q <= 4 eps_low the roots of r^2 - r + eps_low/q are not real: max(1 - 4 eps_low/q, 0) = 0 and lower = 0.5
    # exactly, however small q is (the constraint alone, (1 - r) r q <= q/4 <= eps_low, would allow r -> 0).
    q = torch.tensor([0.64, 0.3, 1e-3, 1e-30, 1e-300], dtype=torch.float64)
    lo, _ = dac_bounds(torch.log(q), EPS_LOW, EPS_HIGH)
    assert lo.tolist() == [0.5] * 5
    r = torch.linspace(0.0, 1.0, 101, dtype=torch.float64)[:, None]
    assert bool(((1 - r) * r * q <= EPS_LOW + 1e-15).all())
    # Just above the kink the floor no longer applies: q = 0.65, lower = 0.5 + 0.5 sqrt(1 - 0.64/0.65).
    lo, _ = dac_bounds(_log([0.65]), EPS_LOW, EPS_HIGH)
    assert lo.item() == pytest.approx(0.5 + 0.5 * math.sqrt(1 - 0.64 / 0.65), rel=1e-12) and lo.item() > 0.5


def _bisect(f, lo: float, hi: float, steps: int = 200) -> float:
    """The root of an increasing ``f`` on [lo, hi] (f(lo) <= 0 <= f(hi))."""
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return 0.5 * (lo + hi)


def test_bounds_solve_the_papers_constraint():
    """|r - 1| r q = eps at the bounds (DCPO's constraint |(p/q - 1) p| <= eps with p = r q), found here by
    bisection of the constraint itself, not from the closed form: upper on [1, inf) where (r - 1) r q grows,
    lower on [1/2, 1] where (1 - r) r q shrinks as r rises, for q above the kink 4 eps_low."""
    qs = [0.65, 0.7, 0.8, 0.9, 0.99, 1.0, 0.3, 0.05, 1e-3, 1e-6]
    lo, hi = dac_bounds(_log(qs), EPS_LOW, EPS_HIGH)
    for q, lower, upper in zip(qs, lo.tolist(), hi.tolist()):
        assert upper == pytest.approx(_bisect(lambda r: (r - 1) * r * q - EPS_HIGH, 1.0, 1e4), rel=1e-12)
        assert (upper - 1) * upper * q == pytest.approx(EPS_HIGH, rel=1e-9)
        if q > 4 * EPS_LOW:
            assert lower == pytest.approx(_bisect(lambda r: EPS_LOW - (1 - r) * r * q, 0.5, 1.0), rel=1e-12)
            assert (1 - lower) * lower * q == pytest.approx(EPS_LOW, rel=1e-9)
        # Strictly inside the bounds the constraint holds; just outside it fails (unless floored).
        for r in (lower + 1e-6, 1.0, upper - 1e-6):
            assert abs(r - 1) * r * q <= max(EPS_LOW, EPS_HIGH)
        assert (upper + 1e-6 - 1) * (upper + 1e-6) * q > EPS_HIGH


def _slow_bounds(q: float, eps_low: float, eps_high: float, cap: float | None) -> tuple[float, float]:
    """The paper's closed form, one token at a time. The terms under the roots are exact rationals of the
    floats q and 4 eps, rounded once: near the kink q = 4 eps_low a float 1 - 4 eps_low / q is off by ~1e-16,
    which the square root turns into ~1e-8."""
    if q == 0.0:
        return 0.5, math.inf if cap is None else cap
    lower = 0.5 + 0.5 * math.sqrt(float(max(1 - Fraction(4.0 * eps_low) / Fraction(q), Fraction(0))))
    upper = 0.5 + 0.5 * math.sqrt(float(1 + Fraction(4.0 * eps_high) / Fraction(q)))
    return lower, upper if cap is None else min(upper, cap)


@pytest.mark.parametrize("eps_low, eps_high, cap", [(0.16, 0.20, 10.0), (0.16, 0.20, None), (0.05, 0.5, 3.0)])
def test_vectorised_bounds_match_the_slow_reference(eps_low, eps_high, cap):
    gen = torch.Generator().manual_seed(0)
    x = -torch.rand(1995, generator=gen, dtype=torch.float64) * 12  # [1995] log q over q in [6e-6, 1]
    # Points around the kink q = 4 eps_low, where the rewritten (q - 4 eps_low) / q matters most.
    x = torch.cat([x, torch.log(4 * eps_low * (1 + torch.linspace(-1e-6, 1e-6, 21, dtype=torch.float64)))])
    lo, hi = dac_bounds(x.view(-1, 7), eps_low, eps_high, upper_cap=cap)  # any shape: [N, 7]
    assert lo.shape == hi.shape == (len(x) // 7, 7)
    ref = [_slow_bounds(math.exp(v), eps_low, eps_high, cap) for v in x.tolist()]
    ref_lo, ref_hi = (torch.tensor([r[k] for r in ref], dtype=torch.float64) for k in (0, 1))
    torch.testing.assert_close(lo.flatten(), ref_lo, rtol=1e-12, atol=0)
    torch.testing.assert_close(hi.flatten(), ref_hi, rtol=1e-12, atol=0)


def test_edge_inputs():
    # q = 0, 1, 1 (rounding noise), NaN
    x = torch.tensor([-math.inf, 0.0, 1e-7, math.nan], dtype=torch.float64)
    lo, hi = dac_bounds(x, EPS_LOW, EPS_HIGH, upper_cap=10.0)
    assert lo[:3].tolist() == [0.5, 0.8, 0.8] and hi[0].item() == 10.0
    assert hi[1].item() == hi[2].item() == pytest.approx(0.5 + 0.5 * math.sqrt(1.8), rel=1e-15)
    assert math.isnan(lo[3].item()) and math.isnan(hi[3].item())
    _, bare = dac_bounds(x[:1], EPS_LOW, EPS_HIGH)
    assert bare.item() == math.inf
    # float32 in, float32 out: the float64 computation on the same (float32) input, rounded once.
    x32 = torch.log(torch.tensor([0.64, 0.6400001, 0.7, 0.01], dtype=torch.float32))
    lo32, hi32 = dac_bounds(x32, EPS_LOW, EPS_HIGH)
    lo64, hi64 = dac_bounds(x32.double(), EPS_LOW, EPS_HIGH)
    assert lo32.dtype == torch.float32 and torch.equal(lo32, lo64.float()) and torch.equal(hi32, hi64.float())
    lp = torch.tensor([-1.0], requires_grad=True)
    assert not dac_bounds(lp, EPS_LOW, EPS_HIGH)[0].requires_grad  # no gradient through the bounds
    for bad in (dict(eps_low=0.0), dict(eps_high=math.inf), dict(upper_cap=1.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            dac_bounds(x, **{"eps_low": EPS_LOW, "eps_high": EPS_HIGH, **bad})
    with pytest.raises(TypeError):
        dac_bounds(torch.zeros(2, dtype=torch.long), EPS_LOW, EPS_HIGH)


# A tiny batch: row 0 has A = +1, row 1 has A = -1; row 1's last position is padding.
#   old q   ratio r   bounds [lower, upper] (hand-computed above and here)      L = max(-A r, -A clip(r))
#   0.02    3.0       [0.5, 0.5 + 0.5 sqrt(41) = 3.70156]   inside              -3.0         grad -A r / 5 = -0.6
#   0.02    4.0       [0.5, 3.70156]                        above, A > 0: cut   -3.70156     grad 0
#   0.4     1.3       [0.5, 0.5 + 0.5 sqrt(3) = 1.36603]    inside              -1.3         grad -0.26
#   0.4     0.6       [0.5, 1.36603]                        inside              0.6          grad +0.12
#   1.0     0.7       [0.8, 1.17082]                        below, A < 0: cut   0.8          grad 0
# token-mean over the 5 valid tokens. GRPO's [0.8, 1.2] would cut all five.
OLD_Q = [[0.02, 0.02, 0.4], [0.4, 1.0, 1.0]]
RATIO = [[3.0, 4.0, 1.3], [0.6, 0.7, 1.0]]
ADV = torch.tensor([1.0, -1.0], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def _batch():
    old = _log(OLD_Q)
    return (old + _log(RATIO)).requires_grad_(), old


def test_tiny_batch_loss_gradient_and_clip_fractions():
    logp, old = _batch()
    loss, m = policy_loss(
        logp, old, ADV, MASK, LossOptions(algorithm="dcpo", agg="token-mean", dual_clip=None)
    )
    loss.backward()
    upper_tail = 0.5 + 0.5 * math.sqrt(41.0)
    assert loss.item() == pytest.approx((-3.0 - upper_tail - 1.3 + 0.6 + 0.8) / 5, rel=1e-12)
    expected = torch.tensor([[-0.6, 0.0, -0.26], [0.12, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected, rtol=1e-12, atol=0)
    assert m["clip_frac_up"].item() == pytest.approx(1 / 5) and m["clip_frac_down"].item() == pytest.approx(
        1 / 5
    )
    # By old-probability bin: 0.01-0.1 holds the two q = 0.02 tokens (one cut), 0.1-0.5 the two q = 0.4 (none),
    # ge0.5 the q = 1 token (cut); no token below 0.01.
    bins = {k.split("/", 1)[1]: v.item() for k, v in m.items() if k.startswith("clip_frac_bin/")}
    assert bins == {"lt0.01": 0.0, "0.01-0.1": 0.5, "0.1-0.5": 0.0, "ge0.5": 1.0}
    assert m["token_frac_bin/0.01-0.1"].item() == pytest.approx(2 / 5)
    # The bounds are reported under dcpo/, not band/: mean lower (0.5, 0.5, 0.5, 0.5, 0.8) = 0.56.
    assert m["dcpo/lower_mean"].item() == pytest.approx(2.8 / 5) and "band/lower_mean" not in m
    assert "dcpo/log_upper_mean" in m
    # GRPO on the same batch cuts every token, so every gradient is 0.
    logp.grad = None
    loss, m = policy_loss(
        logp, old, ADV, MASK, LossOptions(algorithm="grpo", agg="token-mean", dual_clip=None)
    )
    loss.backward()
    assert (logp.grad == 0).all() and m["clip_frac_up"].item() + m["clip_frac_down"].item() == pytest.approx(
        1.0
    )


def test_dual_clip_and_cap_with_negative_and_positive_advantages():
    # q = 0.05, r = 12 (p = 0.6): upper = 0.5 + 0.5 sqrt(17) = 2.56155. With A = -1 the max keeps -A r = 12 and the
    # dual clip caps it at -A c = 10 (gradient 0). With A = +1 the clip gives -A upper = -2.56155 (gradient 0).
    # q = 1e-3, r = 11 (p = 0.011): upper 14.65 capped at 10, A = +1: -10 (cut by the cap, not the formula).
    old = _log([[0.05], [0.05], [1e-3]])
    logp = (old + _log([[12.0], [12.0], [11.0]])).requires_grad_()
    adv = torch.tensor([-1.0, 1.0, 1.0], dtype=torch.float64)
    opts = LossOptions(algorithm="dcpo", agg="token-mean", dual_clip=10.0, upper_cap=10.0)
    loss, m = policy_loss(logp, old, adv, torch.ones(3, 1), opts)
    loss.backward()
    assert loss.item() == pytest.approx((10.0 - (0.5 + 0.5 * math.sqrt(17.0)) - 10.0) / 3, rel=1e-12)
    assert (logp.grad == 0).all()
    assert m["clip_frac_dual"].item() == pytest.approx(1 / 3) and m["clip_frac_up"].item() == pytest.approx(
        2 / 3
    )


def _slow_loss(logp, old, adv, mask, eps_low, eps_high, cap, c):
    """Per-token loop in Python floats: the clipped surrogate with DAC bounds and the dual clip, aggregated
    seq-mean-token-mean; returns (loss, d loss / d logp)."""
    n, length = len(logp), len(logp[0])
    total, grad = 0.0, [[0.0] * length for _ in range(n)]
    for i in range(n):
        count = sum(mask[i])
        for t in range(length):
            if not mask[i][t]:
                continue
            a, r = adv[i], math.exp(max(-20.0, min(20.0, logp[i][t] - old[i][t])))
            lower, upper = _slow_bounds(math.exp(old[i][t]), eps_low, eps_high, cap)
            unclipped, clipped = -a * r, -a * min(max(r, lower), upper)
            value, slope = (unclipped, -a * r) if unclipped >= clipped else (clipped, 0.0)
            if a < 0 and value > -a * c:
                value, slope = -a * c, 0.0
            total += value / count / n
            grad[i][t] = slope / count / n
    return total, grad


def test_loss_matches_the_slow_reference():
    """The recipe (loss_options of algorithm=dcpo: eps 0.16 / 0.20, cap 10, dual clip 10, seq-mean-token-mean) on a
    random batch with tokens in every bin, ratios past both bounds, past the cap and past the dual clip."""
    gen = torch.Generator().manual_seed(1)
    n, length = 6, 9
    old = -torch.rand(n, length, generator=gen, dtype=torch.float64) * 9  # [N, R] log q, q in [1e-4, 1]
    log_ratio = torch.randn(n, length, generator=gen, dtype=torch.float64)  # [N, R]
    log_ratio[:, 0] = 2.6  # r = 13.5: past the cap and, with A < 0, past the dual clip
    logp = (old + log_ratio).requires_grad_()
    mask = (torch.rand(n, length, generator=gen) > 0.2).long()
    mask[:, 0] = 1
    adv = torch.tensor([1.0, -1.0, 0.5, -0.7, 2.0, -2.0], dtype=torch.float64)
    opts = loss_options(compose(["algorithm=dcpo", "algorithm.kl_coef=0"]))
    assert (opts.eps_low, opts.eps_high, opts.upper_cap, opts.dual_clip, opts.agg) == (
        0.16,
        0.20,
        10.0,
        10.0,
        "seq-mean-token-mean",
    )
    loss, _ = policy_loss(logp, old, adv, mask, opts)
    loss.backward()
    ref_loss, ref_grad = _slow_loss(
        logp.tolist(),
        old.tolist(),
        adv.tolist(),
        mask.tolist(),
        eps_low=0.16,
        eps_high=0.20,
        cap=10.0,
        c=10.0,
    )
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12)
    torch.testing.assert_close(logp.grad, torch.tensor(ref_grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)


def test_ratio_interval_and_options():
    lo, hi = ratio_interval(_log([0.8]), "dcpo")  # the algorithm's own thresholds, 0.16 / 0.20
    assert lo.item() == pytest.approx(0.5 + 0.5 * math.sqrt(0.2)) and hi.item() == pytest.approx(
        0.5 + 0.5 * math.sqrt(2)
    )
    with pytest.raises(ValueError, match="bandpo only"):
        ratio_interval(_log([0.8]), "dcpo", delta_t=torch.tensor([0.05]), delta_range=(0.01, 0.1))
    for kw, message in [
        (
            dict(algorithm="grpo", upper_cap=10.0),
            "upper_cap does not apply to algorithm=grpo .it applies to bandpo",
        ),
        (
            dict(algorithm="dcpo", relax_high_p=True),
            "relax_high_p does not apply to algorithm=dcpo .it applies to bandpo only",
        ),
        (dict(algorithm="dcpo", band_adaptive="entropy"), "applies to bandpo only"),
        (dict(algorithm="dcpo2"), r"algorithm must be one of grpo, .*, dcpo"),
    ]:
        with pytest.raises(ValueError, match=message):
            LossOptions(**kw)


def test_config_recipe_and_refusals():
    cfg = compose(["algorithm=dcpo"]).algorithm
    assert (cfg.eps_low, cfg.eps_high, cfg.upper_cap, cfg.dual_clip, cfg.loss_agg) == (
        0.16,
        0.20,
        10.0,
        10.0,
        "seq-mean-token-mean",
    )
    assert cfg.band is None and compose(["algorithm=grpo"]).algorithm.upper_cap is None
    assert loss_options(compose(["algorithm=dcpo", "algorithm.upper_cap=null"])).upper_cap is None
    for overrides, message in [
        (
            ["algorithm=grpo", "algorithm.upper_cap=10"],
            r"algorithm\.upper_cap does not apply to algorithm=grpo",
        ),
        (["algorithm=bandpo", "algorithm.upper_cap=10"], r"bandpo's is algorithm\.band\.upper_cap"),
        (["algorithm=dcpo", "algorithm.upper_cap=1"], r"algorithm\.upper_cap must be > 1"),
        (["algorithm=dcpo", "algorithm.band.delta=0.1"], r"algorithm\.band"),
        (["algorithm=dcpoo"], r"algorithm"),
    ]:
        with pytest.raises(ConfigError, match=message):
            compose(overrides)
