"""The run's loss options: ``LossOptions``, the frozen record ``bandpo.algo.losses.policy_loss`` takes,
validated once when it is built (against the chosen algorithm's entry in ``bandpo.algo.registry``: the
options it does not read are refused by name), and ``check_loss_options``, its rules written once: the
config runs the same function on the options it builds, naming each by its key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

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
    "check_loss_options",
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
        check_loss_options(vars(self))


def check_loss_options(values: Mapping[str, Any], names: Mapping[str, str] | None = None) -> None:
    """Every rule on the loss options (``values``: ``LossOptions``' fields by name), the one place each
    is checked: ``LossOptions`` runs it on itself, the config validation on the options it builds from
    ``algorithm.*`` (``bandpo.config.algorithm``). ``names``: how a message names each option (the
    config's keys; a field's own name where it has none); a field missing from ``values`` has its
    default. Raises ``ValueError``."""
    values = {**{f.name: f.default for f in fields(LossOptions)}, **values}
    names = names or {}

    def name(option: str) -> str:
        return names.get(option, option)

    algorithm = values["algorithm"]
    algo = get_algorithm(algorithm)
    check_agg(algorithm, values["agg"], name("agg"))
    check_choice(values["kl_estimator"], KL_ESTIMATORS, name("kl_estimator"))
    check_dual_clip(values["dual_clip"], name("dual_clip"))
    if values["tis_cap"] is not None:
        check_cap(values["tis_cap"], name("tis_cap"))
    check_choice(values["mismatch"], MISMATCH_MODES, name("mismatch"))
    check_cap(values["mismatch_cap"], name("mismatch_cap"))
    check_one_correction(values["tis_cap"], values["mismatch"], (name("tis_cap"), name("mismatch")))
    check_choice(values["band_adaptive"], ADAPTIVE_MODES, name("band_adaptive"))
    for option in SCOPED_OPTIONS:  # options another algorithm reads are refused by name, not ignored
        value = values[option]
        if value is not None and value != _UNSET.get(option):
            check_applies(algorithm, option, name(option))
    check_eps(values["eps_low"], values["eps_high"], (name("eps_low"), name("eps_high")))
    check_upper_cap(values["upper_cap"], name("upper_cap"))
    check_ratio_cap(values["ratio_cap"], name("ratio_cap"))
    for option in ("tau_pos", "tau_neg"):
        check_tau(values[option], name(option))
    cov = ("cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_coef")
    # the covariance band's bounds as the surrogate resolves them (its defaults where unset)
    check_cov_options(*(algo.resolve(o, values[o]) for o in cov), names={o: name(o) for o in cov})
    rho = values["top_entropy_quantile"]
    check_quantile(rho, name("top_entropy_quantile"))
    if rho < 1:
        check_combinable(algorithm, "top_entropy_quantile", name("top_entropy_quantile"))
    control = values["entropy_control"]
    if control is not None:
        if not isinstance(control, EntropyControl):
            raise TypeError(f"entropy_control must be an EntropyControl, got {type(control).__name__}")
        check_combinable(algorithm, "entropy_control", name("entropy_control"))
        coef = values["entropy_coef"]
        if not control.coef_min <= coef <= control.coef_max:
            raise ValueError(
                f"{name('entropy_coef')} (the adaptive bonus' starting value) must be within "
                f"[{name('entropy_coef_min')}, {name('entropy_coef_max')}] = "
                f"[{control.coef_min}, {control.coef_max}], got {coef!r}"
            )


# The value of a ``SCOPED_OPTIONS`` field that means "not set", where it is not None.
_UNSET = {"relax_high_p": False, "band_adaptive": "none"}
