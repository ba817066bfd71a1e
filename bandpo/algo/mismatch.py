"""Correction of the rollout/trainer mismatch: one family of detached per-token weights.

The rollout engine samples from pi_rollout, not from the actor's pi_old (different kernels, bf16),
so the loss is an expectation under the wrong distribution. With the per-token importance ratio
k = pi_old / pi_rollout = exp(old_logprobs - rollout_logprobs) and the sequence's K = prod_t k_t,
each mode multiplies the per-token loss by a weight w (no gradient through w):

    token_tis   w = min(k, C)                           truncated IS (Yao et al. 2025, "Your efficient
                                                        RL framework secretly brings you off-policy RL")
    seq_tis     w = min(K, C) on every token of the sequence
    token_mis   w = k if k <= C else 0                  masked IS: drop, do not truncate
    seq_mis     w = K if K <= C else 0                  (the whole sequence is dropped)
    icepop      w = k if 1/C <= k <= C else 0           IcePop (Ling team 2025, Ring-1T): two-sided
                                                        token mask, "beta" = C

Truncation keeps a biased gradient from every token; masking drops the tokens (sequences) whose
engines disagree most and keeps the rest unbiased. ``algorithm.tis_cap = C`` is ``token_tis``.
K is formed in log space (sum of log k) and compared with log C, so it neither overflows nor
underflows into a wrong decision. Padded positions get log k = 0 (a -inf rollout logprob there must
not make NaN).
"""

from __future__ import annotations

import math

import torch

from bandpo.errors import check_number

MISMATCH_MODES = ("none", "token_tis", "seq_tis", "token_mis", "seq_mis", "icepop")
TRUNCATING = ("token_tis", "seq_tis")
# Quantiles of log k logged every step (bandpo.trainer.step_metrics).
LOG_RATIO_QUANTILES = (0.01, 0.5, 0.99)


def check_cap(cap, name: str = "tis_cap") -> None:
    """The cap C of every mode (``tis_cap``, ``mismatch_cap``; ``algorithm.tis_cap``, ``algorithm.mismatch.cap``)
    is a finite number >= 1: the weights are truncated or masked above C (and IcePop's below 1/C)."""
    check_number(cap, name, low=1)


def check_one_correction(tis_cap, mode: str, names: tuple[str, str] = ("tis_cap", "mismatch")) -> None:
    """``tis_cap`` is token-level TIS, ``mode=token_tis`` with that cap: it cannot be combined with
    another mode (``mode`` other than ``none``); the two are one correction."""
    if tis_cap is not None and mode != "none":
        raise ValueError(
            f"{names[0]} is token-level TIS ({names[1]}=token_tis) and cannot be combined with "
            f"{names[1]}={mode!r}; set only one of the two, got {names[0]}={tis_cap!r}"
        )


def mismatch_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor | None,
    maskf: torch.Tensor,
    mode: str,
    cap: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Detached weights w [N, R] of ``mode`` (see the module docstring) and their metrics.

    Args:
        old_logprobs, rollout_logprobs: [N, R] log pi_old and log pi_rollout of the sampled tokens.
        maskf: [N, R] 1.0 for valid tokens.
        mode, cap: one of ``MISMATCH_MODES`` other than ``none``; C >= 1.

    Returns:
        ``(w, metrics)``; metrics over valid tokens: truncating modes ``tis/weight_mean`` and
        ``tis/truncated_frac``, masking modes ``mis/weight_mean`` and ``mis/masked_frac``.
    """
    if mode not in MISMATCH_MODES or mode == "none":
        raise ValueError(f"unknown mismatch mode {mode!r}; valid: {', '.join(MISMATCH_MODES[1:])}")
    if rollout_logprobs is None:
        raise ValueError(
            f"mismatch correction {mode!r} needs rollout_logprobs (the rollout engine's logprobs)"
        )
    check_cap(cap, "mismatch cap")
    log_cap = math.log(cap)
    with torch.no_grad():
        valid = maskf > 0
        log_k = torch.where(valid, old_logprobs.detach() - rollout_logprobs.detach(), 0.0)  # [N, R]
        if mode.startswith("seq"):
            log_k = log_k.sum(-1, keepdim=True).expand_as(log_k)  # log K on every token of the row
        if mode in TRUNCATING:
            weight = torch.exp(log_k.clamp(max=log_cap))
            cut = log_k > log_cap
            prefix, share = "tis", "truncated_frac"
        else:
            keep = log_k <= log_cap
            if mode == "icepop":
                keep &= log_k >= -log_cap
            weight = torch.exp(log_k.clamp(max=log_cap)) * keep
            cut = ~keep
            prefix, share = "mis", "masked_frac"
        weight = weight.to(old_logprobs.dtype)
        metrics = {
            f"{prefix}/weight_mean": masked_mean(weight, maskf),
            f"{prefix}/{share}": masked_mean(cut.to(maskf.dtype), maskf),
        }
    return weight, metrics


def tis_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor | None, cap: float, maskf: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token TIS, w = min(exp(old - rollout), cap), detached [N, R]: ``(w, mean w, fraction truncated)``."""
    if rollout_logprobs is None:
        raise ValueError("tis_cap needs rollout_logprobs (the rollout engine's sampling logprobs)")
    check_cap(cap)
    w, m = mismatch_weights(old_logprobs, rollout_logprobs, maskf, "token_tis", cap)
    return w, m["tis/weight_mean"], m["tis/truncated_frac"]


def mismatch_stats(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Summary of log k = log pi_old - log pi_rollout over the valid tokens (mask [N, R]): mean,
    mean |log k| and the ``LOG_RATIO_QUANTILES``; empty when no token is valid."""
    valid = mask.bool()
    log_k = (old_logprobs - rollout_logprobs)[valid].double()
    if log_k.numel() == 0:
        return {}
    qs = _quantiles(log_k, LOG_RATIO_QUANTILES)
    out = {
        "mismatch/log_ratio_mean": log_k.mean().item(),
        "mismatch/log_ratio_abs_mean": log_k.abs().mean().item(),
    }
    out.update({f"mismatch/log_ratio_p{round(q * 100):02d}": v for q, v in zip(LOG_RATIO_QUANTILES, qs)})
    return out


def _quantiles(x: torch.Tensor, qs: tuple[float, ...]) -> list[float]:
    """Linear-interpolation quantiles of a 1-d tensor (torch.quantile's default rule, without its
    2^24-element limit)."""
    v = x.sort().values
    n = v.numel()
    out = []
    for q in qs:
        pos = q * (n - 1)
        i = min(int(pos), n - 1)
        j = min(i + 1, n - 1)
        out.append((v[i] + (pos - i) * (v[j] - v[i])).item())
    return out


def masked_mean(x: torch.Tensor, maskf: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the tokens where ``maskf`` (floats, [N, R]) is 1; 0 where none is (losses' metrics too)."""
    return (x * maskf).sum() / maskf.sum().clamp(min=1.0)
