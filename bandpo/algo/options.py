"""The run's loss options: ``LossOptions``, the frozen record ``bandpo.algo.losses.policy_loss`` takes,
validated once when it is built (against the chosen algorithm's entry in ``bandpo.algo.registry``: the
options it does not read are refused by name), and the checks the config shares with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from bandpo.algo.adaptive import ADAPTIVE_MODES
from bandpo.algo.algorithm import SCOPED_OPTIONS
from bandpo.algo.band import check_eps, check_upper_cap
from bandpo.algo.cov import check_cov_options
from bandpo.algo.entropy_bonus import EntropyControl, check_combinable, check_quantile
from bandpo.algo.mismatch import MISMATCH_MODES, check_cap, check_one_correction
from bandpo.algo.registry import ALGORITHMS, check_applies, get_algorithm
from bandpo.algo.rivals import check_ratio_cap, check_tau
from bandpo.errors import check_choice, check_number

# ALGORITHMS, check_applies and get_algorithm live in bandpo.algo.registry; still importable from here,
# where callers found them before the registry.
__all__ = [
    "AGG_MODES",
    "ALGORITHMS",
    "KL_ESTIMATORS",
    "LossOptions",
    "check_agg",
    "check_applies",
    "check_dual_clip",
    "get_algorithm",
]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")


def check_dual_clip(dual_clip, name: str = "dual_clip") -> None:
    """The dual clip's c caps a negative-advantage token's loss at -A c: None (off) or a finite number > 1."""
    if dual_clip is not None:
        check_number(dual_clip, name, low=1, strict_low=True)


def check_agg(algorithm: str, agg: str, name: str = "agg") -> None:
    """``agg`` is one of ``AGG_MODES``, and the one the algorithm's objective allows where it allows one
    (``Algorithm.agg``: gspo's objective is per sequence, so it takes ``seq-mean-token-mean`` only)."""
    check_choice(agg, AGG_MODES, name)
    only = get_algorithm(algorithm).agg
    if only is not None and agg != only[0]:
        raise ValueError(f"{name} must be {only[0]} with algorithm={algorithm} ({only[1]}), got {agg!r}")


@dataclass(frozen=True)
class LossOptions:
    """Every option of ``policy_loss``, validated once when the record is built.

    Attributes:
        algorithm: a name of ``bandpo.algo.registry.ALGORITHMS``.
        eps_low, eps_high: override the algorithm's thresholds (and bandpo's relax interval).
        divergence, delta, relax_high_p: band options (bandpo only), see ``band_bounds``.
        upper_cap: ceiling of the per-token upper bound (bandpo and dcpo only); None = none.
        dual_clip: c > 1 caps the loss of negative-advantage tokens at -A c; None disables.
        agg: aggregation mode (``AGG_MODES``).
        norm_len: ``seq-mean-token-sum-norm``'s constant length (Dr. GRPO: the rollout's
            max_tokens); None = the ``max_len`` the caller passes (the mini-batch's longest).
        kl_coef, kl_estimator: weight and estimator (k1 | k2 | k3) of KL(pi || pi_ref).
        entropy_coef: weight of the entropy bonus (subtracted from the loss).
        band_adaptive: ``none`` | ``entropy`` (bandpo only): per-token radius
            ``adaptive_delta(old_entropy, delta_min, delta_max, entropy_scale, entropy_norm)``;
            ``delta`` is then unused.
        delta_min, delta_max, entropy_norm, entropy_scale: see ``bandpo.algo.adaptive``
            (``entropy_scale`` is per step with the ``batch`` norm: ``dataclasses.replace`` it).
        tis_cap: C >= 1 turns on token-level truncated importance sampling, w = min(exp(old - rollout), C)
            (the same as ``mismatch="token_tis"``, ``mismatch_cap=C``).
        mismatch, mismatch_cap: rollout/trainer mismatch correction (``bandpo.algo.mismatch``), C >= 1.
        ratio_cap: dppo_* only: C of the truncated ratio min(r, C); None = no truncation.
        tau_pos, tau_neg: sapo only: the gate temperatures; None = the paper's 1.0 and 1.05.
        cov_ratio: clip_cov and kl_cov: the share of a micro-batch's valid tokens they select; None = 2e-4.
        clip_cov_lb, clip_cov_ub: clip_cov only: the covariance band of its candidates; None = 1 and 5.
        kl_cov_coef: kl_cov only: the weight of |log r| on its selected tokens; None = 1
            (``bandpo.algo.cov``).
        top_entropy_quantile: rho: the loss keeps the top-rho fraction of tokens by entropy (needs
            ``entropy``); 1 = every token (``bandpo.algo.entropy_bonus``).
        entropy_control: the adaptive bonus' settings (``EntropyControl``), or None: read by the trainer,
            which sets ``entropy_coef`` per step; ``policy_loss`` reads only ``entropy_coef``.
    """

    algorithm: str = "bandpo"
    eps_low: float | None = None
    eps_high: float | None = None
    divergence: str = "kl"
    delta: float = 0.05
    upper_cap: float | None = None
    relax_high_p: bool = False
    dual_clip: float | None = 10.0
    agg: str = "seq-mean-token-mean"
    norm_len: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    band_adaptive: str = "none"
    delta_min: float | None = None
    delta_max: float | None = None
    entropy_norm: str = "batch"
    entropy_scale: float | None = None
    tis_cap: float | None = None
    mismatch: str = "none"
    mismatch_cap: float = 2.0
    ratio_cap: float | None = None
    tau_pos: float | None = None
    tau_neg: float | None = None
    cov_ratio: float | None = None
    clip_cov_lb: float | None = None
    clip_cov_ub: float | None = None
    kl_cov_coef: float | None = None
    top_entropy_quantile: float = 1.0
    entropy_control: EntropyControl | None = None

    def __post_init__(self):
        get_algorithm(self.algorithm)
        check_agg(self.algorithm, self.agg)
        check_choice(self.kl_estimator, KL_ESTIMATORS, "kl_estimator")
        check_dual_clip(self.dual_clip)
        if self.tis_cap is not None:
            check_cap(self.tis_cap)
        check_choice(self.mismatch, MISMATCH_MODES, "mismatch")
        check_cap(self.mismatch_cap, "mismatch_cap")
        check_one_correction(self.tis_cap, self.mismatch)
        check_choice(self.band_adaptive, ADAPTIVE_MODES, "band_adaptive")
        for option in SCOPED_OPTIONS:  # options another algorithm reads are refused by name, not ignored
            value = getattr(self, option)
            if value is not None and value != _UNSET.get(option):
                check_applies(self.algorithm, option)
        check_eps(self.eps_low, self.eps_high)
        check_upper_cap(self.upper_cap, "upper_cap")
        check_ratio_cap(self.ratio_cap)
        for option in ("tau_pos", "tau_neg"):
            check_tau(getattr(self, option), option)
        algo = get_algorithm(self.algorithm)  # the band's bounds as the surrogate resolves them
        check_cov_options(
            self.cov_ratio,
            algo.resolve("clip_cov_lb", self.clip_cov_lb),
            algo.resolve("clip_cov_ub", self.clip_cov_ub),
            self.kl_cov_coef,
        )
        check_quantile(self.top_entropy_quantile)
        if self.top_entropy_quantile < 1:
            check_combinable(self.algorithm, "top_entropy_quantile")
        if self.entropy_control is not None:
            if not isinstance(self.entropy_control, EntropyControl):
                raise TypeError(
                    f"entropy_control must be an EntropyControl, got {type(self.entropy_control).__name__}"
                )
            check_combinable(self.algorithm, "entropy_control")


# The value of a ``SCOPED_OPTIONS`` field that means "not set", where it is not None.
_UNSET = {"relax_high_p": False, "band_adaptive": "none"}
