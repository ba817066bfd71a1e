"""DCPO's dynamic adaptive clipping (DAC): per-token ratio bounds from the old probability.

DCPO (Yang et al. 2025, "DCPO: Dynamic Clipping Policy Optimization", arXiv 2509.02333, section
"Dynamic-Adaptive Clipping") bounds how far the sampled token's *probability* moves, not only its
ratio. With q = pi_old(token), p = pi_theta(token) and r = p / q, PPO's |r - 1| <= eps becomes

    |r - 1| p = |r - 1| r q <= eps          (eps_high where r > 1, eps_low where r < 1)     (DAC)

Each side is a quadratic in r (derivation; ``tests/unit/algo/test_dcpo.py`` checks numerically that
the bounds solve it):
- r >= 1:  (r - 1) r q <= eps_high  <=>  r^2 - r - eps_high/q <= 0, true between the roots
  (1 -/+ sqrt(1 + 4 eps_high/q)) / 2; the larger one is the upper bound.
- r <= 1:  (1 - r) r q <= eps_low   <=>  r^2 - r + eps_low/q >= 0, true outside the roots
  (1 -/+ sqrt(1 - 4 eps_low/q)) / 2; the interval that holds r = 1 starts at the larger one.

which is the paper's closed form (also the authors' verl code and the BandPO authors' DCPO baseline):

    lower = 0.5 + 0.5 sqrt(max(1 - 4 eps_low / q, 0))
    upper = min(0.5 + 0.5 sqrt(1 + 4 eps_high / q), upper_cap)

Where the closed form departs from the constraint alone (the paper's and the official code's
choices, kept here):
- The 0.5 floor. For q <= 4 eps_low the roots are not real and (1 - r) r q <= q/4 <= eps_low holds
  for every r in [0, 1], so the constraint alone would allow lower = 0; max(., 0) puts lower at the
  vertex r = 1/2 instead. At the recipe's eps_low = 0.16 that is every token with q < 0.64: the
  surrogate stops pushing such a token down once it has lost half its probability.
- The cap. The paper's equation has none; upper grows like sqrt(eps_high / q) as q -> 0. The
  authors' code clamps it at max(dual clip c, 10), the BandPO authors' baseline at 10
  (``upper_bound_max``); here ``upper_cap`` (10 in the recipe, None = the bare equation).
- No simplex limit. For q > 1 / (1 + eps_high) the upper bound exceeds 1/q, a ratio that p <= 1
  cannot reach; that bound never binds, so it is left as the formula gives it (Band clamps to 1/p).

Only DAC is implemented: DCPO's smooth advantage standardization (SAS) and its "only token mean"
aggregation are not; the recipe (configs/algorithm/dcpo.yaml) keeps the shared GRPO advantages and
``seq-mean-token-mean``, as the BandPO authors' baseline does, so that arms differ only in the bounds.

Edge inputs (any shape, all tested)
- logprob = -inf (q = 0): (0.5, upper_cap), or (0.5, inf) without a cap: the limits as q -> 0.
  (The authors' code returns lower = 1 at q = 0 exactly, an artefact of its zero-division guard.)
- logprob >= 0 (q = 1; positive values are rounding noise, treated as 0).
- logprob = NaN: NaN bounds (they propagate, so a numeric guard downstream sees them).
"""

from __future__ import annotations

import torch

from bandpo.algo.algorithm import Algorithm
from bandpo.algo.band import check_floating, check_threshold, check_upper_cap
from bandpo.algo.clipped import CLIPPED_READS, clipped_surrogate


def dac_bounds(
    old_logprob: torch.Tensor,
    eps_low: float,
    eps_high: float,
    *,
    upper_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DAC ratio bounds ``(lower, upper)`` for tokens with old log-probabilities ``old_logprob``.

    Args:
        old_logprob: log q = log pi_old(a|s) of the sampled tokens, any shape, floating dtype.
        eps_low, eps_high: the DAC thresholds (> 0) on |r - 1| r q below and above r = 1.
        upper_cap: optional ceiling of ``upper`` (> 1); None = no ceiling.

    Returns:
        ``(lower, upper)``, same shape, dtype and device as ``old_logprob``, no grad;
        0.5 <= lower <= 1 <= upper.
    """
    for name, eps in (("eps_low", eps_low), ("eps_high", eps_high)):
        check_threshold(eps, f"dcpo {name}")
    check_upper_cap(upper_cap, "dcpo upper_cap")
    check_floating(old_logprob)
    with torch.no_grad():
        # Float64 throughout: sqrt's slope is unbounded at 0, so near q = 4 eps_low float32 roundings
        # of 1 - 4 eps_low / q (~6e-8) become up to ~5e-5 of error in lower (measured on float32 inputs).
        x = old_logprob.detach().clamp(max=0.0).to(torch.float64)  # log q; NaN stays NaN
        q, inv_q = torch.exp(x), torch.exp(-x)
        # 1 - 4 eps_low / q written as (q - 4 eps_low) / q: the subtraction is exact where q ~ 4 eps_low
        # (Sterbenz). q = 0 gives -inf here, floored to 0: lower = 0.5, the limit.
        lower = 0.5 + 0.5 * torch.sqrt(((q - 4.0 * eps_low) * inv_q).clamp(min=0.0))
        upper = 0.5 + 0.5 * torch.sqrt(1.0 + 4.0 * eps_high * inv_q)
        if upper_cap is not None:
            upper = upper.clamp(max=upper_cap)
        return lower.to(old_logprob.dtype), upper.to(old_logprob.dtype)


def dac_interval(
    old_logprobs: torch.Tensor, eps_low: float, eps_high: float, *, upper_cap: float | None, **_band_options
) -> tuple[torch.Tensor, torch.Tensor]:
    """DCPO's ratio interval (``Algorithm.bounds``): ``dac_bounds``; the band's options are not read."""
    return dac_bounds(old_logprobs, eps_low, eps_high, upper_cap=upper_cap)


# The clipped surrogate with DAC's bounds; thresholds of the BandPO authors' DCPO baseline (module docstring).
DCPO = Algorithm(
    "dcpo",
    clipped_surrogate,
    CLIPPED_READS | {"upper_cap"},
    {"eps_low": 0.16, "eps_high": 0.20},
    bounds=dac_interval,
    metric_prefix="dcpo",
)

# In the registry's order (bandpo.algo.registry).
ENTRIES = (DCPO,)
