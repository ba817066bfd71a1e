"""Entropy-adaptive Band: a per-token radius delta_t from the old policy's token entropy.

The paper's stated limitation (and future work): one global delta is too loose for confident
tokens and too tight for uncertain ones. Here the radius of the trust region (``bandpo.algo.band``, eq. 1)
becomes a per-token delta_t, a function of the entropy H_t = H(pi_old(.|s_t)) of the old
policy at that position (computed by the actor with the old logprobs; no gradient flows
through it, exactly as none flows through the bounds).

Normalised entropy h_t in [0, 1] (``norm``):
    logv:   h_t = min(H_t / log V, 1)           V = vocabulary size; 0 = one-hot, 1 = uniform
    batch:  h_t = H_t / (H_t + H_bar)            H_bar = mean entropy of the step's valid tokens
``scale`` is log V or H_bar, supplied by the caller (for ``batch``: over the whole step's
batch, so micro-batches see the same normaliser and still sum to the full-batch loss).
``batch`` is scale-free: the batch's mean-entropy token gets h = 1/2, whatever the model's
typical entropy is. ``logv`` is absolute but puts most LLM tokens (H ~ 0.1-1 nat against
log V ~ 12) near h = 0, so it mostly tightens.

Radius (geometric interpolation, because the band width grows like sqrt(delta) and delta
spans orders of magnitude):
    delta_t = delta_min^(1 - h_t) * delta_max^h_t = exp(log delta_min + h_t log(delta_max / delta_min))
Properties: delta_min <= delta_t <= delta_max (h in [0, 1]); non-decreasing in H_t (strictly
when delta_max > delta_min); with ``batch`` and delta_min delta_max = delta^2 (the config's
defaults delta/4, 4 delta), a token of mean entropy gets exactly delta. H_t = NaN gives NaN.

Bounds with a per-token radius (``band_bounds_per_token``):
- tv, chi2: the closed forms of ``bandpo.algo.band`` take a tensor delta elementwise.
- kl: a family of piecewise cubic tables over t = logit(p) (as in band.py, 16 cells per unit
  on [-40, 40]), one per node of a grid in s = log delta (spacing log(2)/4) spanning
  [delta_min, delta_max] plus one node either side, and 4-point Lagrange (cubic)
  interpolation in s between the four tables around each token's log delta_t. Tabulated:
      A(t, s) = log(log upper),      B(t, s) = log(-log lower),
  which are close to linear in s (the band's width goes like delta^(1/2) in the middle and
  delta^1 in the tails) and in t at both tails (log upper ~ log(1 - e^-delta) - log p as
  p -> 0, -log lower ~ delta / p). The U/PHI of band.py, interpolated in s, cost 7e-3
  relative on lower where it is small (a PHI error is amplified by 1/p). upper = exp(e^A)
  (continued below t = -40 with its exact slope, capped at 1/p), lower = exp(-e^B) (which
  underflows to 0 as the math does). Cost: 32 gathers instead of 8 and two extra exps, no
  loop over tokens, no host sync (CPU, 2 threads, 524k tokens: 4.1-5.3x the fixed-delta KL
  bounds, 1.9-2.4x its loss fwd+bwd in two runs of benchmarks/band.py). Error against the float64 bisection reference
  (tests/unit/algo/test_band_adaptive.py, delta in [0.005, 0.5]): at most 1.7e-6 relative on upper and
  1.5e-5 on lower wherever lower > 2e-9 (below e^-20 the clamped ratio never reaches it);
  float32 within 4e-5 of float64 on the same inputs. Values of delta_t outside the family's
  range are clamped into it. Build: 2 x 64-step bisections per node, ~1 s for 30 nodes.
"""

from __future__ import annotations

import math

import torch

from bandpo.algo.band import (
    _T_MAX,
    _T_MIN,
    _chi2_bounds,
    _horner,
    _tv_bounds,
    check_threshold,
    check_upper_cap,
    kl_roots_logit,
)

ADAPTIVE_MODES = ("none", "entropy")
ENTROPY_NORMS = ("batch", "logv")

_S_STEP = math.log(2.0) / 4  # spacing of the log-delta grid (factor 2^(1/4) between tables)
_CELLS_PER_UNIT = 16  # cells per unit of t = logit(p) in each family table
_BISECT_STEPS = 64  # bracket 2e3 / 2^64 ~ 1e-16: float64 resolution of v = logit(q) already
_X_MIN = -40.0 - math.log1p(math.exp(-40.0))  # log p at t = _T_MIN
_FAMILIES: dict[tuple[float, float, torch.dtype, torch.device], tuple[torch.Tensor, float]] = {}


def adaptive_delta(
    entropy: torch.Tensor, *, delta_min: float, delta_max: float, scale: float, norm: str = "batch"
) -> torch.Tensor:
    """Per-token radius delta_t (module docstring) for old-policy entropies ``entropy`` (any shape).

    Args:
        entropy: H_t >= 0 in nats, no grad needed (detached here).
        delta_min, delta_max: 0 < delta_min <= delta_max, the radius at h = 0 and h = 1.
        scale: log V for ``logv``, the step's mean valid-token entropy for ``batch`` (> 0).
        norm: ``batch`` | ``logv``.

    Returns:
        delta_t, same shape and dtype as ``entropy``.
    """
    check_delta_range(delta_min, delta_max)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"adaptive band entropy scale must be a finite number > 0, got {scale!r}")
    h_raw = entropy.detach().clamp(min=0.0)  # rounding may give -1e-8 entropies
    if norm == "logv":
        h = (h_raw / scale).clamp(max=1.0)
    elif norm == "batch":
        h = h_raw / (h_raw + scale)
    else:
        raise ValueError(f"unknown adaptive band entropy norm {norm!r}; valid: {', '.join(ENTROPY_NORMS)}")
    return torch.exp(math.log(delta_min) + h * math.log(delta_max / delta_min))


def check_delta_range(delta_min, delta_max, names: tuple[str, str] = ("delta_min", "delta_max")) -> None:
    """The adaptive radius' range: each end a band radius (``bandpo.algo.band.check_threshold``: finite, > 0)
    and delta_min <= delta_max (``adaptive_delta``, the KL table family, ``algorithm.band.delta_min/max``)."""
    for value, name in zip((delta_min, delta_max), names):
        check_threshold(value, name)
    if not delta_min <= delta_max:
        raise ValueError(f"{names[1]} must be >= {names[0]}={delta_min}, got {delta_max!r}")


def radius_from_options(options, old_entropy: torch.Tensor | None, old_logprobs: torch.Tensor):
    """The per-token radius [N, R] a run's ``LossOptions`` asks for: ``adaptive_delta`` of ``old_entropy``
    with ``band_adaptive="entropy"``, None with ``none`` (the band's global ``delta`` then)."""
    o = options
    if o.band_adaptive == "none":
        return None
    if old_entropy is None or o.delta_min is None or o.delta_max is None or o.entropy_scale is None:
        raise ValueError("band_adaptive='entropy' needs old_entropy, delta_min, delta_max and entropy_scale")
    if old_entropy.shape != old_logprobs.shape:
        raise ValueError(
            f"old_entropy shape {tuple(old_entropy.shape)} != old_logprobs {tuple(old_logprobs.shape)}"
        )
    return adaptive_delta(
        old_entropy, delta_min=o.delta_min, delta_max=o.delta_max, scale=o.entropy_scale, norm=o.entropy_norm
    )


def band_bounds_per_token(
    old_logprob: torch.Tensor,
    divergence: str,
    delta: torch.Tensor,
    delta_range: tuple[float, float],
    *,
    upper_cap: float | None = None,
    relax_high_p: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``band_bounds`` with a per-token radius ``delta`` (same shape as ``old_logprob``).

    ``delta_range = (delta_min, delta_max)`` sizes the KL table family (built once per range,
    dtype and device); ``delta`` is clamped into it. Edge inputs behave as in ``band_bounds``.
    """
    lo_d, hi_d = delta_range
    check_delta_range(lo_d, hi_d, ("delta_range's delta_min", "delta_range's delta_max"))
    if delta.shape != old_logprob.shape:
        raise ValueError(
            f"per-token delta shape {tuple(delta.shape)} != old_logprob shape {tuple(old_logprob.shape)}"
        )
    check_upper_cap(upper_cap, "band upper_cap")
    with torch.no_grad():
        x = old_logprob.detach().clamp(max=0.0)
        if divergence == "kl":  # the tables take delta in x's dtype (1 ulp of delta moves a bound by ~1 ulp)
            lower, upper = _kl_bounds_family(x, delta.detach().to(x.dtype).clamp(lo_d, hi_d), lo_d, hi_d)
        elif divergence in ("tv", "chi2"):  # closed forms in float64, as band_bounds runs them
            d = delta.detach().to(torch.float64).clamp(lo_d, hi_d)
            fn = _tv_bounds if divergence == "tv" else _chi2_bounds
            lower, upper = (b.to(x.dtype) for b in fn(x.to(torch.float64), d))
        else:
            raise ValueError(f"unknown band divergence {divergence!r}; valid: kl, tv, chi2")
        if upper_cap is not None:
            upper = upper.clamp(max=upper_cap)
        if relax_high_p is not None:
            lower = lower.clamp(max=1.0 - relax_high_p[0])
            upper = upper.clamp(min=1.0 + relax_high_p[1])
        return lower, upper


def _lagrange_weights(sigma: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Cubic Lagrange weights of nodes -1, 0, 1, 2 at sigma in [0, 1] (they sum to 1)."""
    a, b, c = sigma + 1.0, sigma - 1.0, sigma - 2.0
    return (-sigma * b * c / 6.0, a * b * c / 2.0, -a * sigma * c / 2.0, a * sigma * b / 6.0)


def _kl_bounds_family(x: torch.Tensor, delta: torch.Tensor, lo_d: float, hi_d: float):
    table, s0 = _kl_family(lo_d, hi_d, x.dtype, x.device)  # [8, K * cells], log-delta of node 0
    cells = int(round((_T_MAX - _T_MIN) * _CELLS_PER_UNIT))
    k = table.shape[1] // cells
    # t-cell and position in it, as in band._kl_bounds.
    w = torch.expm1(-x).log_().neg_()
    w.clamp_(_T_MIN, _T_MAX).sub_(_T_MIN).mul_(_CELLS_PER_UNIT)
    cell = w.floor().clamp_(max=cells - 1)
    s = w.sub_(cell)
    cell = cell.nan_to_num_(0.0).long().flatten()
    # s-node j (the stencil is j-1 .. j+2) and position sigma between nodes j and j+1.
    z = delta.log().sub_(s0).div_(_S_STEP)
    j = z.floor().clamp_(1, k - 3)
    sigma = z.sub_(j)
    j = j.long().flatten()
    weights = _lagrange_weights(sigma)
    coeffs = [None] * 8
    for m, wm in enumerate(weights):
        idx = (j + (m - 1)) * cells + cell
        for i, row in enumerate(table):
            term = row.index_select(0, idx).view_as(x).mul_(wm)
            coeffs[i] = term if coeffs[i] is None else coeffs[i].add_(term)
    # log upper = e^A, continued below t = -40 with its exact slope d(log upper)/d(-log p) = 1
    # (log upper = log(1 - e^-delta) - log p + O(p) there); never above log(1/p).
    log_upper = _horner(*coeffs[:4], s).exp_().add_(x.clamp(min=_X_MIN)).sub_(x)
    upper = torch.minimum(log_upper, -x).exp_().clamp_(min=1.0)
    lower = _horner(*coeffs[4:], s).exp_().neg_().exp_()  # exp(-e^B)
    return lower, upper


def _kl_family(lo_d: float, hi_d: float, dtype: torch.dtype, device: torch.device):
    key = (lo_d, hi_d, dtype, device)
    if key not in _FAMILIES:
        table, s0 = _build_kl_family(lo_d, hi_d)
        _FAMILIES[key] = (table.to(device=device, dtype=dtype), s0)
    return _FAMILIES[key]


def kl_family_nodes(lo_d: float, hi_d: float) -> list[float]:
    """The log-delta nodes of the family for [lo_d, hi_d]: one node below lo_d and one above hi_d."""
    inner = max(1, math.ceil((math.log(hi_d) - math.log(lo_d)) / _S_STEP - 1e-9))
    s0 = math.log(lo_d) - _S_STEP
    return [s0 + i * _S_STEP for i in range(inner + 3)]


def _build_kl_family(lo_d: float, hi_d: float) -> tuple[torch.Tensor, float]:
    """Cubic coefficients of A and B (module docstring) for every node: [8, K * cells] float64, and node 0."""
    nodes_s = kl_family_nodes(lo_d, hi_d)
    cells = int(round((_T_MAX - _T_MIN) * _CELLS_PER_UNIT))
    h = 1.0 / _CELLS_PER_UNIT
    nodes = torch.tensor([0.0, 1 / 3, 2 / 3, 1.0], dtype=torch.float64)
    t = _T_MIN + (torch.arange(cells, dtype=torch.float64)[:, None] + nodes) * h  # [cells, 4]
    log_p = torch.nn.functional.logsigmoid(t)
    inv = torch.linalg.inv(nodes[:, None] ** torch.arange(4, dtype=torch.float64)).T
    parts = []
    for s in nodes_s:
        log_q_hi, log_q_lo = kl_roots_logit(t, math.exp(s), steps=_BISECT_STEPS)
        a = torch.log(log_q_hi - log_p)  # log log upper
        b = torch.log(log_p - log_q_lo)  # log(-log lower)
        parts.append(torch.cat([a @ inv, b @ inv], dim=1).T)  # [8, cells]
    return torch.cat(parts, dim=1).contiguous(), nodes_s[0]
