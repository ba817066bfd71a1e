"""Compose and validate the Hydra training config before any worker starts.

Every check names the config key it rejects, so a bad override fails in seconds with a
message like ``config error: algorithm.band.delta must be > 0, got -1``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    """A config value is missing or invalid; the message names the key."""


def compose(overrides: Sequence[str] = (), config_name: str = "train"):
    """The composed config for ``overrides`` (as on the command line), validated."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base=None):
            cfg = hydra_compose(config_name, overrides=list(overrides))
    except HydraException as e:
        raise ConfigError(f"config error: {e}") from None
    validate(cfg)
    return cfg


def _get(cfg, key: str) -> Any:
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue

    try:
        value = OmegaConf.select(cfg, key, throw_on_missing=True)
    except MissingMandatoryValue:
        raise ConfigError(f"config error: {key} is required (it is ???); set it with {key}=...") from None
    except Exception as e:  # interpolation errors name the bad reference
        raise ConfigError(f"config error: {key}: {e}") from None
    return value


def _check(cond: bool, key: str, msg: str, value: Any) -> None:
    if not cond:
        raise ConfigError(f"config error: {key} {msg}, got {value!r}")


def _choice(cfg, key: str, valid: Sequence[str]) -> Any:
    value = _get(cfg, key)
    _check(value in valid, key, f"must be one of {', '.join(map(str, valid))}", value)
    return value


def _number(cfg, key: str, *, low: float | None = None, high: float | None = None, strict_low: bool = False,
            integer: bool = False) -> float:
    value = _get(cfg, key)
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    _check(ok_type and not isinstance(value, bool), key, "must be an integer" if integer else "must be a number", value)
    _check(math.isfinite(value), key, "must be finite", value)
    if low is not None:
        _check(value > low if strict_low else value >= low, key, f"must be {'>' if strict_low else '>='} {low}", value)
    if high is not None:
        _check(value <= high, key, f"must be <= {high}", value)
    return value


def validate(cfg) -> None:
    """Raise ``ConfigError`` naming the first missing or invalid key."""
    from bandpo.algo.advantages import ADVANTAGE_ESTIMATORS
    from bandpo.algo.band import DIVERGENCES
    from bandpo.algo.losses import AGG_MODES, ALGORITHMS, KL_ESTIMATORS

    name = _choice(cfg, "algorithm.name", list(ALGORITHMS))
    _number(cfg, "algorithm.eps_low", low=0, high=1, strict_low=True)
    _number(cfg, "algorithm.eps_high", low=0, strict_low=True)
    if _get(cfg, "algorithm.dual_clip") is not None:
        _number(cfg, "algorithm.dual_clip", low=1, strict_low=True)
    _choice(cfg, "algorithm.loss_agg", AGG_MODES)
    _number(cfg, "algorithm.kl_coef", low=0)
    _choice(cfg, "algorithm.kl_estimator", KL_ESTIMATORS)
    _choice(cfg, "algorithm.advantage", ADVANTAGE_ESTIMATORS)
    if name == "bandpo":
        _choice(cfg, "algorithm.band.divergence", DIVERGENCES)
        _number(cfg, "algorithm.band.delta", low=0, strict_low=True)
        if _get(cfg, "algorithm.band.upper_cap") is not None:
            _number(cfg, "algorithm.band.upper_cap", low=1, strict_low=True)

    from bandpo.rollout.base import available_engines

    _choice(cfg, "rollout.backend", available_engines())
    _number(cfg, "rollout.n", low=2, integer=True)
    _number(cfg, "rollout.temperature", low=0, strict_low=True)
    _number(cfg, "rollout.top_p", low=0, high=1, strict_low=True)
    _number(cfg, "rollout.max_tokens", low=1, integer=True)
    _number(cfg, "rollout.num_workers", low=1, integer=True)

    _choice(cfg, "actor.zero_stage", [2, 3])
    _number(cfg, "actor.lr", low=0, strict_low=True)
    _number(cfg, "actor.num_workers", low=1, integer=True)
    _number(cfg, "actor.micro_batch_size", low=1, integer=True)
    _number(cfg, "actor.epochs", low=1, integer=True)
    prompts = _number(cfg, "trainer.prompts_per_step", low=1, integer=True)
    mini = _number(cfg, "actor.mini_batch_prompts", low=1, integer=True)
    _check(prompts % mini == 0, "actor.mini_batch_prompts", f"must divide trainer.prompts_per_step={prompts}", mini)
    rows = mini * _get(cfg, "rollout.n")
    workers = _get(cfg, "actor.num_workers")
    _check(rows % workers == 0, "actor.num_workers", f"must divide the rows of a mini-batch ({rows})", workers)
    micro = _get(cfg, "actor.micro_batch_size")
    _check((rows // workers) % micro == 0, "actor.micro_batch_size",
           f"must divide the rows per rank of a mini-batch (mini_batch_prompts x rollout.n / num_workers = "
           f"{rows // workers})", micro)

    _number(cfg, "trainer.total_steps", low=1, integer=True)
    _number(cfg, "trainer.save_every", low=0, integer=True)
    _number(cfg, "trainer.eval_every", low=0, integer=True)
    _number(cfg, "trainer.keep_last", low=1, integer=True)
    _choice(cfg, "trainer.resume", ["auto", "never"])
    _choice(cfg, "trainer.on_nonfinite", ["skip", "stop"])
    _choice(cfg, "trainer.device", ["auto", "cpu", "cuda"])
    _choice(cfg, "data.template", ["dapo", "boxed"])
    _validate_placement(cfg)
    _number(cfg, "eval.n", low=1, integer=True)

    path = str(_get(cfg, "model.path"))
    looks_local = path.startswith(("/", ".", "~")) or os.sep in path and Path(path).expanduser().parent.exists()
    if looks_local and not Path(path).expanduser().exists() and not _get(cfg, "model.build"):
        raise ConfigError(f"config error: model.path {path!r} does not exist (a local folder or a hub id is needed)")


def _validate_placement(cfg) -> None:
    """The placement keys; with a cluster shape in the config, the whole plan (bandpo.distributed.plan)."""
    _choice(cfg, "rollout.enforce_eager", ["auto", True, False])
    _number(cfg, "trainer.verifier_actors", low=1, integer=True)
    _choice(cfg, "trainer.dry_run", [True, False])
    for key in ("actor.gpus", "rollout.gpus", "trainer.nnodes", "trainer.gpus_per_node"):
        if _get(cfg, key) is not None:
            _number(cfg, key, low=1, integer=True)
    from bandpo.distributed.plan import gpu_counts, layout_of, make_plan, plan_device, shape_from_config

    layout = layout_of(cfg, "cuda")  # actor.gpus / rollout.gpus come together
    if _get(cfg, "trainer.device") == "cuda":
        gpu_counts(cfg, layout)
    shape = shape_from_config(cfg)
    if shape is not None:
        make_plan(cfg, shape, plan_device(cfg))
