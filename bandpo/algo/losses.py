"""The policy loss of every algorithm: the clipped surrogate of GRPO, Clip-Higher, BandPO (BandPO,
eq. 2-3: the clipped surrogate with a per-token interval) and DCPO, and the rivals' surrogates
(``bandpo.algo.rivals``: DPPO-TV/-KL, GSPO, CISPO, SAPO) in its place.

For the clipped family only the ratio interval differs between the four algorithms:

    log_ratio = clamp(logp - old_logp, -20, 20);  r = exp(log_ratio)
    (lo, hi)  = (1 - eps_low, 1 + eps_high)            grpo 0.2/0.2, clip_higher 0.2/0.28
              | band_bounds(old_logp, divergence, delta)  bandpo (no grad through bounds)
              | dac_bounds(old_logp, eps_low, eps_high)   dcpo 0.16/0.20 (``bandpo.algo.dcpo``)
    L = max(-A r, -A clamp(r, lo, hi))
    dual clip (c > 1): where A < 0, L = min(L, -A c)
    loss = agg(L) + kl_coef * agg(kl(logp, ref_logp)) - entropy_coef * agg(entropy)

A rival replaces L (and has no dual clip); aggregation, KL and entropy terms are shared.

Options on top (off by default; each composes with every algorithm unless stated):
- Entropy-adaptive Band (bandpo only, ``band_adaptive="entropy"``): the radius becomes a
  per-token delta_t from the old policy's entropy (``bandpo.algo.adaptive``).
- Rollout/trainer mismatch correction (``mismatch`` with cap ``mismatch_cap``, or ``tis_cap = C``
  for token-level truncated importance sampling): L <- w L with a detached weight w of
  pi_old / pi_rollout, truncated or masked at the token or sequence level, or IcePop's
  two-sided mask (``bandpo.algo.mismatch``).

The run's options are one frozen record, ``LossOptions`` (``bandpo.algo.options``, validated when built; the trainer
builds it once from the config, ``bandpo.config.loss_options``); the tensors and the global
normalisers are the call's arguments. Shapes follow ``bandpo.types``: N rows, R response
positions (a micro-batch's own N and R).

Aggregation is normalised over the *global* optimizer batch: callers pass the
global token count / sequence count (and the max response length for
``seq-mean-token-sum-norm``), so summing the losses of micro-batches gives the
loss of the full batch, and gradient accumulation needs no rescaling.

``agg`` modes, with m the token mask, T = global tokens, S = global sequences:
- ``token-mean``               sum(L m) / T
- ``seq-mean-token-mean``      sum_seq( sum_tok(L m) / sum_tok(m) ) / S       (paper default)
- ``seq-mean-token-sum``       sum(L m) / S
- ``seq-mean-token-sum-norm``  sum(L m) / (S * max_len)                        (Dr. GRPO)
"""

from __future__ import annotations

import math

import torch

from bandpo.algo import rivals
from bandpo.algo.adaptive import adaptive_delta, band_bounds_per_token
from bandpo.algo.band import band_bounds
from bandpo.algo.dcpo import dac_bounds
from bandpo.algo.mismatch import (
    masked_mean,
    mismatch_weights,
)
from bandpo.algo.options import AGG_MODES, KL_ESTIMATORS, Algorithm, LossOptions, get_algorithm

# Old-probability bins for the per-bin clip fraction: [0, .01), [.01, .1), [.1, .5), [.5, 1].
PROB_BIN_EDGES = (0.01, 0.1, 0.5)
LOG_PROB_BIN_EDGES = tuple(math.log(e) for e in PROB_BIN_EDGES)  # bins are taken on old logprobs
PROB_BIN_NAMES = ("lt0.01", "0.01-0.1", "0.1-0.5", "ge0.5")


def ratio_interval(
    old_logprobs: torch.Tensor,
    algorithm: str,
    *,
    eps_low: float | None = None,
    eps_high: float | None = None,
    divergence: str = "kl",
    delta: float = 0.05,
    upper_cap: float | None = None,
    relax_high_p: bool = False,
    delta_t: torch.Tensor | None = None,
    delta_range: tuple[float, float] | None = None,
) -> tuple[torch.Tensor | float, torch.Tensor | float]:
    """``(lo, hi)`` ratio bounds for ``algorithm``: floats for fixed clipping, tensors for band and dcpo.

    ``eps_low``/``eps_high`` default to the algorithm's own; for bandpo they are used only
    by ``relax_high_p`` (union with the fixed interval), for dcpo they are DAC's thresholds.
    ``delta_t`` (same shape as ``old_logprobs``, within ``delta_range``) replaces ``delta`` by a
    per-token radius (bandpo only).
    """
    algo = get_algorithm(algorithm)
    if algo.surrogate != "clip":
        raise ValueError(f"algorithm={algorithm!r} has no ratio interval (its surrogate is {algo.surrogate})")
    eps_low = algo.eps_low if eps_low is None else eps_low
    eps_high = algo.eps_high if eps_high is None else eps_high
    if algo.dac and delta_t is None:
        return dac_bounds(old_logprobs, eps_low, eps_high, upper_cap=upper_cap)
    if not algo.band:
        if delta_t is not None:
            raise ValueError(f"a per-token band radius applies to bandpo only, not algorithm={algorithm!r}")
        return 1.0 - eps_low, 1.0 + eps_high
    relax = (eps_low, eps_high) if relax_high_p else None
    if delta_t is not None:
        if delta_range is None:
            raise ValueError("a per-token band radius needs delta_range=(delta_min, delta_max)")
        return band_bounds_per_token(
            old_logprobs, divergence, delta_t, delta_range, upper_cap=upper_cap, relax_high_p=relax
        )
    return band_bounds(old_logprobs, divergence, delta, upper_cap=upper_cap, relax_high_p=relax)


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_len: float | None = None,
) -> torch.Tensor:
    """Aggregate per-token ``values`` [N, R] under ``mask`` [N, R] with global normalisers.

    Normalisers default to this batch's own counts (then micro-batches do *not* sum to the
    full batch; pass the global counts for that).
    """
    mask = mask.to(values.dtype)
    if mode == "token-mean":
        denom = mask.sum() if num_tokens is None else num_tokens
        return (values * mask).sum() / _positive(denom, "num_tokens")
    seqs = mask.shape[0] if num_seqs is None else num_seqs
    if mode == "seq-mean-token-mean":
        per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.sum() / _positive(seqs, "num_seqs")
    if mode == "seq-mean-token-sum":
        return (values * mask).sum() / _positive(seqs, "num_seqs")
    if mode == "seq-mean-token-sum-norm":
        length = mask.shape[-1] if max_len is None else max_len
        return (values * mask).sum() / (_positive(seqs, "num_seqs") * length)
    raise ValueError(f"unknown loss agg mode {mode!r}; valid: {', '.join(AGG_MODES)}")


def _positive(x, name: str):
    if isinstance(x, (int, float)) and x <= 0:
        raise ValueError(f"{name} must be > 0, got {x}")
    return x


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3)."""
    diff = ref_logprobs - logprobs  # log(pi_ref / pi)
    if estimator == "k1":
        return -diff
    if estimator == "k2":
        return 0.5 * diff.square()
    if estimator == "k3":
        # exp(d) - d - 1 >= 0, unbiased and low variance; clamped as in the recipe. d is clamped to
        # [-20, 20] first: the result is 10 beyond |d| = 20 either way, but exp(d) overflows float32
        # at d ~ 88.7 and inf * 0 in the backward pass of the outer clamp makes the gradient NaN.
        diff = diff.clamp(-20.0, 20.0)
        return (torch.exp(diff) - diff - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    options: LossOptions = LossOptions(),
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_len: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    old_entropy: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss and its metrics.

    Args:
        logprobs: [N, R] log pi_theta of the response tokens (with grad).
        old_logprobs: [N, R] log pi_old of the same tokens (behaviour policy, no grad).
        advantages: [N, R] per-token advantages, or [N] (broadcast over tokens).
        mask: [N, R] 1 for response tokens that count, 0 for padding.
        options: the run's ``LossOptions`` (algorithm, interval, aggregation, KL, entropy, mismatch).
        num_tokens, num_seqs, max_len: the aggregation's global normalisers (``options.norm_len``,
            when set, replaces ``max_len``).
        ref_logprobs: [N, R] log pi_ref for the KL term (required when kl_coef > 0).
        entropy: [N, R] per-token entropy of pi_theta (with grad when entropy_coef > 0).
        old_entropy: [N, R] entropy of pi_old at each response position (no grad; adaptive band).
        rollout_logprobs: [N, R] log pi_rollout of the sampled tokens (required with tis_cap or mismatch).

    Returns:
        ``(loss, metrics)``: scalar loss; metrics are detached 0-dim tensors (no host sync),
        fractions over this batch's valid tokens.
    """
    o = options
    if advantages.dim() == logprobs.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.expand_as(logprobs).to(logprobs.dtype)
    maskf = mask.to(logprobs.dtype)
    norm = dict(
        num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len if o.norm_len is None else o.norm_len
    )
    mask = maskf  # aggregate() converts a mask of another dtype on every call

    algo = get_algorithm(o.algorithm)
    metrics: dict[str, torch.Tensor] = {}
    lo = hi = None
    if algo.surrogate == "clip":
        per_token, up, down, lo, hi, ratio, log_ratio, delta_t = _clipped(
            logprobs, old_logprobs, advantages, maskf, o, old_entropy
        )
        if delta_t is not None:
            metrics["band/delta_mean"] = masked_mean(delta_t.to(maskf.dtype), maskf)
    else:
        per_token, up, down = _rival(logprobs, old_logprobs, advantages, maskf, o, algo)
        with torch.no_grad():
            log_ratio = (logprobs.detach() - old_logprobs).clamp(-20.0, 20.0)
            ratio = torch.exp(log_ratio)
    mode, cap = ("token_tis", o.tis_cap) if o.tis_cap is not None else (o.mismatch, o.mismatch_cap)
    if mode != "none":
        weight, mm = mismatch_weights(old_logprobs, rollout_logprobs, maskf, mode, cap)
        per_token = per_token * weight
        metrics.update(mm)
    pg_loss = aggregate(per_token, mask, o.agg, **norm)
    loss = pg_loss
    metrics["pg_loss"] = pg_loss.detach()
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs, o.kl_estimator)
        kl_term = aggregate(kl, mask, o.agg, **norm)
        loss = loss + o.kl_coef * kl_term
        metrics["kl_ref"] = masked_mean(kl.detach(), maskf)
    elif o.kl_coef > 0:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if entropy is not None:
        if o.entropy_coef != 0.0:
            loss = loss - o.entropy_coef * aggregate(entropy, mask, o.agg, **norm)
        metrics["entropy"] = masked_mean(entropy.detach(), maskf)

    with torch.no_grad():
        metrics.update(_clip_metrics(up, down, old_logprobs, mask))
        if algo.surrogate == "clip" and o.dual_clip is not None:
            valid = mask.bool()
            dual = (ratio.detach() > o.dual_clip) & (advantages < 0) & valid
            metrics["clip_frac_dual"] = dual.sum() / valid.sum().clamp(min=1)
        if isinstance(lo, torch.Tensor):
            prefix = "band" if algo.band else algo.name  # per-token bounds: band/... or dcpo/...
            metrics[f"{prefix}/lower_mean"] = masked_mean(lo, maskf)
            # upper grows like 1/p (band) or 1/sqrt(p) (dcpo) in the tail; its log is the readable summary.
            metrics[f"{prefix}/log_upper_mean"] = masked_mean(torch.log(hi).clamp(max=100.0), maskf)
        metrics["loss"] = loss.detach()
        # k3 estimate of KL(pi_old || pi_theta) under old samples: r - 1 - log r >= 0.
        metrics["approx_kl"] = masked_mean(ratio.detach() - 1.0 - log_ratio.detach(), maskf)
    return loss, metrics


def _clipped(logprobs, old_logprobs, advantages, maskf, o: LossOptions, old_entropy):
    """The clipped surrogate L = max(-A r, -A clamp(r, lo, hi)) with the dual clip, [N, R], and
    the masks of the tokens it clipped (the ratio pushed past a bound in the advantage's direction)."""
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    delta_t = _adaptive_radius(o, old_entropy, old_logprobs)
    lo, hi = ratio_interval(
        old_logprobs,
        o.algorithm,
        eps_low=o.eps_low,
        eps_high=o.eps_high,
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
    with torch.no_grad():
        r = ratio.detach()
        up, down = (r > hi) & (advantages > 0), (r < lo) & negative
    return per_token, up, down, lo, hi, ratio, log_ratio, delta_t


def _rival(logprobs, old_logprobs, advantages, maskf, o: LossOptions, algo: Algorithm):
    """A rival's ``(L, up, down)`` (``bandpo.algo.rivals``) with the run's thresholds."""
    eps_low = algo.eps_low if o.eps_low is None else o.eps_low
    eps_high = algo.eps_high if o.eps_high is None else o.eps_high
    kind = algo.surrogate
    if kind in ("dppo_tv", "dppo_kl"):
        return rivals.dppo_loss(
            logprobs,
            old_logprobs,
            advantages,
            divergence=kind.removeprefix("dppo_"),
            eps_low=eps_low,
            eps_high=eps_high,
            ratio_cap=o.ratio_cap,
        )
    if kind == "gspo":
        return rivals.gspo_loss(logprobs, old_logprobs, advantages, maskf, eps_low=eps_low, eps_high=eps_high)
    if kind == "cispo":
        return rivals.cispo_loss(logprobs, old_logprobs, advantages, eps_low=eps_low, eps_high=eps_high)
    if kind == "sapo":
        return rivals.sapo_loss(
            logprobs,
            old_logprobs,
            advantages,
            tau_pos=rivals.SAPO_TAU_POS if o.tau_pos is None else o.tau_pos,
            tau_neg=rivals.SAPO_TAU_NEG if o.tau_neg is None else o.tau_neg,
        )
    raise ValueError(f"unknown surrogate {kind!r} of algorithm {algo.name!r}")


def _adaptive_radius(o: LossOptions, old_entropy, old_logprobs):
    """The per-token radius [N, R] for ``band_adaptive="entropy"``, None for ``none``."""
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


def _clip_metrics(up, down, old_logprobs, mask) -> dict[str, torch.Tensor]:
    """Fractions of valid tokens whose update the surrogate cut: ``up`` / ``down`` [N, R] (the
    clip: gradient removed; see each rival for its own meaning), overall and per old-probability bin.

    Per bin ``b`` (of the valid tokens with old probability in that bin): ``clip_frac_bin/b`` counts
    the tokens cut either way, ``clip_frac_bin_up/b`` those cut by ``up`` (for the clipped family,
    DPPO and GSPO: A > 0 and the policy moved past the upper limit) and ``clip_frac_bin_down/b``
    those cut by ``down`` (A < 0, past the lower limit); ``up`` and ``down`` are disjoint in every
    surrogate, so the two add up to ``clip_frac_bin/b``. ``token_frac_bin/b`` is the bin's share of
    the valid tokens. The dual clip is not in any of them (``clip_frac_dual``).

    Kept cheap: boolean algebra and one bincount instead of per-bin float masks, since on
    CPU these metrics otherwise cost as much as the loss itself.
    """
    valid = mask.bool()
    n_valid = valid.sum().clamp(min=1)
    up, down = up & valid, down & valid
    out = {"clip_frac_up": up.sum() / n_valid, "clip_frac_down": down.sum() / n_valid}
    # code = bin + 4 * up + 8 * down for valid tokens, 16 for padding: one pass counts every cell.
    edges = torch.tensor(LOG_PROB_BIN_EDGES, dtype=old_logprobs.dtype, device=old_logprobs.device)
    bins = torch.bucketize(old_logprobs.detach(), edges, right=True)
    code = torch.where(valid, bins + 4 * up + 8 * down, 16)
    counts = torch.bincount(code.flatten(), minlength=17)[:16].view(4, 4)  # [neither/up/down/both, bin]
    in_bin = counts.sum(0).clamp(min=1)
    cut_up, cut_down = counts[1] + counts[3], counts[2] + counts[3]
    for i, name in enumerate(PROB_BIN_NAMES):
        out[f"clip_frac_bin/{name}"] = counts[1:, i].sum() / in_bin[i]
        out[f"clip_frac_bin_up/{name}"] = cut_up[i] / in_bin[i]
        out[f"clip_frac_bin_down/{name}"] = cut_down[i] / in_bin[i]
        out[f"token_frac_bin/{name}"] = counts[:, i].sum() / n_valid
    return out
