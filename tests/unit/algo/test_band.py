"""Band operator: exact reference values, the fast KL table vs its slow solver, properties, edges."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from bandpo.algo.band import (
    _T_MAX,
    _T_MIN,
    band_bounds,
    chi2_generator,
    kl_generator,
    kl_roots_logit,
    tv_generator,
)

REFERENCE = Path(__file__).resolve().parents[2] / "data" / "band_bounds.csv"  # mpmath, 60 digits
REL_TOL64 = {"tv": 1e-9, "chi2": 1e-9, "kl": 1e-7}
FLOAT32_NORMAL = (1.1754944e-38, 3.4028235e38)


def _rows():
    with open(REFERENCE) as fh:
        for row in csv.DictReader(fh):
            yield (
                row["divergence"].removeprefix("band"),
                float(row["delta"]),
                float(row["p"]),
                float(row["lower"]),
                float(row["upper"]),
            )


ROWS = list(_rows())


def _rel(got: float, ref: float) -> float:
    return abs(got - ref) if ref == 0 else abs(got - ref) / abs(ref)


@pytest.mark.parametrize("div,delta,p,lower,upper", ROWS)
def test_matches_reference_float64(div, delta, p, lower, upper):
    lo, hi = band_bounds(torch.tensor([math.log(p)], dtype=torch.float64), div, delta)
    assert _rel(lo.item(), lower) <= REL_TOL64[div], (lo.item(), lower)
    assert _rel(hi.item(), upper) <= REL_TOL64[div], (hi.item(), upper)


def test_float32_within_1e5_of_float64_on_same_input():
    # The fair float32 check: the same (float32-rounded) log p evaluated in float64.
    # Rounding log p itself moves e.g. chi2's lower at p = 0.01 by ~3e-5, a property of
    # the input, not of the solver.
    for div in ("kl", "tv", "chi2"):
        for delta in (0.01, 0.05, 0.1, 0.2):
            x32 = torch.log(
                torch.tensor([p for d, dl, p, *_ in ROWS if d == div and dl == delta], dtype=torch.float32)
            )
            x32 = torch.cat([x32, torch.linspace(-30, 0, 2001, dtype=torch.float32)])
            for got, ref in zip(band_bounds(x32, div, delta), band_bounds(x32.double(), div, delta)):
                ok = (ref >= FLOAT32_NORMAL[0]) & (ref <= FLOAT32_NORMAL[1])
                rel = ((got.double() - ref).abs() / ref)[ok]
                assert rel.max().item() <= 1e-5, (div, delta, rel.max().item())


def test_spec_examples():
    x = torch.log(torch.tensor([0.08, 0.5], dtype=torch.float64))
    lo, hi = band_bounds(x, "kl", 0.05)
    assert lo[0].item() == pytest.approx(0.26170, abs=1e-5) and hi[0].item() == pytest.approx(
        2.41055, abs=1e-5
    )
    assert lo[1].item() == pytest.approx(0.69152, abs=1e-5) and hi[1].item() == pytest.approx(
        1.30848, abs=1e-5
    )
    lo, hi = band_bounds(x[:1], "tv", 0.05)
    assert (lo.item(), hi.item()) == pytest.approx((0.375, 1.625), abs=1e-12)
    lo, hi = band_bounds(x[:1], "chi2", 0.05)
    assert (lo.item(), hi.item()) == pytest.approx((0.24171, 1.75829), abs=1e-5)


@pytest.mark.parametrize("delta", [0.01, 0.2])
def test_kl_table_matches_slow_solver_densely(delta):
    """The fast path (cubic table over logit p) against float64 bisection at 16k points."""
    gen = torch.Generator().manual_seed(0)
    t = torch.cat(
        [
            torch.rand(8000, generator=gen, dtype=torch.float64) * (_T_MAX - _T_MIN + 10) + _T_MIN - 5,
            torch.randn(8000, generator=gen, dtype=torch.float64) * 3,  # the bulk of real tokens
        ]
    )
    x = torch.nn.functional.logsigmoid(t)
    log_q_hi, log_q_lo = kl_roots_logit(t, delta)
    upper_ref, lower_ref = torch.exp(log_q_hi - x), torch.exp(log_q_lo - x)
    lower, upper = band_bounds(x, "kl", delta)
    assert ((upper - upper_ref).abs() / upper_ref).max().item() < 1e-9
    ok = lower_ref > 1e-300  # below that the reference itself underflows to 0
    assert ((lower - lower_ref).abs() / lower_ref)[ok].max().item() < 1e-9
    assert (lower[~ok] <= 1e-290).all()


@pytest.mark.parametrize("div,f", [("kl", kl_generator), ("tv", tv_generator), ("chi2", chi2_generator)])
def test_generic_solver_agrees_with_named(div, f):
    x = torch.log(torch.tensor([1e-6, 1e-4, 0.01, 0.08, 0.3, 0.5, 0.9, 0.999], dtype=torch.float64))
    for delta in (0.01, 0.05, 0.2):
        lo_g, hi_g = band_bounds(x, f, delta)
        lo, hi = band_bounds(x, div, delta)
        torch.testing.assert_close(hi_g, hi, rtol=1e-7, atol=0)
        torch.testing.assert_close(lo_g, lo, rtol=1e-7, atol=1e-12)


# Examples per run: the Hypothesis profile (tests/conftest.py). Each example checks a batch of
# probabilities against one pair of radii: the KL band's cost is a table per new delta (~0.2 s), the
# probabilities on it are nearly free, so a batch checks many more per second than one p would.
@given(
    log_p=st.lists(st.floats(min_value=-60.0, max_value=0.0), min_size=1, max_size=32),
    d1=st.floats(min_value=1e-4, max_value=2.0),
    d2=st.floats(min_value=1e-4, max_value=2.0),
    div=st.sampled_from(["kl", "tv", "chi2"]),
)
def test_properties(log_p, d1, d2, div):
    x = torch.tensor(log_p, dtype=torch.float64)  # [N]
    lo1, hi1 = band_bounds(x, div, min(d1, d2))
    lo2, hi2 = band_bounds(x, div, max(d1, d2))
    inv_p = torch.exp(-x)
    for lo, hi in ((lo1, hi1), (lo2, hi2)):
        assert (lo >= 0.0).all() and (lo <= 1.0).all() and (hi >= 1.0).all()
        assert (hi <= inv_p * (1 + 1e-12)).all()
    # monotone in delta
    assert (lo2 <= lo1 * (1 + 1e-12)).all() and (hi2 >= hi1 * (1 - 1e-12)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_edge_inputs(dtype):
    x = torch.tensor([float("-inf"), 0.0, 1e-7, float("nan")], dtype=dtype)
    delta = 0.05
    expected_p1 = {"kl": math.exp(-delta), "tv": 1 - delta, "chi2": 1.0}
    for div in ("kl", "tv", "chi2"):
        lo, hi = band_bounds(x, div, delta)
        assert lo.dtype == dtype and hi.dtype == dtype
        assert lo[0].item() == 0.0 and hi[0].item() == math.inf  # p = 0: never clipped
        for i in (1, 2):  # p = 1 (positive logprob is rounding noise for 0)
            assert hi[i].item() == pytest.approx(1.0, abs=1e-12)
            assert lo[i].item() == pytest.approx(expected_p1[div], rel=1e-6)
        assert math.isnan(lo[3].item()) and math.isnan(hi[3].item())


def test_shapes_dtype_and_no_grad():
    x = (torch.rand(2, 3, 5) * 0.99 + 0.005).log().requires_grad_()
    lo, hi = band_bounds(x, "kl", 0.05)
    assert lo.shape == hi.shape == x.shape and not lo.requires_grad and not hi.requires_grad
    empty = band_bounds(torch.empty(0, 7), "kl", 0.05)
    assert empty[0].shape == (0, 7)


def test_limits():
    delta = 0.05
    tiny = torch.tensor([math.log(1e-12)], dtype=torch.float64)
    assert band_bounds(tiny, "kl", delta)[1].item() * 1e-12 == pytest.approx(1 - math.exp(-delta), rel=1e-6)
    assert band_bounds(tiny, "kl", delta)[0].item() == 0.0
    assert band_bounds(tiny, "chi2", delta)[1].item() == pytest.approx(math.sqrt(delta / 1e-12), rel=1e-5)


def test_options():
    x = torch.log(torch.tensor([1e-4, 0.9], dtype=torch.float64))
    lo, hi = band_bounds(x, "kl", 0.05, upper_cap=10.0)
    assert hi[0].item() == 10.0 and hi[1].item() < 10.0
    lo, hi = band_bounds(x, "kl", 0.05, relax_high_p=(0.2, 0.28))
    # head: clip interval wins
    assert lo[1].item() == pytest.approx(0.8) and hi[1].item() == pytest.approx(1.28)
    assert hi[0].item() > 100  # tail: band wins


def test_bad_arguments_name_the_problem():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="kl, tv, chi2"):
        band_bounds(x, "js", 0.05)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="delta"):
            band_bounds(x, "kl", bad)
    with pytest.raises(ValueError, match="upper_cap"):
        band_bounds(x, "kl", 0.05, upper_cap=0.5)
    with pytest.raises(TypeError, match="floating"):
        band_bounds(torch.zeros(3, dtype=torch.long), "kl", 0.05)
