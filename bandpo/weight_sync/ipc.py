"""CUDA IPC buckets: the colocated layout's transport (``rollout.weight_sync=ipc``).

Per bucket of parameters (gathered bucket by bucket under ZeRO-3), every actor rank copies the
bucket into one CUDA buffer on its own GPU (the flat format of ``bandpo.weight_sync.format``) and
shares it by IPC handle; rank 0 collects every rank's handle, keyed by GPU UUID, and hands them
to each engine, whose workers each map the buffer on their own GPU and load views of it
(``open_ipc_bucket``). The weights never pass through host memory: a GPU -> GPU copy into the
bucket and the engine's load from it. Extra GPU memory: one bucket per rank. Every rank keeps
its bucket alive until rank 0 has seen every engine load it (a barrier).

GPUs are matched by UUID because CUDA_VISIBLE_DEVICES (set per Ray actor) gives one GPU
different indices in different processes.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from bandpo.weight_sync.format import layout, metas_from_wire, metas_to_wire, views

if TYPE_CHECKING:
    from ray.actor import ActorHandle


def gpu_uuid(index: int | None = None) -> str:
    """The UUID of CUDA device ``index`` (default: the current one), the same in every process."""
    return str(torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index).uuid)


def pack_ipc_bucket(named: list[tuple[str, torch.Tensor]]) -> tuple[str, bytes, torch.Tensor]:
    """Copy CUDA tensors into one buffer on their GPU; return (GPU UUID, pickled IPC handle + metas,
    the buffer, which the caller keeps alive until every reader has loaded it)."""
    from torch.multiprocessing.reductions import reduce_tensor

    metas, tensors, total = layout(named)
    buf = torch.empty(max(total, 1), dtype=torch.uint8, device=tensors[0].device)
    for (_, view), t in zip(views(buf, metas), tensors):
        view.copy_(t.detach())
    # The reader works on its own stream in another process: the copies must have landed.
    torch.cuda.current_stream(buf.device).synchronize()
    _, args = reduce_tensor(buf)
    return gpu_uuid(buf.device.index), pickle.dumps({"args": args, "metas": metas_to_wire(metas)}), buf


def open_ipc_bucket(payloads: dict[str, bytes]) -> Iterator[tuple[str, torch.Tensor]]:
    """Receiving side: map the bucket packed on this process's current GPU and yield ``(name, view)``.

    ``payloads``: GPU UUID -> payload of ``pack_ipc_bucket`` (one per actor rank).
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    here = torch.cuda.current_device()
    uuid = gpu_uuid(here)
    if uuid not in payloads:
        raise RuntimeError(f"no actor rank packed a weight bucket on this engine's GPU {uuid} (ranks' GPUs: "
                           f"{sorted(payloads)}); rollout.weight_sync=ipc needs the colocated layout")
    msg = pickle.loads(payloads[uuid])  # payload comes from our own actor ranks, never from users
    args = list(msg["args"])
    args[6] = here  # reduce_tensor's args: index 6 is the storage's device index, local to the sender
    buf = rebuild_cuda_tensor(*args)
    yield from views(buf, metas_from_wire(msg["metas"]))


def send_ipc(
    buckets: Iterable[list[tuple[str, torch.Tensor]]],
    engines: list[ActorHandle],
    *,
    driver: bool,
    all_gather: Callable[[object], list],
    barrier: Callable[[], None],
) -> int:
    """One actor rank's side of an IPC sync: every rank packs each bucket, ``driver`` (rank 0) loads
    it into every engine (``RolloutWorker.ipc_update``). Collective: all ranks call it with the same
    buckets. ``all_gather`` / ``barrier``: the ranks' collectives. Returns the bucket count."""
    import ray

    if driver:
        ray.get([e.ipc_update.remote("begin") for e in engines])
    count = 0
    try:
        for bucket in buckets:
            uuid, payload, buf = pack_ipc_bucket(bucket)
            by_gpu = dict(all_gather((uuid, payload)))
            if driver:
                ray.get([e.ipc_update.remote("load", by_gpu) for e in engines])
            barrier()  # every rank's buffer stays alive until all engines have loaded this bucket
            del buf
            count += 1
    finally:
        if driver:
            ray.get([e.ipc_update.remote("finish") for e in engines])
    return count
