"""The policy loss of every algorithm: the chosen algorithm's per-token surrogate (its entry in
``bandpo.algo.registry``: the clipped surrogate of GRPO, Clip-Higher, BandPO (BandPO, eq. 2-3: a per-token
interval) and DCPO, ``bandpo.algo.clipped``; or a rival's, ``bandpo.algo.rivals``: DPPO-TV/-KL, GSPO,
CISPO, SAPO), then the terms every algorithm shares:

    L = algo.surrogate(...)                      per token, [N, R]
    loss = agg(L) + kl_coef * agg(kl(logp, ref_logp)) - entropy_coef * agg(entropy)

Only the clipped family has a dual clip and a ratio interval (``ratio_interval``).

Options on top (off by default; each composes with every algorithm unless stated):
- Entropy-adaptive Band (bandpo only, ``band_adaptive="entropy"``): the radius becomes a
  per-token delta_t from the old policy's entropy (``bandpo.algo.adaptive``).
- Rollout/trainer mismatch correction (``mismatch`` with cap ``mismatch_cap``, or ``tis_cap = C``
  for token-level truncated importance sampling): L <- w L with a detached weight w of
  pi_old / pi_rollout, truncated or masked at the token or sequence level, or IcePop's
  two-sided mask (``bandpo.algo.mismatch``).
- High-entropy tokens only (``top_entropy_quantile = rho < 1``): L <- keep L, keep the valid tokens in
  the top rho fraction by the current policy's entropy; the entropy bonus then acts on those tokens
  (``bandpo.algo.entropy_bonus``, which also holds the adaptive bonus' coefficient: the trainer sets
  ``entropy_coef`` per step).

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

from bandpo.algo.entropy_bonus import top_entropy_mask
from bandpo.algo.mismatch import (
    masked_mean,
    mismatch_weights,
)
from bandpo.algo.options import AGG_MODES, KL_ESTIMATORS, LossOptions
from bandpo.algo.registry import and_list, get_algorithm, readers

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
    """``(lo, hi)`` ratio bounds for ``algorithm`` (its entry's ``bounds``): floats for a fixed interval,
    tensors shaped like ``old_logprobs`` for bandpo's band and dcpo's DAC.

    ``eps_low``/``eps_high`` default to the algorithm's own; for bandpo they are used only
    by ``relax_high_p`` (union with the fixed interval), for dcpo they are DAC's thresholds.
    ``delta_t`` (same shape as ``old_logprobs``, within ``delta_range``) replaces ``delta`` by a
    per-token radius (bandpo only). The options another algorithm's bounds take are not read.
    """
    algo = get_algorithm(algorithm)
    if algo.bounds is None:
        raise ValueError(f"algorithm={algorithm!r} has no ratio interval (its surrogate is {algorithm})")
    if delta_t is not None and "band_adaptive" not in algo.reads:
        raise ValueError(
            f"a per-token band radius applies to {and_list(readers('band_adaptive'))} only, "
            f"not algorithm={algorithm!r}"
        )
    return algo.bounds(
        old_logprobs,
        algo.resolve("eps_low", eps_low),
        algo.resolve("eps_high", eps_high),
        divergence=divergence,
        delta=delta,
        upper_cap=upper_cap,
        relax_high_p=relax_high_p,
        delta_t=delta_t,
        delta_range=delta_range,
    )


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
    """The policy-gradient loss of ``options.algorithm`` (its entry's surrogate) and its metrics.

    Args:
        logprobs: [N, R] log pi_theta of the response tokens (with grad).
        old_logprobs: [N, R] log pi_old of the same tokens (behaviour policy, no grad).
        advantages: [N, R] per-token advantages, or [N] (broadcast over tokens).
        mask: [N, R] 1 for response tokens that count, 0 for padding.
        options: the run's ``LossOptions`` (algorithm, interval, aggregation, KL, entropy, mismatch).
        num_tokens, num_seqs, max_len: the aggregation's global normalisers (``options.norm_len``,
            when set, replaces ``max_len``).
        ref_logprobs: [N, R] log pi_ref for the KL term (required when kl_coef > 0).
        entropy: [N, R] per-token entropy of pi_theta (with grad when entropy_coef > 0; required with
            top_entropy_quantile < 1).
        old_entropy: [N, R] entropy of pi_old at each response position (no grad; adaptive band).
        rollout_logprobs: [N, R] log pi_rollout of the sampled tokens (required with tis_cap or mismatch).

    Returns:
        ``(loss, metrics)``: scalar loss; metrics are detached 0-dim tensors (no host sync),
        fractions over this batch's valid tokens, with the algorithm's own (``PerToken.metrics``).
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
    surrogate = algo.surrogate(algo, logprobs, old_logprobs, advantages, maskf, o, old_entropy)
    per_token = surrogate.loss
    metrics: dict[str, torch.Tensor] = {}
    mode, cap = ("token_tis", o.tis_cap) if o.tis_cap is not None else (o.mismatch, o.mismatch_cap)
    if mode != "none":
        weight, mm = mismatch_weights(old_logprobs, rollout_logprobs, maskf, mode, cap)
        per_token = per_token * weight
        metrics.update(mm)
    bonus_mask = mask  # the tokens the entropy bonus acts on
    if o.top_entropy_quantile < 1:
        if entropy is None:
            raise ValueError("top_entropy_quantile < 1 needs the policy's entropy (entropy=)")
        keep = top_entropy_mask(entropy, maskf, o.top_entropy_quantile).to(maskf.dtype)  # [N, R]
        per_token = per_token * keep
        bonus_mask = maskf * keep
        with torch.no_grad():
            metrics["top_entropy/kept_frac"] = masked_mean(keep, maskf)
            metrics["top_entropy/entropy"] = masked_mean(entropy.detach(), bonus_mask)
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
            loss = loss - o.entropy_coef * aggregate(entropy, bonus_mask, o.agg, **norm)
        metrics["entropy"] = masked_mean(entropy.detach(), maskf)

    with torch.no_grad():
        metrics.update(_clip_metrics(surrogate.up, surrogate.down, old_logprobs, mask))
        metrics.update(surrogate.metrics)
        metrics["loss"] = loss.detach()
        # k3 estimate of KL(pi_old || pi_theta) under old samples: r - 1 - log r >= 0.
        ratio, log_ratio = surrogate.ratio.detach(), surrogate.log_ratio.detach()
        metrics["approx_kl"] = masked_mean(ratio - 1.0 - log_ratio, maskf)
    return loss, metrics


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
