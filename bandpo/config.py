"""Compose and validate the Hydra training config before any worker starts.

Every check names the config key it rejects, so a bad override fails in seconds with a
message like ``config error: algorithm.band.delta must be > 0, got -1``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bandpo.distributed.precision import check_bf16, check_engine_dtype
from bandpo.errors import ConfigError, check, check_choice, check_number

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def compose(overrides: Sequence[str] = (), config_name: str = "train"):
    """The composed config for ``overrides`` (as on the command line), validated."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base=None):

            def schema(groups):
                return hydra_compose(config_name, overrides=groups)

            # Hydra itself refuses an unknown `k=v` (checked below only to name the closest key)
            # but adds `+k=v` / `++k=v`: those are checked first.
            if any(o.lstrip().startswith(("+", "~")) for o in overrides):
                check_override_keys(overrides, schema)
            try:
                cfg = hydra_compose(config_name, overrides=list(overrides))
            except HydraException:
                check_override_keys(overrides, schema)
                raise
    except HydraException as e:
        hint = ""
        if "'algorithm.band." in str(e):  # grpo / clip_higher have no band block to override
            hint = " (algorithm.band.* options apply to algorithm=bandpo only)"
        raise ConfigError(f"config error: {e}{hint}") from None
    validate(cfg)
    return cfg


def check_override_keys(overrides: Sequence[str], compose_groups) -> None:
    """Refuse an override of a key the config does not have, in every form (``k=``, ``+k=``, ``++k=``, ``~k``).

    Hydra adds unknown keys on ``+k=v`` / ``++k=v`` (its append syntax), and a misspelt
    option would then be silently ignored. The schema is the config composed with only the
    group choices among ``overrides`` (``compose_groups(list)``: ``model=...`` changes which
    keys exist); the error names the key and the closest valid one.
    """
    import difflib

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    is_group = [(CONFIG_DIR / o.key_or_group.split("@")[0]).is_dir() for o in parsed]
    schema = compose_groups([o.input_line for o, group in zip(parsed, is_group) if group])
    keys = _dotted_keys(OmegaConf.to_container(schema, resolve=False))
    for o, group in zip(parsed, is_group):
        key = o.key_or_group
        if group or key.startswith("hydra.") or key in keys:
            continue
        close = difflib.get_close_matches(key, sorted(keys), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        # no band block
        if key.startswith("algorithm.band.") and not any(k.startswith("algorithm.band.") for k in keys):
            hint = " (algorithm.band.* options apply to algorithm=bandpo only)"
        raise ConfigError(f"config error: {key} is not a config key (override {o.input_line!r}){hint}")


def _dotted_keys(node, prefix: str = "") -> set[str]:
    """Every key of a plain container as a dotted path, inner nodes and list indices included."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    out: set[str] = set()
    for k, v in items:
        path = f"{prefix}{k}"
        out.add(path)
        out |= _dotted_keys(v, path + ".")
    return out


def to_plain(node):
    """An OmegaConf node as plain Python containers (interpolations resolved); other values unchanged."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


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
    check(cond, key, msg, repr(value))  # the config's messages show the value's repr


def _rule(rule, *args, **kwargs) -> Any:
    """``rule(*args, **kwargs)``: a validation rule written once, next to the mechanism it protects, called
    with the config key as the name it gives the value; its ``ValueError`` is re-raised as a ``ConfigError``."""
    try:
        return rule(*args, **kwargs)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"config error: {e}") from None


def _choice(cfg, key: str, valid: Sequence[str]) -> Any:
    value = _get(cfg, key)
    _rule(check_choice, value, valid, key)
    return value


def _number(
    cfg,
    key: str,
    *,
    low: float | None = None,
    high: float | None = None,
    strict_low: bool = False,
    integer: bool = False,
) -> float:
    value = _get(cfg, key)
    _rule(check_number, value, key, low=low, high=high, strict_low=strict_low, integer=integer)
    return value


def band_delta_range(band) -> tuple[float, float]:
    """(delta_min, delta_max) of the adaptive band, nulls resolved to delta / 4 and 4 delta."""
    lo = band.delta / 4 if band.get("delta_min") is None else band.delta_min
    hi = band.delta * 4 if band.get("delta_max") is None else band.delta_max
    return float(lo), float(hi)


def loss_options(cfg):
    """The run's ``LossOptions`` (``bandpo.algo.options``), built once from ``algorithm.*`` and
    ``rollout.max_tokens`` (Dr. GRPO's constant length). The adaptive band's ``entropy_scale`` is
    left None: it is known only per step (``batch``) or once the model is loaded (``logv``)."""
    from dataclasses import replace

    from bandpo.algo.options import LossOptions

    a = cfg.algorithm
    tis_cap = a.get("tis_cap")
    if tis_cap is None and a.mismatch.mode == "none" and cfg.trainer.get("max_staleness", 0) > 0:
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
        ratio_cap=_float(a.get("ratio_cap")),
        tau_pos=_float(a.get("tau_pos")),
        tau_neg=_float(a.get("tau_neg")),
        upper_cap=_float(a.get("upper_cap")),
    )
    if a.name != "bandpo":
        return opts
    band = a.band
    opts = replace(
        opts,
        divergence=band.divergence,
        delta=band.delta,
        upper_cap=band.upper_cap,
        relax_high_p=band.relax_high_p,
    )
    if band.get("adaptive", "none") == "entropy":
        lo, hi = band_delta_range(band)
        opts = replace(
            opts, band_adaptive="entropy", delta_min=lo, delta_max=hi, entropy_norm=band.adaptive_norm
        )
    return opts


def _float(x):
    return None if x is None else float(x)


def validate(cfg) -> None:
    """Raise ``ConfigError`` naming the first missing or invalid key."""
    from bandpo.algo.adaptive import ADAPTIVE_MODES, ENTROPY_NORMS, check_delta_range
    from bandpo.algo.advantages import ADVANTAGE_ESTIMATORS
    from bandpo.algo.band import DIVERGENCES, check_eps, check_threshold, check_upper_cap
    from bandpo.algo.mismatch import MISMATCH_MODES, check_cap, check_one_correction
    from bandpo.algo.options import ALGORITHMS, KL_ESTIMATORS, check_agg, check_applies, check_dual_clip
    from bandpo.algo.rivals import check_ratio_cap, check_tau

    name = _choice(cfg, "algorithm.name", list(ALGORITHMS))
    algo = ALGORITHMS[name]
    # Options another algorithm reads are refused by name when set, never ignored (bandpo.algo.options.OPTION_SCOPES).
    for option in ("eps_low", "eps_high", "dual_clip", "ratio_cap", "upper_cap", "tau_pos", "tau_neg"):
        key = f"algorithm.{option}"
        if _get(cfg, key) is not None:
            if option == "upper_cap" and algo.band:
                raise ConfigError(
                    f"config error: {key} does not apply to algorithm={name}: bandpo's is "
                    f"algorithm.band.upper_cap; set it to null"
                )
            _rule(check_applies, name, option, key)
    if algo.surrogate != "sapo":  # numbers (a null is refused), in the interval's range
        _rule(
            check_eps,
            _number(cfg, "algorithm.eps_low"),
            _number(cfg, "algorithm.eps_high"),
            ("algorithm.eps_low", "algorithm.eps_high"),
        )
    _rule(check_dual_clip, _get(cfg, "algorithm.dual_clip"), "algorithm.dual_clip")
    _rule(check_ratio_cap, _get(cfg, "algorithm.ratio_cap"), "algorithm.ratio_cap")
    _rule(check_upper_cap, _get(cfg, "algorithm.upper_cap"), "algorithm.upper_cap")
    if algo.surrogate == "sapo":  # numbers (a null is refused)
        for key in ("algorithm.tau_pos", "algorithm.tau_neg"):
            _rule(check_tau, _number(cfg, key), key)
    _rule(check_agg, name, _get(cfg, "algorithm.loss_agg"), "algorithm.loss_agg")
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
    if name == "bandpo":
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
        raise ConfigError(
            f"config error: algorithm.band applies to algorithm=bandpo only (this run is {name}); "
            f"remove the algorithm.band.* overrides or pick algorithm=bandpo"
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
    _number(cfg, "algorithm.filter_groups.max_gen_rounds", low=1, integer=True)

    from bandpo.actor.chunked import check_temperature
    from bandpo.algo.advantages import check_group_size
    from bandpo.rollout.base import available_engines
    from bandpo.weight_sync.transport import TRANSPORTS

    _choice(cfg, "rollout.backend", available_engines())
    # checked against the layout at start-up (choose_transport)
    _choice(cfg, "rollout.weight_sync", TRANSPORTS)
    _check(
        isinstance(_get(cfg, "rollout.verify_sync"), bool),
        "rollout.verify_sync",
        "must be true or false",
        _get(cfg, "rollout.verify_sync"),
    )
    _number(cfg, "rollout.weight_sync_timeout", low=0, strict_low=True)
    _rule(check_group_size, _get(cfg, "rollout.n"), "rollout.n")
    _rule(check_temperature, _get(cfg, "rollout.temperature"), "rollout.temperature")
    _number(cfg, "rollout.top_p", low=0, high=1, strict_low=True)
    _number(cfg, "rollout.max_tokens", low=1, integer=True)
    _number(cfg, "rollout.num_workers", low=1, integer=True)
    _choice(cfg, "rollout.sleep_level", [1, 2])
    tp = _get(cfg, "rollout.tensor_parallel_size")
    _check(
        _get(cfg, "rollout.backend") != "hf" or tp in (None, 1),
        "rollout.tensor_parallel_size",
        "must be 1 with rollout.backend=hf (transformers generate runs each engine on one device; tensor "
        f"parallelism needs rollout.backend=vllm): add rollout.tensor_parallel_size=1 "
        f"rollout.num_workers={_get(cfg, 'actor.num_workers')} for the colocated layout",
        tp,
    )

    _choice(cfg, "actor.zero_stage", [2, 3])
    check_bf16(_get(cfg, "actor.bf16"))
    check_engine_dtype(_get(cfg, "model.dtype"))
    _choice(cfg, "actor.offload_during_rollout", [None, True, False])
    _number(cfg, "actor.lr", low=0, strict_low=True)
    _number(cfg, "actor.epochs", low=1, integer=True)
    prompts = _number(cfg, "trainer.prompts_per_step", low=1, integer=True)
    mini = _number(cfg, "actor.mini_batch_prompts", low=1, integer=True)
    _check(
        prompts % mini == 0,
        "actor.mini_batch_prompts",
        f"must divide trainer.prompts_per_step={prompts}",
        mini,
    )
    from bandpo.actor.chunked import check_chunk
    from bandpo.actor.ds_config import check_batch_split
    from bandpo.actor.packing import check_micro_batch_tokens, check_token_budget

    _rule(
        check_batch_split,
        mini * _get(cfg, "rollout.n"),
        _get(cfg, "actor.micro_batch_size"),
        _get(cfg, "actor.num_workers"),
        ("actor.mini_batch_prompts x rollout.n", "actor.micro_batch_size", "actor.num_workers"),
    )
    _rule(check_token_budget, _get(cfg, "actor.logprob_token_budget"), "actor.logprob_token_budget")
    _rule(check_chunk, _get(cfg, "actor.logits_chunk_tokens"), "actor.logits_chunk_tokens")
    _number(cfg, "actor.collective_timeout_min", low=0, strict_low=True)
    if _get(cfg, "actor.cpu_threads") is not None:
        _number(cfg, "actor.cpu_threads", low=1, integer=True)
    padding_free = _get(cfg, "actor.padding_free")
    _check(isinstance(padding_free, bool), "actor.padding_free", "must be true or false", padding_free)
    _rule(
        check_micro_batch_tokens,
        _get(cfg, "actor.max_tokens_per_micro_batch"),
        padding_free,
        ("actor.max_tokens_per_micro_batch", "actor.padding_free"),
    )
    share = _get(cfg, "actor.share_prompts")
    _check(isinstance(share, bool), "actor.share_prompts", "must be true or false", share)
    _check(
        padding_free or not share,
        "actor.share_prompts",
        "must be false with actor.padding_free=false (padded rows hold their own prompt)",
        share,
    )
    reuse = reuse_old_logprobs(cfg)
    _validate_lora(cfg, reuse)

    from bandpo.data.prompts import TEMPLATES
    from bandpo.run.nonfinite import INJECT_TARGETS, ON_NONFINITE

    _number(cfg, "trainer.total_steps", low=1, integer=True)
    _validate_staleness(cfg)
    _number(cfg, "trainer.save_every", low=0, integer=True)
    _number(cfg, "trainer.eval_every", low=0, integer=True)
    _number(cfg, "trainer.keep_last", low=1, integer=True)
    _number(cfg, "trainer.trace_every", low=0, integer=True)
    _number(cfg, "trainer.trace_max_chars", low=1, integer=True)
    _choice(cfg, "trainer.resume", ["auto", "never"])
    _choice(cfg, "trainer.on_nonfinite", ON_NONFINITE)
    _choice(cfg, "trainer.device", ["auto", "cpu", "cuda"])
    _number(cfg, "trainer.verifier_memory_gib", low=0, strict_low=True)
    _number(cfg, "trainer.max_error_share", low=0, high=1)
    _number(cfg, "trainer.inject_nonfinite_step", low=0, integer=True)
    _choice(cfg, "trainer.inject_nonfinite", INJECT_TARGETS)
    _choice(cfg, "trainer.verbose", [True, False])
    actors = _get(cfg, "trainer.verifier_actors")
    if actors != "per_node":
        _check(
            isinstance(actors, int) and not isinstance(actors, bool) and actors >= 1,
            "trainer.verifier_actors",
            "must be an integer >= 1 or per_node",
            actors,
        )
    if _get(cfg, "trainer.verifier_workers") is not None:
        _number(cfg, "trainer.verifier_workers", low=1, integer=True)
    _choice(cfg, "data.template", list(TEMPLATES))
    _validate_placement(cfg)
    from bandpo.eval.metrics import check_samples

    _rule(check_samples, _get(cfg, "eval.n"), "eval.n")

    path = str(_get(cfg, "model.path"))
    looks_local = (
        path.startswith(("/", ".", "~")) or os.sep in path and Path(path).expanduser().parent.exists()
    )
    if looks_local and not Path(path).expanduser().exists() and not _get(cfg, "model.build"):
        raise ConfigError(
            f"config error: model.path {path!r} does not exist (a local folder or a hub id is needed)"
        )


def reuse_old_logprobs(cfg) -> bool:
    """Whether the update's first optimizer step takes its old log-probs from its own forward
    (``actor.reuse_old_logprobs``).

    Before the first optimizer step of a rollout the policy is the one of that step's forward, so
    the separate old-logprob pass only needs the rows of the later mini-batches (none with one
    optimizer step per rollout). ``auto`` uses it wherever it applies: everywhere except the
    adaptive band's ``batch`` scale, which needs the step's mean pi_old entropy over all rows
    before the update's first forward (there ``true`` is a config error).
    """
    value = _get(cfg, "actor.reuse_old_logprobs")
    _check(
        value in ("auto", True, False), "actor.reuse_old_logprobs", "must be one of auto, true, false", value
    )
    band = _get(cfg, "algorithm.band") if _get(cfg, "algorithm.name") == "bandpo" else None
    needs_pass = (
        band is not None
        and band.get("adaptive", "none") == "entropy"
        and band.get("adaptive_norm") == "batch"
    )
    if value is True and needs_pass:
        raise ConfigError(
            "config error: actor.reuse_old_logprobs=true cannot be used with algorithm.band.adaptive="
            "entropy and algorithm.band.adaptive_norm=batch (the entropy scale comes from the "
            "old-logprob pass over every row); use auto or false, or adaptive_norm=logv"
        )
    return not needs_pass and value is not False


def _validate_lora(cfg, reuse_old: bool) -> None:
    """``actor.lora.*``, and the settings LoRA cannot run with (``bandpo.actor.lora``)."""
    rank = _number(cfg, "actor.lora.rank", low=0, integer=True)
    _number(cfg, "actor.lora.alpha", low=0, strict_low=True)
    dropout = _number(cfg, "actor.lora.dropout", low=0)
    _check(dropout < 1, "actor.lora.dropout", "must be < 1", dropout)
    targets = _get(cfg, "actor.lora.target_modules")
    _check(
        isinstance(targets, Sequence)
        and not isinstance(targets, str)
        and len(targets) > 0
        and all(isinstance(t, str) and t for t in targets),
        "actor.lora.target_modules",
        "must be a non-empty list of module names",
        targets,
    )
    if rank == 0:
        return
    from bandpo.actor.lora import check_zero_stage

    _rule(check_zero_stage, _get(cfg, "actor.zero_stage"))
    # The reused old log-probs are the update's own training forward: with dropout on the adapter they
    # would be one dropout draw's, not the policy's (the model's own dropout is forced off for this).
    if dropout > 0 and reuse_old:
        raise ConfigError(
            "config error: actor.lora.dropout > 0 cannot be used with actor.reuse_old_logprobs="
            f"{_get(cfg, 'actor.reuse_old_logprobs')} (the first step's old log-probs would come "
            "from a forward with adapter dropout); set actor.reuse_old_logprobs=false or dropout=0"
        )


def _validate_staleness(cfg) -> None:
    """``trainer.max_staleness`` and the CPU thread split it uses (``bandpo.trainer.overlap``); a colocated
    GPU layout is refused here when ``trainer.device=cuda`` (with ``auto``, once the trainer knows the device)."""
    from bandpo.distributed.plan import layout_of
    from bandpo.trainer.overlap import MAX_STALENESS, check_layout

    staleness = _get(cfg, "trainer.max_staleness")
    _check(
        staleness in MAX_STALENESS and not isinstance(staleness, bool),
        "trainer.max_staleness",
        f"must be one of {', '.join(map(str, MAX_STALENESS))}",
        staleness,
    )
    if _get(cfg, "rollout.cpu_threads") is not None:
        _number(cfg, "rollout.cpu_threads", low=1, integer=True)
    if _get(cfg, "trainer.device") == "cuda":
        check_layout(staleness, layout_of(cfg, "cuda"))


def _validate_placement(cfg) -> None:
    """The placement keys; with a cluster shape in the config, the whole plan (bandpo.distributed.plan)."""
    _choice(cfg, "rollout.enforce_eager", ["auto", True, False])
    _choice(cfg, "trainer.dry_run", [True, False])
    for key in ("actor.gpus", "rollout.gpus", "trainer.nnodes", "trainer.gpus_per_node"):
        if _get(cfg, key) is not None:
            _number(cfg, key, low=1, integer=True)
    if _get(cfg, "trainer.gpu_memory_gib") is not None:
        _number(cfg, "trainer.gpu_memory_gib", low=0, strict_low=True)
    from bandpo.distributed.plan import decide_device, gpu_counts, layout_of, make_plan, shape_from_config

    layout = layout_of(cfg, "cuda")  # actor.gpus / rollout.gpus come together
    if _get(cfg, "trainer.device") == "cuda":
        gpu_counts(cfg, layout)
    shape = shape_from_config(cfg)
    if shape is not None:
        make_plan(cfg, shape, decide_device(cfg.trainer.device, cfg.trainer.get("gpus_per_node") or 0))
