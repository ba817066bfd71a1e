"""``algorithm.*``: its validation, and the run's ``LossOptions`` built from it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bandpo.config.keys import _check, _choice, _get, _number, _rule
from bandpo.errors import ConfigError

if TYPE_CHECKING:
    from bandpo.config.schema import TrainConfig


def band_algorithms() -> str:
    """The algorithms that read ``algorithm.band`` (from the registry), as an error message names them."""
    from bandpo.algo.registry import ALGORITHMS

    return " | ".join(n for n, a in ALGORITHMS.items() if a.band)


def band_delta_range(band) -> tuple[float, float]:
    """(delta_min, delta_max) of the adaptive band, nulls resolved to delta / 4 and 4 delta."""
    lo = band.delta / 4 if band.delta_min is None else band.delta_min
    hi = band.delta * 4 if band.delta_max is None else band.delta_max
    return float(lo), float(hi)


def loss_options(cfg: TrainConfig):
    """The run's ``LossOptions`` (``bandpo.algo.options``), built once from ``algorithm.*`` and
    ``rollout.max_tokens`` (Dr. GRPO's constant length). The adaptive band's ``entropy_scale`` is
    left None: it is known only per step (``batch``) or once the model is loaded (``logv``)."""
    from dataclasses import replace

    from bandpo.algo.options import LossOptions
    from bandpo.algo.registry import get_algorithm

    a = cfg.algorithm
    tis_cap = a.tis_cap
    if tis_cap is None and a.mismatch.mode == "none" and cfg.trainer.max_staleness > 0:
        from bandpo.trainer.overlap import STALE_TIS_CAP

        tis_cap = STALE_TIS_CAP  # decoupled PPO's behaviour correction (another mismatch mode replaces it)
    opts = LossOptions(
        algorithm=a.name,
        eps_low=_float(a.eps_low),
        eps_high=_float(a.eps_high),
        dual_clip=a.dual_clip,
        agg=a.loss_agg,
        norm_len=float(cfg.rollout.max_tokens),
        kl_coef=a.kl_coef,
        kl_estimator=a.kl_estimator,
        entropy_coef=a.entropy_coef,
        tis_cap=_float(tis_cap),
        mismatch=a.mismatch.mode,
        mismatch_cap=float(a.mismatch.cap),
        ratio_cap=_float(a.ratio_cap),
        tau_pos=_float(a.tau_pos),
        tau_neg=_float(a.tau_neg),
        upper_cap=_float(a.upper_cap),
        cov_ratio=_float(a.cov_ratio),
        clip_cov_lb=_float(a.clip_cov_lb),
        clip_cov_ub=_float(a.clip_cov_ub),
        kl_cov_coef=_float(a.kl_cov_coef),
        top_entropy_quantile=float(a.top_entropy_quantile),
        entropy_control=entropy_control(cfg),
    )
    if not get_algorithm(a.name).band:
        return opts
    band = a.band
    opts = replace(
        opts,
        divergence=band.divergence,
        delta=band.delta,
        upper_cap=band.upper_cap,
        relax_high_p=band.relax_high_p,
    )
    if band.adaptive == "entropy":
        lo, hi = band_delta_range(band)
        opts = replace(
            opts, band_adaptive="entropy", delta_min=lo, delta_max=hi, entropy_norm=band.adaptive_norm
        )
    return opts


def _float(x):
    return None if x is None else float(x)


# The adaptive entropy bonus' keys besides algorithm.entropy_target, and its EntropyControl field each sets.
ENTROPY_CONTROL_KEYS = {
    "entropy_coef_delta": "delta",
    "entropy_coef_min": "coef_min",
    "entropy_coef_max": "coef_max",
}


def entropy_control(cfg: TrainConfig):
    """The adaptive entropy bonus' settings (``bandpo.algo.entropy_bonus.EntropyControl``), nulls resolved to
    TRL's defaults; None when ``algorithm.entropy_target`` is null."""
    from bandpo.algo.entropy_bonus import EntropyControl

    a = cfg.algorithm
    if a.entropy_target is None:
        return None
    set_ = {
        field: float(getattr(a, k)) for k, field in ENTROPY_CONTROL_KEYS.items() if getattr(a, k) is not None
    }
    return EntropyControl(float(a.entropy_target), **set_)


def validate_algorithm(cfg: TrainConfig) -> None:
    """``algorithm.*``: the name, the options the chosen algorithm reads, and those it does not."""
    from bandpo.algo.adaptive import ADAPTIVE_MODES, ENTROPY_NORMS, check_delta_range
    from bandpo.algo.advantages import ADVANTAGE_ESTIMATORS
    from bandpo.algo.band import DIVERGENCES, check_eps, check_threshold, check_upper_cap
    from bandpo.algo.mismatch import MISMATCH_MODES, check_cap, check_one_correction
    from bandpo.algo.options import KL_ESTIMATORS, check_agg, check_dual_clip
    from bandpo.algo.registry import ALGORITHMS, check_applies
    from bandpo.algo.rivals import check_ratio_cap, check_tau

    name = _choice(cfg, "algorithm.name", list(ALGORITHMS))
    algo = ALGORITHMS[name]
    # Options another algorithm reads are refused by name when set, never ignored (Algorithm.reads).
    for option in (
        "eps_low",
        "eps_high",
        "dual_clip",
        "ratio_cap",
        "upper_cap",
        "tau_pos",
        "tau_neg",
        "cov_ratio",
        "clip_cov_lb",
        "clip_cov_ub",
        "kl_cov_coef",
    ):
        key = f"algorithm.{option}"
        if _get(cfg, key) is not None:
            if option in algo.config_keys:  # it reads this option, from another key
                raise ConfigError(
                    f"config error: {key} does not apply to algorithm={name}: {name}'s is "
                    f"{algo.config_keys[option]}; set it to null"
                )
            _rule(check_applies, name, option, key)
    if "eps_low" in algo.reads:  # numbers (a null is refused), in the interval's range
        _rule(
            check_eps,
            _number(cfg, "algorithm.eps_low"),
            _number(cfg, "algorithm.eps_high"),
            ("algorithm.eps_low", "algorithm.eps_high"),
        )
    _rule(check_dual_clip, _get(cfg, "algorithm.dual_clip"), "algorithm.dual_clip")
    _rule(check_ratio_cap, _get(cfg, "algorithm.ratio_cap"), "algorithm.ratio_cap")
    _rule(check_upper_cap, _get(cfg, "algorithm.upper_cap"), "algorithm.upper_cap")
    for option in ("tau_pos", "tau_neg"):
        if option in algo.reads:  # numbers (a null is refused)
            key = f"algorithm.{option}"
            _rule(check_tau, _number(cfg, key), key)
    _rule(check_agg, name, _get(cfg, "algorithm.loss_agg"), "algorithm.loss_agg")
    _validate_entropy_options(cfg, name)
    mode = _choice(cfg, "algorithm.mismatch.mode", MISMATCH_MODES)
    _rule(
        check_one_correction,
        _get(cfg, "algorithm.tis_cap"),
        mode,
        ("algorithm.tis_cap", "algorithm.mismatch.mode"),
    )
    _rule(check_cap, _get(cfg, "algorithm.mismatch.cap"), "algorithm.mismatch.cap")
    _number(cfg, "algorithm.kl_coef", low=0)
    _choice(cfg, "algorithm.kl_estimator", KL_ESTIMATORS)
    _choice(cfg, "algorithm.advantage", ADVANTAGE_ESTIMATORS)
    if algo.band:
        _choice(cfg, "algorithm.band.divergence", DIVERGENCES)
        _rule(check_threshold, _get(cfg, "algorithm.band.delta"), "algorithm.band.delta")
        _rule(check_upper_cap, _get(cfg, "algorithm.band.upper_cap"), "algorithm.band.upper_cap")
        if _choice(cfg, "algorithm.band.adaptive", ADAPTIVE_MODES) != "none":
            _choice(cfg, "algorithm.band.adaptive_norm", ENTROPY_NORMS)
            keys = ("algorithm.band.delta_min", "algorithm.band.delta_max")
            for key in keys:
                if _get(cfg, key) is not None:
                    _number(cfg, key)  # a number; its range below, nulls resolved (band_delta_range)
            _rule(check_delta_range, *band_delta_range(cfg.algorithm.band), keys)
    elif _get(cfg, "algorithm.band") is not None:
        band = band_algorithms()
        raise ConfigError(
            f"config error: algorithm.band applies to algorithm={band} only (this run is {name}); "
            f"remove the algorithm.band.* overrides or pick algorithm={band}"
        )
    if _get(cfg, "algorithm.tis_cap") is not None:
        _rule(check_cap, _get(cfg, "algorithm.tis_cap"), "algorithm.tis_cap")
    _check(
        isinstance(_get(cfg, "algorithm.filter_groups.enable"), bool),
        "algorithm.filter_groups.enable",
        "must be true or false",
        _get(cfg, "algorithm.filter_groups.enable"),
    )
    _choice(cfg, "algorithm.filter_groups.metric", ["acc", "reward"])
    from bandpo.trainer.dynamic_sampling import check_max_gen_rounds

    max_rounds = _get(cfg, "algorithm.filter_groups.max_gen_rounds")
    _rule(check_max_gen_rounds, max_rounds, "algorithm.filter_groups.max_gen_rounds")


def _validate_entropy_options(cfg: TrainConfig, name: str) -> None:
    """The covariance methods' numbers, the top-entropy selection and the adaptive entropy bonus: each in
    range, refused (with the reason) for an algorithm it does not combine with, and the bonus' own keys
    refused without ``algorithm.entropy_target``."""
    from bandpo.algo.cov import check_cov_options
    from bandpo.algo.entropy_bonus import check_combinable, check_quantile
    from bandpo.algo.registry import ALGORITHMS

    algo = ALGORITHMS[name]
    cov_keys = ("cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_coef")
    for option in cov_keys:
        if _get(cfg, f"algorithm.{option}") is not None:
            _number(cfg, f"algorithm.{option}")
    _rule(
        check_cov_options,
        *(algo.resolve(option, _get(cfg, f"algorithm.{option}")) for option in cov_keys),
        names={option: f"algorithm.{option}" for option in cov_keys},
    )
    rho = _number(cfg, "algorithm.top_entropy_quantile")
    _rule(check_quantile, rho, "algorithm.top_entropy_quantile")
    if rho < 1:
        _rule(check_combinable, name, "top_entropy_quantile", "algorithm.top_entropy_quantile")
    _number(cfg, "algorithm.entropy_coef")
    if _get(cfg, "algorithm.entropy_target") is None:
        for key in ENTROPY_CONTROL_KEYS:
            if _get(cfg, f"algorithm.{key}") is not None:
                raise ConfigError(
                    f"config error: algorithm.{key} applies to the adaptive entropy bonus only; "
                    "set algorithm.entropy_target (the target entropy) or set it to null"
                )
        return
    for key in ("entropy_target", *ENTROPY_CONTROL_KEYS):
        if _get(cfg, f"algorithm.{key}") is not None:
            _number(cfg, f"algorithm.{key}")
    _rule(check_combinable, name, "entropy_control", "algorithm.entropy_target")
    control = _rule(_control, cfg)
    coef = _get(cfg, "algorithm.entropy_coef")
    if not control.coef_min <= coef <= control.coef_max:
        raise ConfigError(
            f"config error: algorithm.entropy_coef (the adaptive bonus' starting value) must be within "
            f"[algorithm.entropy_coef_min, algorithm.entropy_coef_max] = [{control.coef_min}, {control.coef_max}], "
            f"got {coef!r}"
        )


def _control(cfg: TrainConfig):
    """``entropy_control(cfg)`` with its messages naming the config keys."""
    try:
        return entropy_control(cfg)
    except ValueError as e:
        raise ValueError(f"algorithm.{e}") from None
