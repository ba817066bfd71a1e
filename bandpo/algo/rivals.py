"""Per-token surrogates of the methods BandPO is compared with: DPPO, GSPO, CISPO, SAPO.

Each function returns ``(L, up, down)``: the per-token loss L [N, R] (aggregated, weighted and
regularised by ``bandpo.algo.losses.policy_loss`` exactly as the clipped surrogate is), and two
boolean masks [N, R] of the tokens whose update the method cut: ``up`` where the policy moved past
the upper limit, ``down`` past the lower one (the analogue of the clip fractions).

Notation: r = pi_theta / pi_old per token (log-ratio clamped to [-20, 20] before exp, as the
clipped surrogate does), A the advantage, sg() stop-gradient, p = pi_theta(token), p' = pi_old(token).
Where a method's gradient is sg(w) * A * grad log pi, L is written as -A sg(w) (1 + log pi - sg(log pi)):
its value is -A w (the surrogate at this point, comparable with the clipped losses) and its gradient
is -A w grad log pi, the method's. verl writes -A sg(w) log pi instead: the same gradient, a value
shifted by log pi.

Each method's registry entry (``bandpo.algo.algorithm.Algorithm``: its thresholds from its paper's recipe
and the options it reads) closes the module.
"""

from __future__ import annotations

from functools import partial

import torch

from bandpo.algo.algorithm import Algorithm, PerToken
from bandpo.errors import check_number

# SAPO's recipe temperatures (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347):
# negative-advantage tokens get a slightly sharper gate.
SAPO_TAU_POS = 1.0
SAPO_TAU_NEG = 1.05
# GSPO's sequence log-ratio is clamped above before exp (stability; the clip binds long before).
GSPO_MAX_LOG_RATIO = 10.0
_EPS = 1e-8  # floor of 1 - p in the binary KL (p -> 1)


def check_ratio_cap(ratio_cap, name: str = "ratio_cap") -> None:
    """DPPO's truncation C of the ratio, min(r, C) (``dppo_loss``): None (no truncation) or a finite number > 0."""
    if ratio_cap is not None:
        check_number(ratio_cap, name, low=0, strict_low=True)


def check_tau(tau, name: str = "tau") -> None:
    """A SAPO gate temperature (``sapo_loss``' tau_pos / tau_neg): None (the recipe's) or a finite number > 0."""
    if tau is not None:
        check_number(tau, name, low=0, strict_low=True)


def _ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    return torch.exp((logprobs - old_logprobs).clamp(-20.0, 20.0))


def _score(logprobs: torch.Tensor) -> torch.Tensor:
    """1 in value, grad log pi in gradient."""
    return 1.0 + logprobs - logprobs.detach()


def dppo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    divergence: str,
    eps_low: float,
    eps_high: float,
    ratio_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPPO-Binary-TV / -KL (Qi et al. 2026, "Rethinking the Trust Region in LLM RL", arXiv 2602.04879).

    The ratio clip is replaced by a mask on the divergence between the old and new Bernoulli
    distributions of the sampled token (is it this token or not):

        D_tv = p - p'                                         (signed)
        D_kl = p' log(p'/p) + (1 - p') log((1 - p') / (1 - p))
        M    = 0 where A > 0 and the token rose past the region:  tv: D_tv > eps_high;  kl: D_kl > eps_high, p > p'
               0 where A <= 0 and it fell past the region:        tv: D_tv < -eps_low;  kl: D_kl > eps_low,  p < p'
               1 otherwise (moving back into the region is never cut, as in PPO)
        L    = -A sg(min(r, C)) M (1 + log pi - sg(log pi))     gradient -A min(r, C) M grad log pi = -A M grad r

    C (``ratio_cap``, the paper's truncated importance sampling in place of the dual clip, sec. 5.4)
    None = no truncation. Recipe thresholds: tv 0.15, kl 0.05, C 1e4 (examples/dppo_trainer in verl).
    Shapes: every tensor [N, R] (advantages broadcast).
    """
    ratio = _ratio(logprobs, old_logprobs).detach()
    with torch.no_grad():
        p, p_old = torch.exp(logprobs.detach()), torch.exp(old_logprobs)
        rose, fell = p > p_old, p < p_old
        if divergence == "tv":
            up, down = (p - p_old) > eps_high, (p - p_old) < -eps_low
        elif divergence == "kl":
            d = p_old * (old_logprobs - logprobs.detach()) + (1.0 - p_old) * (
                torch.log((1.0 - p_old).clamp(min=_EPS)) - torch.log((1.0 - p).clamp(min=_EPS))
            )
            up, down = (d > eps_high) & rose, (d > eps_low) & fell
        else:
            raise ValueError(f"unknown DPPO divergence {divergence!r}; valid: tv, kl")
        # The loss masks A <= 0 with the lower test (A = 0 carries no gradient either way); the
        # fractions count A < 0 only, like the clip's, so that zero-advantage groups do not inflate them.
        positive = advantages > 0
        up, down = up & positive, down & ~positive
        weight = ratio if ratio_cap is None else ratio.clamp(max=ratio_cap)
        weight = weight * ~(up | down)
    return -advantages * weight * _score(logprobs), up, down & (advantages < 0)


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    maskf: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071; Qwen3).

    The ratio is the sequence's, length-normalised, and the clip acts on whole sequences:

        s_i      = exp( (1/|y_i|) sum_t log(pi_theta / pi_old)(y_i,t) )
        s_i,t    = sg(s_i) pi_theta(y_i,t) / sg(pi_theta(y_i,t))        (GSPO-token: value s_i)
        L_i,t    = max(-A s_i,t, -A clip(s_i,t, 1 - eps_low, 1 + eps_high))

    Averaged per sequence (``seq-mean-token-mean``, the only aggregation GSPO allows) L_i,t gives
    the paper's per-sequence objective and gradient. Recipe: eps_low 3e-4, eps_high 4e-4.
    Shapes: tensors [N, R], ``maskf`` [N, R] the valid tokens as floats.
    """
    with torch.no_grad():
        seq_log = ((logprobs.detach() - old_logprobs) * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0)  # [N]
    log_s = (logprobs - logprobs.detach() + seq_log.unsqueeze(-1)).clamp(max=GSPO_MAX_LOG_RATIO)
    s = torch.exp(log_s)
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    per_token = torch.maximum(-advantages * s, -advantages * s.clamp(lo, hi))
    with torch.no_grad():
        positive = advantages > 0
        up, down = (s > hi) & positive, (s < lo) & (advantages < 0)
    return per_token, up, down


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax 2025, "MiniMax-M1", arXiv 2506.13585, eq. 4-5): clip the importance weight,
    never the token.

        w = sg(clip(r, 1 - eps_low, 1 + eps_high))
        L = -A w (1 + log pi - sg(log pi))                gradient -A w grad log pi

    Every token keeps a gradient (scaled by w); ``up`` / ``down`` mark the tokens with A != 0 whose
    weight was clipped (r > 1 + eps_high, r < 1 - eps_low), whatever the sign of A. The paper sets no lower
    bound (eps_low = 1: 1 - eps_low = 0) and tunes eps_high; it does not publish the value.
    Shapes: every tensor [N, R].
    """
    with torch.no_grad():
        ratio = _ratio(logprobs.detach(), old_logprobs)
        lo, hi = 1.0 - eps_low, 1.0 + eps_high
        moved = advantages != 0
        up, down = (ratio > hi) & moved, (ratio < lo) & moved
        weight = ratio.clamp(lo, hi)
    return -advantages * weight * _score(logprobs), up, down


def sapo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    tau_pos: float = SAPO_TAU_POS,
    tau_neg: float = SAPO_TAU_NEG,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347): a smooth gate
    in place of the hard clip.

        tau = tau_pos where A > 0, tau_neg otherwise
        f(r) = (4 / tau) sigmoid(tau (r - 1));   L = -A f(r)

    df/dr = 4 sigmoid (1 - sigmoid) is 1 at r = 1 (the unclipped gradient on-policy) and decays
    smoothly away from it, so no token's gradient is cut to zero: ``up`` / ``down`` are all False.
    Recipe: tau_pos 1.0, tau_neg 1.05. Shapes: every tensor [N, R].
    """
    ratio = _ratio(logprobs, old_logprobs)
    # Scalars as tensors of the ratio's dtype (a Python float in torch.where would be float32).
    tau = torch.where(advantages > 0, ratio.new_tensor(tau_pos), ratio.new_tensor(tau_neg)).detach()
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    none = torch.zeros_like(ratio, dtype=torch.bool)
    return -advantages * gate, none, none


# ------------------------------------------------------------------------ registry entries
# Their surrogates (``bandpo.algo.algorithm``'s contract) call each loss above with the run's options, the
# algorithm's defaults where the run leaves them None.


def _per_token(loss_up_down: tuple[torch.Tensor, ...], logprobs, old_logprobs) -> PerToken:
    """A rival's ``(L, up, down)`` as a ``PerToken``, with the clamped ratio ``approx_kl`` reads (computed
    without grad: the rival's gradient is in L)."""
    with torch.no_grad():
        log_ratio = (logprobs.detach() - old_logprobs).clamp(-20.0, 20.0)
        ratio = torch.exp(log_ratio)
    return PerToken(*loss_up_down, ratio, log_ratio, {})


def _thresholds(algo: Algorithm, options) -> dict[str, float]:
    return {
        "eps_low": algo.resolve("eps_low", options.eps_low),
        "eps_high": algo.resolve("eps_high", options.eps_high),
    }


def _dppo(divergence: str, algo, logprobs, old_logprobs, advantages, maskf, options, old_entropy) -> PerToken:
    out = dppo_loss(
        logprobs,
        old_logprobs,
        advantages,
        divergence=divergence,
        ratio_cap=options.ratio_cap,
        **_thresholds(algo, options),
    )
    return _per_token(out, logprobs, old_logprobs)


def _gspo(algo, logprobs, old_logprobs, advantages, maskf, options, old_entropy) -> PerToken:
    out = gspo_loss(logprobs, old_logprobs, advantages, maskf, **_thresholds(algo, options))
    return _per_token(out, logprobs, old_logprobs)


def _cispo(algo, logprobs, old_logprobs, advantages, maskf, options, old_entropy) -> PerToken:
    out = cispo_loss(logprobs, old_logprobs, advantages, **_thresholds(algo, options))
    return _per_token(out, logprobs, old_logprobs)


def _sapo(algo, logprobs, old_logprobs, advantages, maskf, options, old_entropy) -> PerToken:
    out = sapo_loss(
        logprobs,
        old_logprobs,
        advantages,
        tau_pos=algo.resolve("tau_pos", options.tau_pos),
        tau_neg=algo.resolve("tau_neg", options.tau_neg),
    )
    return _per_token(out, logprobs, old_logprobs)


_THRESHOLDS = frozenset({"eps_low", "eps_high"})
# The recipes' thresholds (each loss' docstring); none of these surrogates has a dual clip.
DPPO_TV = Algorithm(
    "dppo_tv", partial(_dppo, "tv"), _THRESHOLDS | {"ratio_cap"}, {"eps_low": 0.15, "eps_high": 0.15}
)
DPPO_KL = Algorithm(
    "dppo_kl", partial(_dppo, "kl"), _THRESHOLDS | {"ratio_cap"}, {"eps_low": 0.05, "eps_high": 0.05}
)
GSPO = Algorithm(
    "gspo",
    _gspo,
    _THRESHOLDS,
    {"eps_low": 3e-4, "eps_high": 4e-4},
    agg=("seq-mean-token-mean", "its objective is per sequence"),
)
CISPO = Algorithm("cispo", _cispo, _THRESHOLDS, {"eps_low": 1.0, "eps_high": 0.28})
SAPO = Algorithm(
    "sapo",
    _sapo,
    frozenset({"tau_pos", "tau_neg"}),
    {"tau_pos": SAPO_TAU_POS, "tau_neg": SAPO_TAU_NEG},
    why_not=dict.fromkeys(_THRESHOLDS, "sapo's soft gate has no clip"),
)

# In the registry's order (bandpo.algo.registry).
ENTRIES = (DPPO_TV, DPPO_KL, GSPO, CISPO, SAPO)
