"""Validate the composed training config before any worker starts: ``algorithm.*``
(``bandpo.config.algorithm``), then rollout, actor, trainer, data, eval and model keys. The
first missing or invalid key raises a ``ConfigError`` that names it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from bandpo.config.algorithm import validate_algorithm
from bandpo.config.keys import _check, _choice, _get, _number, _rule
from bandpo.distributed.precision import check_bf16, check_engine_dtype
from bandpo.errors import ConfigError

OLD_LOGPROBS = ("recompute", "rollout")  # actor.old_logprobs: where pi_old comes from

if TYPE_CHECKING:
    from bandpo.config.schema import TrainConfig


def validate(cfg: TrainConfig) -> None:
    """Raise ``ConfigError`` naming the first missing or invalid key."""
    validate_algorithm(cfg)

    from bandpo.algo.advantages import check_group_size
    from bandpo.config.checks import check_temperature
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
    _number(cfg, "trainer.startup_timeout", low=0, strict_low=True)
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
    from bandpo.config.checks import (
        HEAD_CHOICES,
        check_batch_split,
        check_chunk,
        check_micro_batch_tokens,
        check_token_budget,
    )

    _rule(
        check_batch_split,
        mini * _get(cfg, "rollout.n"),
        _get(cfg, "actor.micro_batch_size"),
        _get(cfg, "actor.num_workers"),
        ("actor.mini_batch_prompts x rollout.n", "actor.micro_batch_size", "actor.num_workers"),
    )
    _rule(check_token_budget, _get(cfg, "actor.logprob_token_budget"), "actor.logprob_token_budget")
    _rule(check_chunk, _get(cfg, "actor.logits_chunk_tokens"), "actor.logits_chunk_tokens")
    _choice(cfg, "actor.logprob_head", HEAD_CHOICES)
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
    _choice(cfg, "actor.old_logprobs", OLD_LOGPROBS)
    reuse = reuse_old_logprobs(cfg)
    _validate_lora(cfg, reuse)
    fp32_head = _get(cfg, "model.fp32_head")
    _check(isinstance(fp32_head, bool), "model.fp32_head", "must be true or false", fp32_head)
    _check(
        not fp32_head or padding_free,
        "model.fp32_head",
        "needs actor.padding_free=true (the padded path's logits come from the model's own bf16 lm_head)",
        fp32_head,
    )
    _check(
        not fp32_head or _get(cfg, "rollout.backend") == "vllm",
        "model.fp32_head",
        "needs rollout.backend=vllm (the engine side is vLLM's head_dtype; transformers' generate has none)",
        fp32_head,
    )

    from bandpo.data.prompts import TEMPLATES
    from bandpo.run.nonfinite import INJECT_TARGETS, ON_NONFINITE

    _number(cfg, "trainer.total_steps", low=1, integer=True)
    _validate_staleness(cfg)
    _validate_lora_sync(cfg)  # after actor.lora.* and trainer.max_staleness
    _validate_old_logprobs(cfg)  # after actor.lora.*, trainer.max_staleness and rollout.top_p
    _number(cfg, "trainer.save_every", low=0, integer=True)
    _number(cfg, "trainer.eval_every", low=0, integer=True)
    _number(cfg, "trainer.keep_last", low=1, integer=True)
    _number(cfg, "trainer.trace_every", low=0, integer=True)
    _number(cfg, "trainer.trace_max_chars", low=1, integer=True)
    _number(cfg, "trainer.entropy_first_n", low=1, integer=True)
    _choice(cfg, "trainer.resume", ["auto", "never"])
    _choice(cfg, "trainer.on_nonfinite", ON_NONFINITE)
    _choice(cfg, "trainer.device", ["auto", "cpu", "cuda"])
    _number(cfg, "trainer.max_error_share", low=0, high=1)
    _number(cfg, "trainer.inject_nonfinite_step", low=0, integer=True)
    _choice(cfg, "trainer.inject_nonfinite", INJECT_TARGETS)
    _choice(cfg, "trainer.verbose", [True, False])
    from bandpo.reward.checks import check_memory_cap, check_verifier_actors, check_verifier_workers

    _rule(check_verifier_actors, _get(cfg, "trainer.verifier_actors"), "trainer.verifier_actors")
    _rule(check_verifier_workers, _get(cfg, "trainer.verifier_workers"), "trainer.verifier_workers")
    _rule(check_memory_cap, _get(cfg, "trainer.verifier_memory_gib"), "trainer.verifier_memory_gib")
    from bandpo.reward.scheme import check_random_p

    _rule(check_random_p, _get(cfg, "trainer.reward.random_p"), "trainer.reward.random_p")
    _choice(cfg, "data.template", list(TEMPLATES))
    _validate_placement(cfg)
    from bandpo.config.checks import check_samples

    _rule(check_samples, _get(cfg, "eval.n"), "eval.n")
    if _get(cfg, "eval.seed") is not None:
        _number(cfg, "eval.seed", low=0, integer=True)
    _validate_probe(cfg)

    path = str(_get(cfg, "model.path"))
    looks_local = (
        path.startswith(("/", ".", "~")) or os.sep in path and Path(path).expanduser().parent.exists()
    )
    if looks_local and not Path(path).expanduser().exists() and not _get(cfg, "model.build"):
        raise ConfigError(
            f"config error: model.path {path!r} does not exist (a local folder or a hub id is needed)"
        )


def _validate_probe(cfg: TrainConfig) -> None:
    """``probe.*`` (``bandpo.trainer.probe``), read only when ``probe.every`` turns it on."""
    if not _number(cfg, "probe.every", low=0, integer=True):
        return
    for name in ("limit", "n", "max_tokens", "first_n"):
        _number(cfg, f"probe.{name}", low=1, integer=True)
    _number(cfg, "probe.seed", low=0, integer=True)
    sets = _get(cfg, "probe.datasets")
    _check(
        bool(sets) or bool(_get(cfg, "probe.paths")),
        "probe.datasets",
        "is empty and probe.paths is not set",
        sets,
    )


def reuse_old_logprobs(cfg: TrainConfig) -> bool:
    """Whether the update's first optimizer step takes its old log-probs from its own forward
    (``actor.reuse_old_logprobs``).

    Before the first optimizer step of a rollout the policy is the one of that step's forward, so
    the separate old-logprob pass only needs the rows of the later mini-batches (none with one
    optimizer step per rollout). ``auto`` uses it wherever it applies: everywhere except the
    adaptive band's ``batch`` scale, which needs the step's mean pi_old entropy over all rows
    before the update's first forward (there ``true`` is a config error). With
    ``actor.old_logprobs=rollout`` pi_old is the engines' for every row, so nothing is reused
    (``true`` is a config error there too).
    """
    value = _get(cfg, "actor.reuse_old_logprobs")
    _check(
        value in ("auto", True, False), "actor.reuse_old_logprobs", "must be one of auto, true, false", value
    )
    from_rollout = _get(cfg, "actor.old_logprobs") == "rollout"
    if value is True and from_rollout:
        raise ConfigError(
            "config error: actor.reuse_old_logprobs=true cannot be used with actor.old_logprobs=rollout "
            "(pi_old is the engines' sampling log-probs for every row, the first mini-batch's too); "
            "use auto or false"
        )
    band = cfg.algorithm.band  # null for an algorithm without a band (validate_algorithm refuses one set)
    needs_pass = band is not None and band.adaptive == "entropy" and band.adaptive_norm == "batch"
    if value is True and needs_pass:
        raise ConfigError(
            "config error: actor.reuse_old_logprobs=true cannot be used with algorithm.band.adaptive="
            "entropy and algorithm.band.adaptive_norm=batch (the entropy scale comes from the "
            "old-logprob pass over every row); use auto or false, or adaptive_norm=logv"
        )
    return not needs_pass and not from_rollout and value is not False


def _validate_old_logprobs(cfg: TrainConfig) -> None:
    """``actor.old_logprobs=rollout`` (verl's bypass mode) takes pi_old from the engines' sampling
    log-probs, which is the recomputed pi_old up to the engines' numerics only where both score the
    same policy over the same distribution; each setting where they do not, or whose correction
    pi_old / pi_rollout it would make 1 by construction, is refused naming its key. The engines'
    dtype against the actor's is checked at start-up, once the device is known
    (``bandpo.distributed.precision.check_old_logprobs_dtype``, from ``bandpo.trainer.launch``)."""
    if _get(cfg, "actor.old_logprobs") != "rollout":
        return
    band = cfg.algorithm.band
    lora_dropout = _get(cfg, "actor.lora.rank") > 0 and _get(cfg, "actor.lora.dropout") > 0
    refused = [
        (
            _get(cfg, "trainer.max_staleness") != 0,
            f"trainer.max_staleness={_get(cfg, 'trainer.max_staleness')}",
            "the batch comes from the policy one update older than pi_old; decoupled PPO needs the "
            "recomputed proximal policy",
        ),
        (
            band is not None and band.adaptive == "entropy",
            "algorithm.band.adaptive=entropy",
            "the band's radius needs pi_old's per-token entropy over every row, from the actor's pass",
        ),
        (
            _get(cfg, "algorithm.mismatch.mode") != "none",
            f"algorithm.mismatch.mode={_get(cfg, 'algorithm.mismatch.mode')}",
            "its weight pi_old / pi_rollout would be 1 by construction",
        ),
        (
            _get(cfg, "algorithm.tis_cap") is not None,
            f"algorithm.tis_cap={_get(cfg, 'algorithm.tis_cap')}",
            "its weight pi_old / pi_rollout would be 1 by construction",
        ),
        (
            _get(cfg, "rollout.top_p") < 1 or _get(cfg, "rollout.top_k") > 0,
            f"rollout.top_p={_get(cfg, 'rollout.top_p')} / rollout.top_k={_get(cfg, 'rollout.top_k')}",
            "the engines' log-probs are renormalised over the kept tokens, the actor's cover the vocabulary",
        ),
        (
            lora_dropout,
            f"actor.lora.dropout={_get(cfg, 'actor.lora.dropout')}",
            "the actor's side of the step's health metrics and stale-weights check would be the "
            "update's forward, with adapter dropout",
        ),
    ]
    for bad, setting, why in refused:
        if bad:
            raise ConfigError(
                f"config error: actor.old_logprobs=rollout cannot be used with {setting} ({why}); "
                "use actor.old_logprobs=recompute"
            )


def _validate_lora(cfg: TrainConfig, reuse_old: bool) -> None:
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
    from bandpo.checkpoint.lora_adapter import check_export

    _rule(check_export, _get(cfg, "actor.lora.export"))
    if rank == 0:
        return
    # The reused old log-probs are the update's own training forward: with dropout on the adapter they
    # would be one dropout draw's, not the policy's (the model's own dropout is forced off for this).
    if dropout > 0 and reuse_old:
        raise ConfigError(
            "config error: actor.lora.dropout > 0 cannot be used with actor.reuse_old_logprobs="
            f"{_get(cfg, 'actor.reuse_old_logprobs')} (the first step's old log-probs would come "
            "from a forward with adapter dropout); set actor.reuse_old_logprobs=false or dropout=0"
        )


def _validate_lora_sync(cfg: TrainConfig) -> None:
    """``rollout.lora_sync`` (``bandpo.weight_sync.lora_adapter``), ``rollout.sync_check_tol``
    (``bandpo.trainer.sync_check``) and the stale-adapter test hook."""
    from bandpo.config.checks import check_sync_check_tol
    from bandpo.weight_sync.lora_adapter import check_lora_sync, lora_sync_mode

    rank, backend = _get(cfg, "actor.lora.rank"), _get(cfg, "rollout.backend")
    choice, level = _get(cfg, "rollout.lora_sync"), _get(cfg, "rollout.sleep_level")
    on_cpu = _get(cfg, "trainer.device") == "cpu"  # auto counts as GPUs here (lora_adapter.mode_of)
    _rule(check_lora_sync, choice, rank, backend, level)
    # the first sync's tensor-by-tensor check compares full weights; an adapter engine holds base + adapter
    # (the stale-weights check covers it)
    _check(
        not (
            _get(cfg, "rollout.verify_sync")
            and lora_sync_mode(choice, rank, backend, level, on_cpu) == "adapter"
        ),
        "rollout.verify_sync",
        "cannot be true with rollout.lora_sync=adapter (auto picks it for LoRA on vLLM on GPUs; the engines hold "
        "the base weights + the adapter, checked by rollout.sync_check_tol); set rollout.lora_sync=merged "
        "or verify_sync=false",
        True,
    )
    _rule(
        check_sync_check_tol,
        _get(cfg, "rollout.sync_check_tol"),
        _get(cfg, "trainer.max_staleness"),
        _get(cfg, "rollout.top_p"),
        _get(cfg, "rollout.top_k"),
    )
    hook = _get(cfg, "rollout.inject_stale_adapter")
    _check(
        isinstance(hook, int) and not isinstance(hook, bool) and hook >= 0,
        "rollout.inject_stale_adapter",
        "must be an adapter load number >= 1, or 0 (off)",
        hook,
    )
    _check(
        not hook or choice == "adapter",
        "rollout.inject_stale_adapter",
        "needs rollout.lora_sync=adapter (and actor.lora.rank > 0)",
        hook,
    )


def _validate_staleness(cfg: TrainConfig) -> None:
    """``trainer.max_staleness`` and the CPU thread split it uses (``bandpo.trainer.overlap``); a colocated
    GPU layout is refused here when ``trainer.device=cuda`` (with ``auto``, once the trainer knows the device)."""
    from bandpo.config.checks import MAX_STALENESS, check_layout
    from bandpo.distributed.plan import layout_of

    staleness = _get(cfg, "trainer.max_staleness")
    _check(
        staleness in MAX_STALENESS and not isinstance(staleness, bool),
        "trainer.max_staleness",
        f"must be one of {', '.join(map(str, MAX_STALENESS))}",
        staleness,
    )
    for name in ("rollout.cpu_threads", "rollout.max_num_seqs"):
        if _get(cfg, name) is not None:
            _number(cfg, name, low=1, integer=True)
    if _get(cfg, "trainer.device") == "cuda":
        check_layout(staleness, layout_of(cfg, "cuda"))


def _validate_placement(cfg: TrainConfig) -> None:
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
        make_plan(cfg, shape, decide_device(cfg.trainer.device, cfg.trainer.gpus_per_node or 0))
