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
    from bandpo.algo.options import LossOptions

    return LossOptions(**loss_fields(cfg))


# LossOptions' field -> the key it comes from (the band's upper_cap: ``option_keys``)
OPTION_KEYS = {
    "agg": "algorithm.loss_agg",
    "mismatch": "algorithm.mismatch.mode",
    "mismatch_cap": "algorithm.mismatch.cap",
    "band_adaptive": "algorithm.band.adaptive",
    "relax_high_p": "algorithm.band.relax_high_p",
    **{
        f: f"algorithm.{f}"
        for f in ("eps_low", "eps_high", "dual_clip", "kl_estimator", "tis_cap", "upper_cap", "ratio_cap")
    },
    "tau_pos": "algorithm.tau_pos",
    "tau_neg": "algorithm.tau_neg",
    **{
        f: f"algorithm.{f}"
        for f in (
            "cov_ratio",
            "clip_cov_lb",
            "clip_cov_ub",
            "kl_cov_coef",
            "top_entropy_quantile",
            "entropy_coef",
        )
    },
    "entropy_control": "algorithm.entropy_target",
    "entropy_coef_min": "algorithm.entropy_coef_min",
    "entropy_coef_max": "algorithm.entropy_coef_max",
}


def option_keys(band: bool) -> dict[str, str]:
    """``OPTION_KEYS`` of an algorithm that reads ``algorithm.band`` (``band``) or not."""
    return {**OPTION_KEYS, "upper_cap": "algorithm.band.upper_cap"} if band else OPTION_KEYS


def loss_fields(cfg: TrainConfig) -> dict:
    """``LossOptions``' fields from ``algorithm.*`` (``loss_options``), not yet checked."""
    from bandpo.algo.registry import get_algorithm

    a = cfg.algorithm
    tis_cap = a.tis_cap
    if tis_cap is None and a.mismatch.mode == "none" and cfg.trainer.max_staleness > 0:
        from bandpo.config.checks import STALE_TIS_CAP

        tis_cap = STALE_TIS_CAP  # decoupled PPO's behaviour correction (another mismatch mode replaces it)
    opts = dict(
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
    opts.update(
        divergence=band.divergence,
        delta=band.delta,
        upper_cap=band.upper_cap,
        relax_high_p=band.relax_high_p,
        band_adaptive=band.adaptive,
    )
    if band.adaptive == "entropy":
        lo, hi = band_delta_range(band)
        opts.update(delta_min=lo, delta_max=hi, entropy_norm=band.adaptive_norm)
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
    from bandpo.algo.adaptive import ENTROPY_NORMS, check_delta_range
    from bandpo.algo.advantages import ADVANTAGE_ESTIMATORS
    from bandpo.algo.band import DIVERGENCES, check_threshold
    from bandpo.algo.options import check_loss_options
    from bandpo.algo.registry import ALGORITHMS

    name = _choice(cfg, "algorithm.name", list(ALGORITHMS))
    algo = ALGORITHMS[name]
    # An option this algorithm reads from another key (Algorithm.config_keys) is refused at this one.
    for option, other in algo.config_keys.items():
        key = f"algorithm.{option}"
        if _get(cfg, key) is not None:
            raise ConfigError(
                f"config error: {key} does not apply to algorithm={name}: {name}'s is {other}; set it to null"
            )
    # Options the algorithm reads are numbers (a null is refused); their ranges: check_loss_options.
    if "eps_low" in algo.reads:
        _number(cfg, "algorithm.eps_low")
        _number(cfg, "algorithm.eps_high")
    for option in ("tau_pos", "tau_neg"):
        if option in algo.reads:
            _number(cfg, f"algorithm.{option}")
    _validate_entropy_keys(cfg)
    # The loss options' own rules (options another algorithm reads refused by name, ranges, choices):
    # LossOptions' check, each option named by its key.
    _rule(check_loss_options, loss_fields(cfg), option_keys(algo.band))
    _number(cfg, "algorithm.kl_coef", low=0)
    _choice(cfg, "algorithm.advantage", ADVANTAGE_ESTIMATORS)
    if algo.band:
        _choice(cfg, "algorithm.band.divergence", DIVERGENCES)
        _rule(check_threshold, _get(cfg, "algorithm.band.delta"), "algorithm.band.delta")
        if _get(cfg, "algorithm.band.adaptive") != "none":
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
    _check(
        isinstance(_get(cfg, "algorithm.filter_groups.enable"), bool),
        "algorithm.filter_groups.enable",
        "must be true or false",
        _get(cfg, "algorithm.filter_groups.enable"),
    )
    _choice(cfg, "algorithm.filter_groups.metric", ["acc", "reward"])
    from bandpo.config.checks import check_max_gen_rounds

    max_rounds = _get(cfg, "algorithm.filter_groups.max_gen_rounds")
    _rule(check_max_gen_rounds, max_rounds, "algorithm.filter_groups.max_gen_rounds")


def _validate_entropy_keys(cfg: TrainConfig) -> None:
    """The entropy options' keys as keys: numbers where set, and the adaptive bonus' own keys refused
    without ``algorithm.entropy_target``; their ranges and the algorithms they combine with are
    ``check_loss_options``' (``bandpo.algo.options``)."""
    for option in ("cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_coef"):
        if _get(cfg, f"algorithm.{option}") is not None:
            _number(cfg, f"algorithm.{option}")
    _number(cfg, "algorithm.top_entropy_quantile")
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
    _rule(_control, cfg)


def _control(cfg: TrainConfig):
    """``entropy_control(cfg)`` with its messages naming the config keys."""
    try:
        return entropy_control(cfg)
    except ValueError as e:
        raise ValueError(f"algorithm.{e}") from None
