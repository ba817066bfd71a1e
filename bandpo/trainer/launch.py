"""The trainer's start-up (``start``): it builds the run's parts and returns them as one frozen record
(``bandpo.parts.RunParts``) that ``bandpo.trainer.loop.Trainer`` takes.

In start-up order: the model (a recipe's build, ``bandpo.parts.ensure_model``), the training prompts
and the reward scheme from the config (then /dev/shm is cleared of what dead runs left:
``bandpo.shm``), the run's plan on the cluster's devices (``bandpo.parts.resolve_plan``), then the
workers: rollout engines, actor ranks and verifier actors, started overlapped (``start_workers``).
A start-up that fails tears down what it started (``close_workers``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bandpo.config import loss_options, to_plain
from bandpo.data import EpochSampler
from bandpo.distributed import init_ray
from bandpo.distributed.nodes import check_nodes
from bandpo.distributed.precision import check_old_logprobs_dtype
from bandpo.hub import load_tokenizer
from bandpo.parts import (
    RunParts,
    RunPlan,
    Workers,
    ensure_model,
    load_eval,
    load_training_prompts,
    make_actor,
    make_engines,
    make_scorer,
    resolve_plan,
)
from bandpo.run.metrics_log import MetricsLogger
from bandpo.run.worker_logs import setup_run_logs
from bandpo.shm.vllm_leftovers import clean_shm, record_new_entries
from bandpo.shm.weight_files import remove_stale_weight_files
from bandpo.trainer.probe import load_probe_sets
from bandpo.trainer.step_metrics import timed_into
from bandpo.trainer.sync_check import sync_check_tol_of

if TYPE_CHECKING:
    from bandpo.config.schema import TrainConfig


def run_folder(cfg: TrainConfig) -> Path:
    """``trainer.output_dir``, absolute (the driver's: every node writes the same folder) and made,
    with the composed config written into it (``write_config``)."""
    out = Path(os.path.abspath(cfg.trainer.output_dir))
    out.mkdir(parents=True, exist_ok=True)
    write_config(out, cfg)
    return out


def write_config(out: Path, cfg: TrainConfig) -> None:
    """<run>/config.yaml: the composed config, every key (``bandpo.config.schema``)."""
    from omegaconf import OmegaConf

    (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg))


def with_model_path(cfg: TrainConfig, model_path: str) -> TrainConfig:
    """A copy of ``cfg`` whose ``model.path`` is ``model_path`` (``cfg`` itself is left as it is)."""
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=model_path))


def make_sync(cfg: TrainConfig, plan: RunPlan, workers: Workers):
    """The run's weight sync (``bandpo.weight_sync.transport.make_weight_sync``) of ``plan.sync``,
    its files and folders named after the driver's pid."""
    from bandpo.shm.weight_files import SHM_PREFIX
    from bandpo.weight_sync.transport import make_weight_sync

    return make_weight_sync(
        plan.sync,
        workers.actor.workers,
        workers.rollout.workers,
        prefix=f"{SHM_PREFIX}{os.getpid()}",
        engine_tp=int(cfg.rollout.tensor_parallel_size),
        timeout_s=float(cfg.rollout.weight_sync_timeout),
    )


def start_workers(cfg: TrainConfig, plan: RunPlan, phase, into: Workers) -> Workers:
    """Start the rollout engines, the actor ranks and the verifier, overlapped, into ``into``.

    Ray builds actors in the background: the engines and the actor ranks are launched
    first, the verifier starts while they load, then each group is waited for under its
    own stage, so a failure names its group (and ``close_workers`` tears the others
    down). One exception, the colocated GPU layout, where vLLM sizes its KV cache from the GPU
    memory free when it starts: there the actor ranks are launched only once the engines are
    up, or, with ``actor.offload_during_rollout``, first, and the engines once the ranks have
    built and offloaded their states. ``phase(name)`` times a start-up phase.
    """
    from bandpo.actor.setup import cpu_threads_per_rank
    from bandpo.distributed import stage
    from bandpo.trainer.overlap import cpu_threads

    gpu = plan.device == "cuda"
    ro, ac = cfg.rollout, cfg.actor
    placement = plan.placement
    # auto reads this machine's CPU flags: say what it chose
    print(
        f"[bandpo] precision: actor {'bf16' if plan.bf16 else 'fp32'} (actor.bf16={ac.bf16}), engines "
        f"{plan.engine_dtype} (model.dtype={cfg.model.dtype})",
        flush=True,
    )
    check_old_logprobs_dtype(
        ac.old_logprobs, ac.bf16, cfg.model.dtype, plan.bf16, plan.engine_dtype
    )  # before any worker starts
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
    actor_opts = None
    if gpu:
        from bandpo.distributed.placement import actor_options, create_placement_groups, engine_launch

        with stage("start", "placement"):
            into.pgs = create_placement_groups(placement)
        launches = [engine_launch(placement, into.pgs, e) for e in range(ro.num_workers)]
        placed = dict(options_per_worker=[o for o, _ in launches], env_per_worker=[v for _, v in launches])
        actor_opts = [actor_options(placement, into.pgs, r) for r in range(ac.num_workers)]

    def start_actor() -> None:
        with stage("start", "actor"):
            into.actor = make_actor(cfg, plan, ac.cpu_threads if gpu else actor_threads, actor_opts)

    # Colocated with offload: the actor ranks build (every state on the GPU at once) and offload
    # before the engines take their share, so the two never peak together; vLLM 0.32 checks at
    # start that its share is free.
    colocated = placement is not None and placement.sleeps
    actor_first = plan.offload and colocated
    if actor_first:
        start_actor()
        with phase("actor"), stage("start", "actor"):
            into.actor.wait_ready()
    with stage("start", "rollout"):
        into.rollout = make_engines(cfg, plan, env, **placed)
    if colocated and not actor_first:
        with phase("rollout"), stage("start", "rollout"):
            into.rollout.wait_ready()
    if not actor_first:
        start_actor()
    with phase("verifier"), stage("start", "verifier"):  # verifier actors, each with its own grading pool
        into.scorer = make_scorer(cfg, placement)
    with phase("rollout"), stage("start", "rollout"):
        into.rollout.wait_ready()
    with phase("actor"), stage("start", "actor"):
        into.actor.wait_ready()
    return into


def start(cfg: TrainConfig, out: Path) -> RunParts:
    """The run's start-up, in order: the loss options, the worker logs, the model (a recipe's build),
    the tokenizer, the training prompts and their sampler, the held-out sets (the evaluation's and the
    entropy probe's), the adaptive band's log V scale, Ray (after clearing what dead runs left in
    /dev/shm) and the node checks, the run's plan, the
    workers (``start_workers``), the stale-weights check's tolerance, the start-up report and the metrics
    log; returned as one record. ``cfg`` is not changed: a resolved ``model.path`` goes into
    <run>/config.yaml and the metrics log's copy of the config. A failure tears down the workers started."""
    t_setup = time.perf_counter()
    phases: dict[str, float] = {}  # start-up phase -> seconds (printed and written to <run>/startup.json)

    def phase(name: str):
        return timed_into(phases, name)

    loss = loss_options(cfg)  # the policy loss's options, validated once
    logs_dir = setup_run_logs(out, cfg.trainer.verbose)  # worker output: <run>/logs/
    workers = Workers()
    try:
        with phase("model"):
            model_path = ensure_model(cfg.model)
        resolved = cfg
        if model_path != os.path.expanduser(str(cfg.model.path)):
            # A build stood in for an unreachable hub id, or a local path became absolute: config.yaml names
            # the weights it trained, where evaluating its checkpoints takes the config and tokenizer from.
            resolved = with_model_path(cfg, model_path)
            write_config(out, resolved)
        tokenizer = load_tokenizer(model_path, "model.path")  # the first read of a hub model
        prompts = load_training_prompts(cfg, tokenizer)
        sampler = EpochSampler(len(prompts.prompt_ids), seed=cfg.data.shuffle_seed)
        eval_sets = load_eval(cfg)
        probe_sets = load_probe_sets(cfg)
        if loss.band_adaptive == "entropy" and loss.entropy_norm == "logv":
            from transformers import AutoConfig

            vocab = AutoConfig.from_pretrained(model_path).vocab_size
            loss = dataclasses.replace(loss, entropy_scale=math.log(vocab))
        remove_stale_weight_files()
        shm_before = clean_shm(out)
        with phase("ray"):
            device = init_ray(cfg.trainer.ray_address, cfg.trainer.device, logs_dir)
            check_nodes(str(out), model_path=model_path)  # bandpo, releases, run folder, model
            plan = resolve_plan(cfg, device, model_path)  # before any worker starts
        start_workers(cfg, plan, phase, workers)
        sync_tol = sync_check_tol_of(cfg, plan.bf16, plan.engine_dtype)  # the stale-weights check's
        record_new_entries(out, shm_before)  # vLLM's queues: removed by the next start if we die
        report_startup(out, phases, time.perf_counter() - t_setup)
        logger = MetricsLogger(out, cfg.trainer.total_steps, to_plain(cfg.trainer.wandb), to_plain(resolved))
    except BaseException:
        close_workers(workers)
        raise
    return RunParts(
        out=out,
        plan=plan,
        tokenizer=tokenizer,
        prompts=prompts,
        sampler=sampler,
        eval_sets=eval_sets,
        probe_sets=probe_sets,
        loss=loss,
        workers=workers,
        sync_tol=sync_tol,
        logger=logger,
        logs_dir=logs_dir,
    )


def close_workers(workers: Workers, *closers) -> None:
    """Tear down what started: the verifier actors and ``closers`` (the metrics log, the weight sync;
    None: not made), then with Ray up the engines and the placement groups, and Ray itself."""
    import ray

    for closer in (workers.scorer, *closers):
        if closer is not None:
            closer.close()
    if ray.is_initialized():
        if workers.rollout is not None:
            workers.rollout.stop()
        if workers.pgs:
            from bandpo.distributed.placement import remove_placement_groups

            remove_placement_groups(workers.pgs)
        ray.shutdown()


def report_startup(out: Path, phases: dict[str, float], total: float) -> None:
    """One console line and <run>/startup.json: seconds per start-up phase.

    ``verifier`` overlaps the engines' and the actor's loading; ``rollout`` / ``actor`` are the
    waits left after it. ``process`` is the time from interpreter start to ``start`` (imports).
    """
    import json

    import psutil  # a Ray dependency

    phases["setup"] = total
    phases["process"] = time.time() - psutil.Process().create_time() - total
    parts = ", ".join(f"{k} {v:.1f}" for k, v in phases.items() if k not in ("setup", "process"))
    print(f"[bandpo] start-up {total:.1f} s ({parts}; before setup {phases['process']:.1f} s)", flush=True)
    (out / "startup.json").write_text(json.dumps({k: round(v, 3) for k, v in phases.items()}))
