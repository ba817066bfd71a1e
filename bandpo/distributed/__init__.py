"""Ray for the trainer's workers: start-up (``init_ray``), the driver's device, failure reporting (``stage``).

Where the workers go is ``plan`` (the placement plan, pure Python), ``placement`` (the plan as
Ray placement groups and options) and ``check`` (the plan on a simulated cluster). One node with
n GPUs: the actor ranks and the vLLM engines share the GPUs (colocated, vLLM sleeps during the
update) unless the config splits them. A multi-node cluster is joined through ``RAY_ADDRESS``
(or ``trainer.ray_address``). On CPU everything runs in one local Ray instance.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from bandpo.distributed.plan import decide_device
from bandpo.errors import WorkerFailure

# Environment every worker needs, forwarded into Ray's runtime_env.
FORWARDED_ENV = ("DS_ACCELERATOR", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "TOKENIZERS_PARALLELISM",
                 "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "WANDB_MODE", "OMP_NUM_THREADS",
                 "PYTHONPATH", "VLLM_LOGGING_LEVEL")


def resolve_device(device: str) -> str:
    """The driver's device for ``trainer.device=device``: ``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``."""
    if device != "auto":
        return device  # no torch import (and no CUDA initialisation) when the config names the device
    import torch

    return decide_device(device, torch.cuda.device_count() if torch.cuda.is_available() else 0)


def init_ray(address: str | None, device: str, logs_dir=None) -> None:
    """Join ``address`` / ``$RAY_ADDRESS`` if given, else start a local instance sized to this machine.

    With ``logs_dir``, every worker's output goes to ``<logs_dir>/`` instead of the driver's
    console: ``ray-workers.log`` until a worker group's actor names its own file
    (``rollout.log``, ``actor.log``, ``verifier.log``; ``bandpo.run.worker_logs``).
    """
    import logging

    import ray

    if ray.is_initialized():
        return
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    runtime_env: dict = {"env_vars": env}
    quiet = logs_dir is not None
    if quiet:
        from bandpo.run.worker_logs import LOG_ENV, SETUP_HOOK

        env[LOG_ENV] = str(os.path.join(logs_dir, "ray-workers.log"))
        runtime_env["worker_process_setup_hook"] = SETUP_HOOK
    kw = dict(runtime_env=runtime_env, log_to_driver=not quiet,
              logging_level=logging.WARNING if quiet else logging.INFO)
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, **kw)
    else:
        # Logical CPUs: the workers of a tiny CPU run (rollout, actor, eval) exceed 2 cores
        # by count but take turns, so oversubscribing the scheduler is what we want.
        # address="local": a new instance even when another Ray on this machine (a `ray start`, a
        # test cluster) would otherwise be joined, with num_cpus refused.
        ray.init(address="local", num_cpus=max(8, os.cpu_count() or 1), include_dashboard=False, **kw)


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
