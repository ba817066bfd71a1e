"""Ray for the trainer's workers: start-up (``init_ray``), the driver's device, failure reporting (``stage``).

Where the workers go is ``plan`` (the placement plan, pure Python), ``placement`` (the plan as
Ray placement groups and options) and ``check`` (the plan on a simulated cluster). One node with
n GPUs: the actor ranks and the vLLM engines share the GPUs (colocated, vLLM sleeps during the
update) unless the config splits them. A multi-node cluster is joined through ``RAY_ADDRESS``
(or ``trainer.ray_address``): the job carries the bandpo package and the variables users set
(``forwarded_env``) to every node, and ``bandpo.distributed.nodes`` checks at start-up that every
node imports bandpo, runs the driver's library versions and sees the run folder (and a local
model). Under Ray's Jobs API (``ray job submit``) the job's own runtime_env comes first: the driver
adds only what it lacks (``ray_init_options``). On CPU everything runs in one local Ray instance.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager

from bandpo.distributed.plan import decide_device
from bandpo.errors import WorkerFailure

# What users set for the workers, forwarded to every Ray worker on every node (the job's
# runtime_env and each actor rank's): variables by prefix and by name. Ray starts a node's workers
# from that node's raylet, so anything exported only in the driver's shell (a token for a gated
# model, NCCL's debug level) would otherwise never reach a worker on another machine.
# Ray shows a job's runtime_env in its dashboard: HF_TOKEN is visible there like every other one.
FORWARDED_PREFIXES = (
    "HF_",
    "HUGGING_FACE_",
    "NCCL_",
    "TORCH_NCCL_",
    "VLLM_",
    "WANDB_",
    "TRANSFORMERS_",
    "DS_",
)
FORWARDED_NAMES = (
    "PYTORCH_CUDA_ALLOC_CONF",
    "CUDA_LAUNCH_BLOCKING",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "TORCH_DISTRIBUTED_DEBUG",
    "TORCH_SHOW_CPP_STACKTRACES",
    "TOKENIZERS_PARALLELISM",
)
# Matched by a prefix but different on every node or process: vLLM's address of its own node, its port
# (every engine of a node would bind the one the driver names: colocated engines race for it) and its
# data-parallel rank and master (the GPUs a worker sees, CUDA_VISIBLE_DEVICES, Ray sets per worker).
NOT_FORWARDED = (
    "VLLM_HOST_IP",
    "VLLM_PORT",
    "VLLM_DP_RANK",
    "VLLM_DP_RANK_LOCAL",
    "VLLM_DP_MASTER_IP",
    "VLLM_DP_MASTER_PORT",
)
# Matched by a prefix but each node's own: paths on its file system (caches, config roots, token
# files, vLLM's IPC socket folder, libraries of its install), which of its network interfaces and
# InfiniBand adapters NCCL uses (names differ between machine types). Set them on each node before
# its `ray start` (its workers inherit them); the driver's would override every node's.
# (GLOO_SOCKET_IFNAME, OMP_NUM_THREADS and PYTHONPATH, per node too, are neither matched nor named.)
PER_NODE = (
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_ASSETS_CACHE",
    "HF_DATASETS_CACHE",
    "HF_XET_CACHE",
    "HF_MODULES_CACHE",
    "HF_TOKEN_PATH",
    "HF_STORED_TOKENS_PATH",
    "TRANSFORMERS_CACHE",
    "VLLM_CACHE_ROOT",
    "VLLM_CONFIG_ROOT",
    "VLLM_ASSETS_CACHE",
    "VLLM_XLA_CACHE_PATH",
    "VLLM_RPC_BASE_PATH",
    "VLLM_NCCL_SO_PATH",
    "VLLM_CUDART_SO_PATH",
    "NCCL_SOCKET_IFNAME",
    "NCCL_IB_HCA",
    "NCCL_TOPO_FILE",
)
# DeepSpeed's accelerator is chosen per actor rank from the plan (``bandpo.actor.group``), never the
# driver's: train.sh exports DS_ACCELERATOR=cpu on a head node without GPUs.
PER_RANK = ("DS_ACCELERATOR",)


def forwarded_env(environ=None) -> dict[str, str]:
    """The variables of ``environ`` (default: this process's) that every worker gets: ``FORWARDED_PREFIXES``
    and ``FORWARDED_NAMES``, less ``NOT_FORWARDED``, ``PER_NODE`` and ``PER_RANK``."""
    environ = os.environ if environ is None else environ
    kept = (*NOT_FORWARDED, *PER_NODE, *PER_RANK)
    return {
        k: v
        for k, v in environ.items()
        if (k in FORWARDED_NAMES or k.startswith(FORWARDED_PREFIXES)) and k not in kept
    }


def resolve_device(device: str) -> str:
    """This machine's device for ``trainer.device=device``: ``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``.

    Right for a local Ray instance (its GPUs are this machine's); a run that joins a cluster
    takes ``cluster_device`` instead, from what the cluster has.
    """
    if device != "auto":
        return device  # no torch import (and no CUDA initialisation) when the config names the device
    import torch

    return decide_device(device, torch.cuda.device_count() if torch.cuda.is_available() else 0)


def cluster_device(device: str) -> str:
    """``trainer.device=device`` on the Ray cluster this process is connected to: ``auto`` counts the
    cluster's GPUs (``ray.cluster_resources()``), so a CPU-only head node still drives a GPU cluster."""
    if device != "auto":
        return device
    import ray

    return decide_device(device, int(ray.cluster_resources().get("GPU", 0)))


def init_ray(address: str | None, device: str, logs_dir=None) -> str:
    """Join ``address`` / ``$RAY_ADDRESS`` if given, else start a local instance sized to this machine.

    Returns the run's device for ``trainer.device=device`` (``auto``: ``cuda`` when the cluster
    has GPUs, see ``cluster_device``; a local instance has this machine's). With ``logs_dir``,
    every worker's output goes to ``<logs_dir>/`` instead of the driver's console:
    ``ray-workers.log`` until a worker group's actor names its own file (``rollout.log``,
    ``actor.log``, ``verifier.log``; ``bandpo.run.worker_logs``).
    """
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        return cluster_device(device)
    if not address:
        device = resolve_device(device)
    if device == "cpu":  # this process's DeepSpeed; the actor ranks get theirs from the plan
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    kw = ray_init_options(logs_dir, ship_code=bool(address))
    if address:
        ray.init(address=address, **kw)
        device = cluster_device(device)
    else:
        # Logical CPUs: the workers of a tiny CPU run (rollout, actor, eval) exceed 2 cores
        # by count but take turns, so oversubscribing the scheduler is what we want.
        # address="local": a new instance even when another Ray on this machine (a `ray start`, a
        # test cluster) would otherwise be joined, with num_cpus refused.
        ray.init(address="local", num_cpus=max(8, os.cpu_count() or 1), include_dashboard=False, **kw)
    stop_on_sigterm()
    return device


def stop_on_sigterm() -> None:
    """From now on SIGTERM (``kill``, ``timeout``, a scheduler's cancel) ends the driver as Ctrl-C does:
    an exception that unwinds through the trainer's ``finally`` (engines stopped, placement groups
    removed, ``ray.shutdown``), then exit status 143. Ray's driver otherwise dies in its C++ signal
    handler with no clean-up, and Ray's agents (and, when the signal went to the process group, its
    workers) outlive it. A second SIGTERM kills at once, as the default would. Main thread only:
    Python runs signal handlers there and refuses to install them elsewhere."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum, frame):
        signal.signal(signum, signal.SIG_DFL)
        print("[bandpo] SIGTERM: stopping the run's workers (another SIGTERM kills at once)", file=sys.stderr)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def ray_init_options(logs_dir=None, ship_code: bool = False) -> dict:
    """``ray.init`` options shared by both ways of starting: the job's runtime_env (``forwarded_env``,
    with ``logs_dir`` the worker-log hook, with ``ship_code`` the bandpo package) and how much of the
    workers' output reaches the console.

    ``ship_code`` (joining an existing cluster): the driver's bandpo package goes with the job
    (Ray's ``py_modules``), so every node runs the driver's code, whether or not bandpo is
    installed there (a node's own copy would be shadowed; ``bandpo.distributed.nodes`` checks it imports).
    """
    import logging

    env = forwarded_env()
    runtime_env: dict = {"env_vars": env}
    if ship_code:
        import bandpo

        runtime_env["py_modules"] = [os.path.dirname(os.path.abspath(bandpo.__file__))]
        runtime_env["excludes"] = ["__pycache__", "*.pyc"]
    quiet = logs_dir is not None
    if quiet:
        from bandpo.run.worker_logs import SETUP_HOOK, worker_log_env

        env.update(worker_log_env(logs_dir))
        runtime_env["worker_process_setup_hook"] = SETUP_HOOK
    job = job_runtime_env()
    if job is not None:
        runtime_env, dropped = without_job_keys(runtime_env, job)
        if dropped:
            print(
                f"[bandpo] the job's runtime_env already sets {', '.join(dropped)}: the job's apply",
                flush=True,
            )
    return dict(
        runtime_env=runtime_env,
        log_to_driver=not quiet,
        logging_level=logging.WARNING if quiet else logging.INFO,
    )


def job_runtime_env(environ=None) -> dict | None:
    """The runtime_env of the Ray job this driver runs in under Ray's Jobs API (``ray job submit``), None
    outside one. Ray's job supervisor hands it to the entrypoint as JSON in ``RAY_JOB_CONFIG_JSON_ENV_VAR``
    (ray/dashboard/modules/job/job_supervisor.py), and ``ray.init`` merges ours into it
    (ray/_private/worker.py), refusing any top-level key or variable the two share."""
    import json

    environ = os.environ if environ is None else environ
    raw = environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if raw is None:
        return None
    return json.loads(raw).get("runtime_env") or {}


def without_job_keys(runtime_env: dict, job: dict) -> tuple[dict, list[str]]:
    """``runtime_env`` less what the job's runtime_env ``job`` already sets (its fields, its variables),
    and the names left out. Ray merges the two only when they share nothing
    (``ray.runtime_env.runtime_env._merge_runtime_env``). A shared variable loses nothing: the job's
    variables are in the driver's own environment too (the supervisor starts the entrypoint with them),
    so ours had the same value. A shared field keeps the job's: its ``py_modules`` must then carry bandpo
    (or its ``working_dir`` hold it), its ``worker_process_setup_hook`` replaces the worker-log hook."""
    job_vars = job.get("env_vars") or {}
    ours = {k: v for k, v in runtime_env.items() if k != "env_vars" and k not in job}
    env = {k: v for k, v in runtime_env.get("env_vars", {}).items() if k not in job_vars}
    if env:
        ours["env_vars"] = env
    dropped = sorted(k for k in runtime_env if k != "env_vars" and k in job)
    dropped += sorted(k for k in runtime_env.get("env_vars", {}) if k in job_vars)
    return ours, dropped


def local_gpu_index(assigned: list, visible: str | None, rank: int, device_count: int) -> int:
    """The torch device index of this process's GPU.

    ``assigned``: the GPU ids Ray gave this worker (``ray.get_gpu_ids()``); Ray narrows
    ``CUDA_VISIBLE_DEVICES`` (``visible``) to them, so the index is the id's position there; with
    ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` every GPU stays visible and the id is the index.
    A worker with a fraction of a GPU (the colocated layout) still gets one id. Outside a Ray GPU
    worker (a launcher that shows every GPU to every rank): ``rank % device_count``.
    """
    if not assigned:
        return rank % max(device_count, 1)
    gpu = str(assigned[0])
    if not visible:
        return int(gpu)
    ids = [v.strip() for v in visible.split(",")]
    if gpu not in ids:
        raise RuntimeError(f"Ray assigned GPU {gpu} but CUDA_VISIBLE_DEVICES={visible} does not show it")
    return ids.index(gpu)


@contextmanager
def stage(name: str, workers: str):
    """Turn a Ray worker death or remote exception into a ``WorkerFailure`` naming workers and stage."""
    from ray.exceptions import RayActorError, RayTaskError

    try:
        yield
    except RayActorError as e:
        raise WorkerFailure(f"{workers} worker died during stage '{name}': {e}") from e
    except RayTaskError as e:
        raise WorkerFailure(f"{workers} worker failed during stage '{name}': {e}") from e
