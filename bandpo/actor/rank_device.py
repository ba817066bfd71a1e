"""What an actor rank computes on, checked against its plan at start-up.

The plan seats each rank on a GPU share or on CPUs (``bandpo.actor.group.rank_device``), and the
rank's DeepSpeed picks its accelerator from ``DS_ACCELERATOR`` (set per rank from the plan) or
from what torch sees. A rank whose accelerator is not the plan's device would train on the wrong
one without a word (on a GPU node with the CPU accelerator: gloo, no offload, fp32 on the host)
until the first CUDA call of the weight sync failed; ``check_rank_device`` stops it before the
process group forms, and ``check_rank_precision`` once the engine is built, each with one line
naming the rank and its node. ``rank_report`` is what every rank reports (``Actor.info``).
"""

from __future__ import annotations

import torch

from bandpo.errors import RankDeviceError


def node_name() -> str:
    """This process's node as the errors name it: its Ray address and host name."""
    import socket

    host = socket.gethostname()
    try:
        import ray

        return f"node {ray.util.get_node_ip_address()} (host {host})"
    except ImportError:
        return f"host {host}"


def check_rank_device(
    rank: int, expected: str | None, accelerator: str, cuda_devices: int, node: str
) -> None:
    """Raise ``RankDeviceError`` unless rank ``rank`` can compute on ``expected`` ("cuda" | "cpu"; None:
    no plan, nothing to check): DeepSpeed's ``accelerator`` must be that device and, for cuda, torch
    must see a GPU (``cuda_devices``)."""
    if expected is None:
        return
    problem = None
    if accelerator != expected:
        problem = f"DeepSpeed's accelerator is {accelerator}"
    elif expected == "cuda" and cuda_devices < 1:
        problem = "torch sees no CUDA device (a CPU-only torch build, or CUDA_VISIBLE_DEVICES hides it)"
    if problem:
        raise RankDeviceError(
            f"actor rank {rank} on {node}: the plan puts it on {expected} but {problem} "
            f"(DS_ACCELERATOR={_ds_env()}, torch {torch.__version__})"
        )


def _ds_env() -> str:
    import os

    return os.environ.get("DS_ACCELERATOR", "unset")


def weight_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype most of ``module``'s parameter elements are stored in (ZeRO-3: their partitions'
    dtype, counted by their full sizes)."""
    counts: dict[torch.dtype, int] = {}
    for p in module.parameters():
        stored = getattr(p, "ds_tensor", p)
        counts[stored.dtype] = counts.get(stored.dtype, 0) + int(getattr(p, "ds_numel", p.numel()))
    return max(counts, key=counts.get)


def check_rank_precision(rank: int, bf16: bool, engine_dtype: torch.dtype, weights: torch.dtype, node: str):
    """Raise ``RankDeviceError`` unless DeepSpeed computes in the plan's precision (bf16 with ``bf16``,
    else fp32) and most weights are stored in it."""
    want = torch.bfloat16 if bf16 else torch.float32
    if engine_dtype != want or weights != want:
        raise RankDeviceError(
            f"actor rank {rank} on {node}: the plan trains in {_short(want)} but DeepSpeed computes in "
            f"{_short(engine_dtype)} and most weights are {_short(weights)}"
        )


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def rank_report(rank: int, node: str, accelerator: str, device: torch.device, engine, weights) -> dict:
    """What ``Actor.info`` reports: the rank's node, DeepSpeed's accelerator, its torch device, and its
    precision (DeepSpeed's compute dtype and the weights' storage dtype)."""
    compute = engine.get_data_types()[0]
    return {
        "rank": rank,
        "node": node,
        "accelerator": accelerator,
        "device": str(device),
        "precision": f"computes in {_short(compute)}, weights {_short(weights)}",
    }
