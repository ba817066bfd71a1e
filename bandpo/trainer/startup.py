"""Start-up and shutdown pieces of the trainer that hold no training state.

The tiny recipe's model build (``ensure_model``), the cluster's GPU shape (``live_shape``),
cleanup of what dead runs left in /dev/shm (weight-sync buffers, vLLM's queues), and the
engines' orderly shutdown.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from bandpo.run import shm
from bandpo.weight_sync.shm import SHM_PREFIX as SHM_PREFIX  # re-exported: the trainer loop names them here
from bandpo.weight_sync.shm import remove_stale_weight_files as remove_stale_weight_files


def stop_engines(workers, timeout_s: float = 10.0) -> None:
    """Shut the rollout engines down before Ray kills their processes.

    vLLM removes its shared-memory message queue (a /dev/shm file per engine) only in its own
    shutdown; a process killed by ``ray.shutdown`` leaves it behind. Best effort: a dead or
    busy worker (Ctrl-C mid-rollout) must not hold up the exit for more than ``timeout_s``.
    """
    import ray

    refs = [w.shutdown.remote() for w in workers]  # a dead actor's call fails at ray.get, below
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for ref in ready:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError:  # died earlier: the failure was reported then
            pass
        except Exception as e:  # reported, not raised: the run's result stands
            print(f"[bandpo] a rollout engine failed to shut down cleanly: {e}", file=sys.stderr, flush=True)


def live_shape():
    """The running Ray cluster's GPU nodes as a ``ClusterShape`` (the smallest node's GPU count)."""
    import ray

    from bandpo.distributed.plan import ClusterShape

    gpus = [int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")]
    gpu_nodes = [g for g in gpus if g]
    return ClusterShape(len(gpu_nodes) or 1, min(gpu_nodes) if gpu_nodes else 0)


def ensure_model(model_cfg) -> str:
    """The model path, building the tiny recipe's model there first when ``model.build`` asks for it.

    ``model.build_args`` (optional) are fields of ``bandpo.models.tiny_arith.BuildArgs`` (``sft_steps``,
    ``hidden_size``, ...); the folder is rebuilt when they differ from the cached build's.
    """
    import dataclasses

    from omegaconf import OmegaConf

    path = os.path.expanduser(str(model_cfg.path))
    build = model_cfg.get("build")
    build_args = model_cfg.get("build_args") or {}
    build_args = OmegaConf.to_container(build_args, resolve=True) if OmegaConf.is_config(build_args) else dict(build_args)
    if build:  # the recipe's build is cached: it returns at once when the folder is current
        if build != "tiny_arith":
            raise ValueError(f"model.build={build!r} is not a known recipe; valid: tiny_arith")
        from bandpo.models import tiny_arith

        valid = [f.name for f in dataclasses.fields(tiny_arith.BuildArgs)]
        unknown = sorted(set(build_args) - set(valid))
        if unknown:
            raise ValueError(f"model.build_args.{unknown[0]} is not an argument of the tiny_arith build; valid: {valid}")
        tiny_arith.build(path, **build_args)
    return path


def clean_shm(run_dir: Path) -> set[str]:
    """Remove vLLM /dev/shm files of this project's dead runs (``bandpo.run.shm``); the entries left now."""
    removed = shm.remove_dead_entries(run_dir)
    if removed:
        print(f"[bandpo] removed {len(removed)} /dev/shm files left by dead bandpo runs", flush=True)
    return shm.snapshot()
