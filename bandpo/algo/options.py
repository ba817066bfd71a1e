"""Which algorithms exist, and the run's loss options: the registry of algorithms by name (each
with its paper's thresholds), the options only some of them read, and ``LossOptions``, the frozen
record ``bandpo.algo.losses.policy_loss`` takes, validated once when it is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from bandpo.algo.adaptive import ADAPTIVE_MODES
from bandpo.algo.band import check_eps, check_upper_cap
from bandpo.algo.mismatch import MISMATCH_MODES, check_cap, check_one_correction
from bandpo.algo.rivals import check_ratio_cap, check_tau
from bandpo.errors import check_choice, check_number

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass(frozen=True)
class Algorithm:
    """An algorithm's surrogate and the defaults of its thresholds (from each paper's recipe).

    ``surrogate``: ``clip`` (the clipped surrogate with the interval [1 - eps_low, 1 + eps_high],
    the band with ``band``, DCPO's per-token bounds with ``dac``) or the name of a rival's loss. What
    ``eps_low``/``eps_high`` bound is the surrogate's: the ratio (clip, gspo: the sequence ratio, cispo:
    the weight), |r - 1| r q (dcpo), the divergence (dppo_*); None where the surrogate has none (sapo).
    """

    name: str
    eps_low: float | None
    eps_high: float | None
    band: bool = False
    surrogate: str = "clip"
    dac: bool = False


ALGORITHMS: dict[str, Algorithm] = {
    "grpo": Algorithm("grpo", 0.2, 0.2),
    "clip_higher": Algorithm("clip_higher", 0.2, 0.28),
    "bandpo": Algorithm("bandpo", 0.2, 0.28, band=True),
    "dppo_tv": Algorithm("dppo_tv", 0.15, 0.15, surrogate="dppo_tv"),
    "dppo_kl": Algorithm("dppo_kl", 0.05, 0.05, surrogate="dppo_kl"),
    "gspo": Algorithm("gspo", 3e-4, 4e-4, surrogate="gspo"),
    "cispo": Algorithm("cispo", 1.0, 0.28, surrogate="cispo"),
    "sapo": Algorithm("sapo", None, None, surrogate="sapo"),
    "dcpo": Algorithm("dcpo", 0.16, 0.20, dac=True),
}


def get_algorithm(name: str) -> Algorithm:
    check_choice(name, ALGORITHMS, "algorithm")
    return ALGORITHMS[name]


# Options that only some algorithms read: which ones, and why. Set for another algorithm such an option is
# refused by name (``check_applies``: ``LossOptions``, and the config's ``algorithm.*`` keys), never ignored.
OPTION_SCOPES: dict[str, tuple[Callable[[Algorithm], bool], str]] = {
    "eps_low": (lambda a: a.surrogate != "sapo", "sapo's soft gate has no clip"),
    "eps_high": (lambda a: a.surrogate != "sapo", "sapo's soft gate has no clip"),
    "dual_clip": (
        lambda a: a.surrogate == "clip",
        "the dual clip is the clipped surrogate's (grpo, clip_higher, bandpo, dcpo)",
    ),
    "upper_cap": (
        lambda a: a.band or a.dac,
        "it applies to bandpo (algorithm.band.upper_cap in the config) and dcpo only",
    ),
    "relax_high_p": (lambda a: a.band, "it applies to bandpo only"),
    "band_adaptive": (lambda a: a.band, "it applies to bandpo only"),
    "ratio_cap": (lambda a: a.surrogate.startswith("dppo"), "it applies to dppo_tv and dppo_kl only"),
    "tau_pos": (lambda a: a.surrogate == "sapo", "it applies to sapo only"),
    "tau_neg": (lambda a: a.surrogate == "sapo", "it applies to sapo only"),
}


def check_applies(algorithm: str, option: str, name: str | None = None) -> None:
    """Refuse ``option`` (a key of ``OPTION_SCOPES``, shown as ``name``), set, when ``algorithm`` does not read it."""
    reads, why = OPTION_SCOPES[option]
    if not reads(get_algorithm(algorithm)):
        raise ValueError(
            f"{name or option} does not apply to algorithm={algorithm} ({why}); set it to None "
            f"(null in the config) or pick another algorithm"
        )


def check_dual_clip(dual_clip, name: str = "dual_clip") -> None:
    """The dual clip's c caps a negative-advantage token's loss at -A c: None (off) or a finite number > 1."""
    if dual_clip is not None:
        check_number(dual_clip, name, low=1, strict_low=True)


def check_agg(algorithm: str, agg: str, name: str = "agg") -> None:
    """``agg`` is one of ``AGG_MODES``; gspo's objective is per sequence, so it takes ``seq-mean-token-mean`` only."""
    check_choice(agg, AGG_MODES, name)
    if get_algorithm(algorithm).surrogate == "gspo" and agg != "seq-mean-token-mean":
        raise ValueError(
            f"{name} must be seq-mean-token-mean with algorithm=gspo (its objective is per sequence), "
            f"got {agg!r}"
        )


@dataclass(frozen=True)
class LossOptions:
    """Every option of ``policy_loss``, validated once when the record is built.

    Attributes:
        algorithm: a name of ``ALGORITHMS``.
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
        for option in OPTION_SCOPES:  # options another surrogate reads are refused by name, not ignored
            value = getattr(self, option)
            if value is not None and value != _UNSET.get(option):
                check_applies(self.algorithm, option)
        check_eps(self.eps_low, self.eps_high)
        check_upper_cap(self.upper_cap, "upper_cap")
        check_ratio_cap(self.ratio_cap)
        for option in ("tau_pos", "tau_neg"):
            check_tau(getattr(self, option), option)


# The value of an ``OPTION_SCOPES`` field that means "not set", where it is not None.
_UNSET = {"relax_high_p": False, "band_adaptive": "none"}
