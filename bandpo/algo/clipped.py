"""The clipped surrogate (PPO's; BandPO eq. 2-3), and the entries of the algorithms built on it whose
bounds have no module of their own: grpo and clip_higher (a fixed interval) and bandpo (the band of
``bandpo.algo.band``, with a global or per-token radius, ``bandpo.algo.adaptive``; the band cannot hold
the entry: ``bandpo.algo.adaptive`` imports it). DCPO's entry is in ``bandpo.algo.dcpo``, beside its bounds.

Only the ratio interval differs between the algorithms of the family:

    log_ratio = clamp(logp - old_logp, -20, 20);  r = exp(log_ratio)
    (lo, hi)  = (1 - eps_low, 1 + eps_high)                 grpo 0.2/0.2, clip_higher 0.2/0.28
              | band_bounds(old_logp, divergence, delta)    bandpo (no grad through the bounds)
              | dac_bounds(old_logp, eps_low, eps_high)     dcpo 0.16/0.20 (``bandpo.algo.dcpo``)
    L = max(-A r, -A clamp(r, lo, hi))
    dual clip (c > 1): where A < 0, L = min(L, -A c)

A token is clipped ``up`` where A > 0 and r > hi, ``down`` where A < 0 and r < lo: the ratio went past a
bound in the advantage's direction, and the clamp removed its gradient.
"""

from __future__ import annotations

import torch

from bandpo.algo.adaptive import band_bounds_per_token, radius_from_options
from bandpo.algo.algorithm import Algorithm, PerToken
from bandpo.algo.band import band_bounds
from bandpo.algo.mismatch import masked_mean

# The options every algorithm of the family reads: the interval's thresholds and the dual clip.
CLIPPED_READS = frozenset({"eps_low", "eps_high", "dual_clip"})


def clipped_surrogate(
    algo: Algorithm, logprobs, old_logprobs, advantages, maskf, options, old_entropy
) -> PerToken:
    """The clipped surrogate with ``algo.bounds`` and the dual clip (``bandpo.algo.algorithm``'s contract).

    Metrics: ``clip_frac_dual`` (valid tokens where A < 0 and r > c) with the dual clip; with
    ``algo.metric_prefix``, the means of the per-token bounds (``<prefix>/lower_mean``, and
    ``<prefix>/log_upper_mean``: upper grows like 1/p (band) or 1/sqrt(p) (dcpo) in the tail, its log is
    the readable summary) and of a per-token radius (``<prefix>/delta_mean``).
    """
    o = options
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    delta_t = radius_from_options(o, old_entropy, old_logprobs)
    lo, hi = algo.bounds(
        old_logprobs,
        algo.resolve("eps_low", o.eps_low),
        algo.resolve("eps_high", o.eps_high),
        divergence=o.divergence,
        delta=o.delta,
        upper_cap=o.upper_cap,
        relax_high_p=o.relax_high_p,
        delta_t=delta_t,
        delta_range=None if delta_t is None else (o.delta_min, o.delta_max),
    )
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(lo, hi)
    per_token = torch.maximum(unclipped, clipped)
    negative = advantages < 0
    if o.dual_clip is not None:
        per_token = torch.where(negative, torch.minimum(per_token, -advantages * o.dual_clip), per_token)
    metrics: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        r = ratio.detach()
        up, down = (r > hi) & (advantages > 0), (r < lo) & negative
        prefix = algo.metric_prefix
        if delta_t is not None:
            metrics[f"{prefix}/delta_mean"] = masked_mean(delta_t.to(maskf.dtype), maskf)
        if o.dual_clip is not None:
            valid = maskf.bool()
            dual = (r > o.dual_clip) & negative & valid
            metrics["clip_frac_dual"] = dual.sum() / valid.sum().clamp(min=1)
        if prefix is not None:
            metrics[f"{prefix}/lower_mean"] = masked_mean(lo, maskf)
            metrics[f"{prefix}/log_upper_mean"] = masked_mean(torch.log(hi).clamp(max=100.0), maskf)
    return PerToken(per_token, up, down, ratio, log_ratio, metrics)


def fixed_interval(
    old_logprobs, eps_low: float, eps_high: float, **_per_token_options
) -> tuple[float, float]:
    """[1 - eps_low, 1 + eps_high] for every token (floats); the per-token bounds' options are not read."""
    return 1.0 - eps_low, 1.0 + eps_high


def band_interval(
    old_logprobs: torch.Tensor,
    eps_low: float,
    eps_high: float,
    *,
    divergence: str,
    delta: float,
    upper_cap: float | None,
    relax_high_p: bool,
    delta_t: torch.Tensor | None,
    delta_range: tuple[float, float] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BandPO's per-token bounds: the band of radius ``delta``, or of the per-token ``delta_t`` (within
    ``delta_range``); ``eps_low``/``eps_high`` are read only by ``relax_high_p`` (union with the fixed interval)."""
    relax = (eps_low, eps_high) if relax_high_p else None
    if delta_t is not None:
        if delta_range is None:
            raise ValueError("a per-token band radius needs delta_range=(delta_min, delta_max)")
        return band_bounds_per_token(
            old_logprobs, divergence, delta_t, delta_range, upper_cap=upper_cap, relax_high_p=relax
        )
    return band_bounds(old_logprobs, divergence, delta, upper_cap=upper_cap, relax_high_p=relax)


# GRPO (DeepSeekMath, arXiv 2402.03300) keeps PPO's symmetric 0.2; DAPO's Clip-Higher (arXiv 2503.14476)
# raises the upper threshold to 0.28.
GRPO = Algorithm(
    "grpo", clipped_surrogate, CLIPPED_READS, {"eps_low": 0.2, "eps_high": 0.2}, bounds=fixed_interval
)
CLIP_HIGHER = Algorithm(
    "clip_higher", clipped_surrogate, CLIPPED_READS, {"eps_low": 0.2, "eps_high": 0.28}, bounds=fixed_interval
)
# BandPO's eps are those of relax_high_p's union (Clip-Higher's); its upper_cap is the config's
# algorithm.band.upper_cap (the official upper_bound_max), beside the band's other options.
BANDPO = Algorithm(
    "bandpo",
    clipped_surrogate,
    CLIPPED_READS | {"upper_cap", "relax_high_p", "band_adaptive"},
    {"eps_low": 0.2, "eps_high": 0.28},
    bounds=band_interval,
    metric_prefix="band",
    band=True,
    config_keys={"upper_cap": "algorithm.band.upper_cap"},
)

# In the registry's order (bandpo.algo.registry).
ENTRIES = (GRPO, CLIP_HIGHER, BANDPO)
