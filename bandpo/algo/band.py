"""The Band operator: per-token ratio bounds from an f-divergence trust region.

For a sampled token with old probability p and ratio r = pi_new / pi_old, the
closest new distribution (any f-divergence) rescales the rest of the vocabulary
by c = (1 - r p) / (1 - p), so the trust region D_f(pi_old, pi_new) <= delta is
the scalar condition (BandPO, "The Band operator")

    g_f(p, r) = p f(r) + (1 - p) f(c) <= delta.                          (1)

The band [lower, upper] holds the two roots of g_f = delta, with the simplex
limits 0 <= lower and upper <= 1/p.

How each divergence is computed
- ``tv``   (f = |u-1|/2, computed in float64):  upper = min(1 + delta/p, 1/p), lower = max(1 - delta/p, 0).
- ``chi2`` (f = (u-1)^2, computed in float64):  upper = min(1 + sqrt(delta (1-p)/p), 1/p), lower = max(1 - ..., 0),
  with (1-p)/p evaluated as expm1(-log p) so p -> 1 keeps full precision.
- ``kl``   (f = u - 1 - log u): g is the Bernoulli divergence KL(Bern(p) || Bern(q)) with
  q = r p, which has no closed-form root. We tabulate, once per (delta, dtype, device),
  piecewise cubics over t = logit(p) on [-40, 40] (cell width 1/64); each cubic
  interpolates 4 exactly solved points of its cell (float64 bisection, 200 steps).
  Tabulated are two smooth, bounded quantities:
      U(t)   = log q_hi = log(upper) + log p          -> log(1 - e^-delta) as p -> 0
      PHI(t) = p * log(lower)                          -> -delta at both ends
  so upper = exp(U - log p) and lower = exp(PHI / p) keep relative accuracy over the
  whole range (lower underflows to 0 as log lower ~ -delta/p - 1, exactly as the math
  does). The logit variable resolves both tails: p -> 0 (t ~ log p) and p -> 1
  (t ~ -log(1-p)), where lower has a (1-p) log(1-p) term that a grid in log p cannot
  follow. Outside [-40, 40] the tables are constant, which is exact to ~1e-17.
  Measured error vs the mpmath reference (tests/unit/algo/test_band.py): < 1e-9 relative in float64.
  Per call: a handful of elementwise ops and one gather, no Python loop over tokens and no
  host synchronisation.
- a callable ``f`` (any convex f with f(1) = 0): vectorised bisection of (1) on each side
  of r = 1 (monotone there), 100 fixed steps in float64. For experiments, not speed.

Edge inputs (any shape; all documented behaviour is tested)
- logprob = -inf (p = 0):  (lower, upper) = (0, inf): the token is never clipped.
- logprob >= 0 (p = 1; positive values are rounding noise and are treated as 0):
  upper = 1, lower = exp(-delta) (kl), 1 - delta (tv), 1 (chi2).
- logprob = NaN: NaN bounds (they propagate, so a numeric guard downstream sees them).

Options of the official implementation, off by default:
- ``upper_cap``: upper = min(upper, upper_cap) (their ``upper_bound_max``; they pass 10).
- ``relax_high_p=(eps_low, eps_high)``: union with the fixed clip interval,
  lower = min(lower, 1 - eps_low), upper = max(upper, 1 + eps_high).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from bandpo.errors import check_number

DIVERGENCES = ("kl", "tv", "chi2")

# KL table geometry: t = logit(p) in [_T_MIN, _T_MAX], _CELLS_PER_UNIT cells per unit of t.
_T_MIN, _T_MAX, _CELLS_PER_UNIT = -40.0, 40.0, 64
_BISECT_STEPS = 200
_KL_TABLES: dict[tuple[float, torch.dtype, torch.device], torch.Tensor] = {}


def band_bounds(
    old_logprob: torch.Tensor,
    divergence: str | Callable[[torch.Tensor], torch.Tensor],
    delta: float,
    *,
    upper_cap: float | None = None,
    relax_high_p: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ratio bounds ``(lower, upper)`` for tokens with old log-probabilities ``old_logprob``.

    Args:
        old_logprob: log pi_old(a|s) of the sampled tokens, any shape, floating dtype.
        divergence: ``"kl"``, ``"tv"``, ``"chi2"``, or a convex generator ``f(u)`` with
            f(1) = 0 acting elementwise on a float64 tensor.
        delta: trust-region radius, > 0.
        upper_cap: optional clamp of ``upper`` to at most this value (> 1).
        relax_high_p: optional ``(eps_low, eps_high)``; the band is united with
            [1 - eps_low, 1 + eps_high].

    Returns:
        ``(lower, upper)``, same shape, dtype and device as ``old_logprob``, no grad.
    """
    check_threshold(delta, "band delta")
    check_upper_cap(upper_cap, "band upper_cap")
    check_floating(old_logprob)
    with torch.no_grad():
        x = old_logprob.detach().clamp(max=0.0)  # log p; NaN stays NaN
        if callable(divergence):
            lower, upper = _generic_bounds(x, divergence, float(delta))
        elif divergence == "kl":
            lower, upper = _kl_bounds(x, float(delta))
        elif divergence in ("tv", "chi2"):
            # Closed forms run in float64: near lower = 0 they are ill-conditioned in p
            # (relative condition p / (p - delta) for tv), so float32 exp(x) alone would cost
            # 1e-4 relative there; float64 keeps float32 outputs within 1e-5 everywhere.
            fn = _tv_bounds if divergence == "tv" else _chi2_bounds
            lower, upper = (b.to(x.dtype) for b in fn(x.to(torch.float64), float(delta)))
        else:
            raise ValueError(
                f"unknown band divergence {divergence!r}; valid: {', '.join(DIVERGENCES)} or a callable f"
            )
        if upper_cap is not None:
            upper = upper.clamp(max=upper_cap)
        if relax_high_p is not None:
            eps_low, eps_high = relax_high_p
            lower = lower.clamp(max=1.0 - eps_low)
            upper = upper.clamp(min=1.0 + eps_high)
        return lower, upper


def check_threshold(x, name: str = "band delta") -> None:
    """A trust-region radius or clip threshold of the per-token bounds is a finite number > 0: the band's
    delta (``algorithm.band.delta``, each end of the adaptive band's range) and DCPO's eps_low / eps_high."""
    check_number(x, name, low=0, strict_low=True)


def check_upper_cap(upper_cap, name: str = "band upper_cap") -> None:
    """The ceiling of the per-token upper bound (bandpo's and dcpo's ``upper_cap``) is None or a finite
    number > 1 (a ratio bound never below 1)."""
    if upper_cap is not None:
        check_number(upper_cap, name, low=1, strict_low=True)


def check_eps(eps_low, eps_high, names: tuple[str, str] = ("eps_low", "eps_high")) -> None:
    """The fixed clip interval [1 - eps_low, 1 + eps_high] (and the thresholds every surrogate but sapo's
    reads in its place): 0 < eps_low <= 1 and eps_high > 0, both finite; None (the algorithm's own) passes."""
    if eps_low is not None:
        check_threshold(eps_low, names[0])
        check_number(eps_low, names[0], high=1)
    if eps_high is not None:
        check_threshold(eps_high, names[1])


def check_floating(old_logprob: torch.Tensor) -> None:
    """The bounds are computed from floating old log-probabilities (a TypeError otherwise)."""
    if not torch.is_floating_point(old_logprob):
        raise TypeError(f"old_logprob must be a floating tensor, got {old_logprob.dtype}")


def _tv_bounds(x: torch.Tensor, delta: float) -> tuple[torch.Tensor, torch.Tensor]:
    p, inv_p = torch.exp(x), torch.exp(-x)
    # lower = 1 - delta/p written as (p - delta)/p: the subtraction is exact when p ~ delta
    # (Sterbenz), where 1 - delta/p would cancel catastrophically in float32.
    lower = ((p - delta) * inv_p).clamp(0.0, 1.0)  # p * (1/p) may round to 1 + ulp
    return lower, torch.minimum(1.0 + delta * inv_p, inv_p)


def _chi2_bounds(x: torch.Tensor, delta: float) -> tuple[torch.Tensor, torch.Tensor]:
    # a = delta (1 - p)/p with (1 - p)/p = expm1(-log p): exact as p -> 1.
    a = delta * torch.expm1(-x)
    width = torch.sqrt(a)
    # lower = 1 - sqrt(a) = (1 - a)/(1 + sqrt(a)) and 1 - a = ((1 + delta) p - delta)/p: no
    # cancellation of nearly equal terms except the exact one near the saturation point.
    p = torch.exp(x)
    lower = ((1.0 + delta) * p - delta) * torch.exp(-x) / (1.0 + width)
    # width >= 1: saturated at 0 (also p = 0, where the formula is -inf/inf); at p = 1 the
    # formula may round to 1 + ulp.
    lower = torch.where(width >= 1.0, 0.0, lower.clamp(max=1.0))
    return lower, torch.minimum(1.0 + width, torch.exp(-x))


# ----------------------------------------------------------------------------- KL


def _kl_bounds(x: torch.Tensor, delta: float) -> tuple[torch.Tensor, torch.Tensor]:
    table = _kl_table(delta, x.dtype, x.device)  # [8, cells]: cubic coeffs of U (0-3), PHI (4-7)
    # In-place ops throughout: on CPU the cost of this path is mostly fresh allocations.
    # t = logit(p) = -log(1/p - 1) = -log(expm1(-log p)): exact near p = 1 and p = 0.
    w = torch.expm1(-x).log_().neg_()
    w.clamp_(_T_MIN, _T_MAX).sub_(_T_MIN).mul_(_CELLS_PER_UNIT)
    cell = w.floor().clamp_(max=table.shape[1] - 1)
    s = w.sub_(cell)  # position in the cell, [0, 1]
    # Eight 1-D gathers measured ~3x faster on CPU than one [..., 8] gather (table[cell]).
    # A NaN input gives NaN s, hence NaN bounds (cell 0 is only a placeholder index).
    idx = cell.nan_to_num_(0.0).long().flatten()
    c = [row.index_select(0, idx).view_as(x) for row in table]
    # U <= 0 (q_hi <= 1) and PHI <= 0 (lower <= 1); clamps absorb interpolation rounding.
    upper = _horner(c[0], c[1], c[2], c[3], s).clamp_(max=0.0).sub_(x).exp_().clamp_(min=1.0)
    lower = _horner(c[4], c[5], c[6], c[7], s).clamp_(max=0.0).mul_(torch.exp(-x)).exp_()
    return lower, upper


def _horner(c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor, s: torch.Tensor):
    """c0 + s (c1 + s (c2 + s c3)), reusing c3's buffer (the gathered rows are scratch)."""
    return c3.mul_(s).add_(c2).mul_(s).add_(c1).mul_(s).add_(c0)


def _kl_table(delta: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # The table is built once per delta in float64 on the CPU; other dtypes and devices are copies of it.
    built = (delta, torch.float64, torch.device("cpu"))
    if built not in _KL_TABLES:
        _KL_TABLES[built] = _build_kl_table(delta)
    key = (delta, dtype, device)
    if key not in _KL_TABLES:
        _KL_TABLES[key] = _KL_TABLES[built].to(device=device, dtype=dtype)
    return _KL_TABLES[key]


def _build_kl_table(delta: float) -> torch.Tensor:
    """Cubic coefficients (cell coordinate s in [0, 1]) of U(t) and PHI(t): [8, cells], float64."""
    cells = int(round((_T_MAX - _T_MIN) * _CELLS_PER_UNIT))
    h = 1.0 / _CELLS_PER_UNIT
    nodes = torch.tensor([0.0, 1 / 3, 2 / 3, 1.0], dtype=torch.float64)
    t = _T_MIN + (torch.arange(cells, dtype=torch.float64)[:, None] + nodes) * h  # [cells, 4]
    log_q_hi, log_q_lo = kl_roots_logit(t, delta)
    log_p = torch.nn.functional.logsigmoid(t)
    u = log_q_hi
    phi = torch.exp(log_p) * (log_q_lo - log_p)
    vander = nodes[:, None] ** torch.arange(4, dtype=torch.float64)  # [4 nodes, 4 powers]
    inv = torch.linalg.inv(vander)
    return torch.cat([u @ inv.T, phi @ inv.T], dim=1).T.contiguous()  # [8, cells]


def kl_roots_logit(
    t: torch.Tensor, delta: float, steps: int = _BISECT_STEPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact (float64 bisection) roots of KL(Bern(p) || Bern(q)) = delta, p = sigmoid(t).

    Returns ``(log q_hi, log q_lo)`` with q_lo < p < q_hi. Bisection runs on v = logit(q),
    where every term of the divergence is a log-sigmoid and so has full precision at
    both tails. This is the slow, obvious reference the tables are built from. ``steps``
    bisection steps shrink the bracket (width 1e3) by 2^steps; 64 already reach float64's
    resolution of v for |v| <= 40.
    """
    t = t.to(torch.float64)
    logsig = torch.nn.functional.logsigmoid
    log_p, log_1mp = logsig(t), logsig(-t)
    p, one_minus_p = torch.exp(log_p), torch.exp(log_1mp)

    def kl(v: torch.Tensor) -> torch.Tensor:
        return p * (log_p - logsig(v)) + one_minus_p * (log_1mp - logsig(-v))

    def bisect(lo: torch.Tensor, hi: torch.Tensor, increasing: bool) -> torch.Tensor:
        for _ in range(steps):
            mid = 0.5 * (lo + hi)
            above = kl(mid) > delta
            go_left = above if increasing else ~above
            hi, lo = torch.where(go_left, mid, hi), torch.where(go_left, lo, mid)
        return 0.5 * (lo + hi)

    # KL grows without bound in both directions of v = logit(q) away from t, and is above
    # any delta <= 700 once |v - t| > 760 (p log(p/q) alone exceeds it); 1e3 is a safe bracket.
    v_hi = bisect(t, t + 1e3, increasing=True)
    v_lo = bisect(t - 1e3, t, increasing=False)
    return logsig(v_hi), logsig(v_lo)


# ------------------------------------------------------------------------ generic f


def _generic_bounds(
    x: torch.Tensor, f: Callable[[torch.Tensor], torch.Tensor], delta: float, steps: int = 100
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bisection of g_f(p, r) = delta (eq. 1) on [1, 1/p] and [0, 1], float64."""
    x64 = x.to(torch.float64)
    p = torch.exp(x64)
    # p = 1 leaves no room for c; keep p just below 1 so c stays defined (upper -> 1 anyway).
    p = p.clamp(max=1.0 - 1e-15)

    def g(r: torch.Tensor) -> torch.Tensor:
        c = ((1.0 - r * p) / (1.0 - p)).clamp(min=0.0)
        return p * f(r) + (1.0 - p) * f(c)

    r_max = 1.0 / p
    one = torch.ones_like(p)
    lo, hi = one.clone(), r_max.clone()
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        above = g(mid) > delta
        hi, lo = torch.where(above, mid, hi), torch.where(above, lo, mid)
    upper = torch.where(g(r_max) <= delta, r_max, 0.5 * (lo + hi))
    lo, hi = torch.zeros_like(p), one.clone()
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        above = g(mid) > delta
        lo, hi = torch.where(above, mid, lo), torch.where(above, hi, mid)
    lower = torch.where(g(torch.zeros_like(p)) <= delta, 0.0, 0.5 * (lo + hi))
    nan = torch.isnan(x64)
    lower, upper = lower.masked_fill(nan, math.nan), upper.masked_fill(nan, math.nan)
    return lower.to(x.dtype), upper.to(x.dtype)


def kl_generator(u: torch.Tensor) -> torch.Tensor:
    """f(u) = u - 1 - log u: the generator whose g_f is KL(pi_old || pi_new) (f(0) = inf)."""
    return u - 1.0 - torch.log(u)


def tv_generator(u: torch.Tensor) -> torch.Tensor:
    return 0.5 * (u - 1.0).abs()


def chi2_generator(u: torch.Tensor) -> torch.Tensor:
    return (u - 1.0) ** 2
