"""Covariance-based entropy control, Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of
Reinforcement Learning for Reasoning Language Models", arXiv 2505.22617), and ``no_clip``, the control
that leaves the ratio unclipped.

The paper traces entropy collapse to the tokens whose log-probability and advantage covary most: a
confident token (high log pi) with a high advantage pushes the entropy down when it is reinforced. Per
micro-batch, over its valid tokens (means over the valid tokens, log pi detached):

    cov_t = (A_t - mean A) (log pi_t - mean log pi)
    k     = max(1, floor(cov_ratio * n_valid))

Clip-Cov: the clipped surrogate (grpo's interval, eps 0.2 / 0.2, no dual clip in the recipe); among the
valid tokens the interval did not clip, those with clip_cov_lb < cov_t < clip_cov_ub (strict) are
candidates, and k of them drawn at random lose their gradient (loss x 0). The draw: the candidates in
row-major order, ``torch.randperm(n_candidates)`` on the global CPU generator (or the ``generator``
given), the first k of the permutation (all of them when there are fewer than k).

KL-Cov: no clip, L = -A r everywhere; the k tokens with the largest cov_t get a penalty on the
log-ratio, L = -A r + kl_cov_coef |log pi - log pi_old|. Ties: a stable descending sort of cov_t, so
between equal covariances the earlier token (row-major) is taken.

no_clip: L = -A r for every token: the surrogate with the ratio left unclipped, the control that a
study of the clip's (or the covariance methods') effect pairs with the others.

Defaults (the paper's and verl's): cov_ratio 2e-4, band (1, 5), kl_cov_coef 1. The selection is per
micro-batch (as in verl: its policy loss is called per micro-batch), so k and the centring means are a
micro-batch's. r = exp(clamp(log pi - log pi_old, -20, 20)) as in every surrogate here (verl does not
clamp; the two agree wherever |log r| <= 20). The selection needs the candidate count on the host: one
synchronisation per micro-batch, as in verl.
"""

from __future__ import annotations

import torch

from bandpo.algo.algorithm import Algorithm, PerToken
from bandpo.algo.clipped import CLIPPED_READS, clipped_surrogate, fixed_interval
from bandpo.algo.mismatch import masked_mean
from bandpo.errors import check_number

# The paper's defaults (section 4, and verl's policy_loss config).
COV_RATIO = 2e-4
CLIP_COV_LB = 1.0
CLIP_COV_UB = 5.0
KL_COV_COEF = 1.0


def check_cov_options(
    cov_ratio=None, clip_cov_lb=None, clip_cov_ub=None, kl_cov_coef=None, names=None
) -> None:
    """The covariance methods' options, each None (unset) or: cov_ratio in (0, 1], the band's bounds
    finite with lb < ub, kl_cov_coef >= 0. ``names`` maps an option to the name a message shows."""
    names = names or {}
    name = names.get
    if cov_ratio is not None:
        check_number(cov_ratio, name("cov_ratio", "cov_ratio"), low=0, strict_low=True, high=1)
    for option, value in (("clip_cov_lb", clip_cov_lb), ("clip_cov_ub", clip_cov_ub)):
        if value is not None:
            check_number(value, name(option, option))
    if clip_cov_lb is not None and clip_cov_ub is not None and not clip_cov_lb < clip_cov_ub:
        raise ValueError(
            f"{name('clip_cov_lb', 'clip_cov_lb')} must be < {name('clip_cov_ub', 'clip_cov_ub')}, "
            f"got {clip_cov_lb!r} and {clip_cov_ub!r}"
        )
    if kl_cov_coef is not None:
        check_number(kl_cov_coef, name("kl_cov_coef", "kl_cov_coef"), low=0)


def token_covariance(logprobs: torch.Tensor, advantages: torch.Tensor, maskf: torch.Tensor) -> torch.Tensor:
    """cov_t [N, R] (module docstring), no grad; its values at padding are meaningless (callers mask)."""
    with torch.no_grad():
        logp = logprobs.detach()
        return (advantages - masked_mean(advantages, maskf)) * (logp - masked_mean(logp, maskf))


def selection_count(cov_ratio: float, n_valid: int) -> int:
    """k = max(1, floor(cov_ratio * n_valid)): how many tokens a covariance method selects."""
    return max(int(cov_ratio * n_valid), 1)


def clip_cov_selection(
    cov: torch.Tensor,
    candidates: torch.Tensor,
    k: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Clip-Cov's draw: boolean [N, R], k of the ``candidates`` (boolean [N, R]) at random, or all of
    them when there are fewer. Row-major candidates, ``torch.randperm`` on the CPU (global generator, or
    ``generator``), its first k entries; ``cov`` gives the device."""
    idx = torch.nonzero(candidates)  # [n_candidates, 2], row-major
    chosen = torch.zeros_like(candidates)
    if len(idx) == 0:
        return chosen
    perm = torch.randperm(len(idx), generator=generator)  # CPU, as the draw the paper's code makes
    idx = idx[perm[: min(k, len(idx))].to(cov.device)]
    chosen[idx[:, 0], idx[:, 1]] = True
    return chosen


def kl_cov_selection(cov: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """KL-Cov's choice: boolean [N, R], the k valid tokens of largest ``cov`` (stable descending sort:
    the earlier token, row-major, first among equals); none when no token is valid."""
    chosen = torch.zeros_like(valid)
    flat_idx = torch.nonzero(valid.reshape(-1)).squeeze(-1)  # [n_valid], row-major
    if flat_idx.numel() == 0:
        return chosen
    order = torch.sort(cov.reshape(-1)[flat_idx], descending=True, stable=True).indices
    chosen.view(-1)[flat_idx[order[:k]]] = True
    return chosen


def _valid_count(maskf: torch.Tensor) -> int:
    return int(maskf.sum().item())


def clip_cov_tokens(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    maskf: torch.Tensor,
    clipped: torch.Tensor,
    cov_ratio: float,
    lb: float,
    ub: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip-Cov's ``(chosen, candidates)``, boolean [N, R]: the candidates are the valid tokens not
    ``clipped`` (by the interval) with lb < cov < ub; ``chosen`` the draw among them (``clip_cov_selection``)."""
    with torch.no_grad():
        cov = token_covariance(logprobs, advantages, maskf)
        candidates = (cov > lb) & (cov < ub) & maskf.bool() & ~clipped
        chosen = clip_cov_selection(cov, candidates, selection_count(cov_ratio, _valid_count(maskf)))
    return chosen, candidates


def kl_cov_tokens(
    logprobs: torch.Tensor, advantages: torch.Tensor, maskf: torch.Tensor, cov_ratio: float
) -> torch.Tensor:
    """KL-Cov's chosen tokens, boolean [N, R] (``kl_cov_selection``)."""
    with torch.no_grad():
        cov = token_covariance(logprobs, advantages, maskf)
        return kl_cov_selection(cov, maskf.bool(), selection_count(cov_ratio, _valid_count(maskf)))


def _clip_cov(algo, logprobs, old_logprobs, advantages, maskf, options, old_entropy) -> PerToken:
    """Clip-Cov (module docstring). Metrics: ``cov/selected_frac`` (valid tokens whose gradient the
    covariance clip removed: verl's ``pg_clipfrac``), ``cov/candidate_frac`` (valid tokens in the band),
    ``cov/kl_k1`` (mean log pi_old - log pi: verl's ``ppo_kl``)."""
    base = clipped_surrogate(algo, logprobs, old_logprobs, advantages, maskf, options, old_entropy)
    # tokens the interval already clipped have no gradient to remove
    chosen, candidates = clip_cov_tokens(
        logprobs,
        advantages,
        maskf,
        base.up | base.down,
        algo.resolve("cov_ratio", options.cov_ratio),
        algo.resolve("clip_cov_lb", options.clip_cov_lb),
        algo.resolve("clip_cov_ub", options.clip_cov_ub),
    )
    with torch.no_grad():
        metrics = dict(base.metrics)
        metrics["cov/selected_frac"] = masked_mean(chosen.to(maskf.dtype), maskf)
        metrics["cov/candidate_frac"] = masked_mean(candidates.to(maskf.dtype), maskf)
        metrics["cov/kl_k1"] = masked_mean(old_logprobs - logprobs.detach(), maskf)
    loss = base.loss * (~chosen).to(base.loss.dtype)
    return PerToken(loss, base.up, base.down, base.ratio, base.log_ratio, metrics)


def _kl_cov(algo, logprobs, old_logprobs, advantages, maskf, options, old_entropy) -> PerToken:
    """KL-Cov (module docstring). Metrics: ``cov/selected_frac`` (valid tokens given the penalty),
    ``cov/abs_log_ratio`` (mean |log r|: verl's ``ppo_kl`` for KL-Cov). Nothing is clipped: ``up`` /
    ``down`` are all False."""
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    valid = maskf.bool()
    chosen = kl_cov_tokens(logprobs, advantages, maskf, algo.resolve("cov_ratio", options.cov_ratio))
    abs_log_ratio = (logprobs - old_logprobs).abs()
    coef = algo.resolve("kl_cov_coef", options.kl_cov_coef)
    per_token = -advantages * ratio
    per_token = torch.where(chosen, per_token + coef * abs_log_ratio, per_token)
    with torch.no_grad():
        metrics = {
            "cov/selected_frac": masked_mean(chosen.to(maskf.dtype), maskf),
            "cov/abs_log_ratio": masked_mean(abs_log_ratio.detach(), maskf),
        }
    none = torch.zeros_like(valid)
    return PerToken(per_token, none, none, ratio, log_ratio, metrics)


def _no_clip(algo, logprobs, old_logprobs, advantages, maskf, options, old_entropy) -> PerToken:
    """L = -A r, no token cut (``up`` / ``down`` all False)."""
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    none = torch.zeros_like(maskf, dtype=torch.bool)
    return PerToken(-advantages * ratio, none, none, ratio, log_ratio, {})


_CLIP = ("eps_low", "eps_high", "dual_clip")
CLIP_COV = Algorithm(
    "clip_cov",
    _clip_cov,
    CLIPPED_READS | {"cov_ratio", "clip_cov_lb", "clip_cov_ub"},
    {
        "eps_low": 0.2,
        "eps_high": 0.2,
        "cov_ratio": COV_RATIO,
        "clip_cov_lb": CLIP_COV_LB,
        "clip_cov_ub": CLIP_COV_UB,
    },
    bounds=fixed_interval,
)
KL_COV = Algorithm(
    "kl_cov",
    _kl_cov,
    frozenset({"cov_ratio", "kl_cov_coef"}),
    {"cov_ratio": COV_RATIO, "kl_cov_coef": KL_COV_COEF},
    why_not=dict.fromkeys(
        _CLIP,
        "kl_cov leaves the ratio unclipped: its penalty on the highest-covariance tokens replaces the clip",
    ),
)
NO_CLIP = Algorithm(
    "no_clip",
    _no_clip,
    frozenset(),
    why_not=dict.fromkeys(_CLIP, "no_clip is the control that leaves the ratio unclipped"),
)

# In the registry's order (bandpo.algo.registry).
ENTRIES = (CLIP_COV, KL_COV, NO_CLIP)
