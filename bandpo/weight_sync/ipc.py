"""CUDA IPC buckets: tensors on one GPU shared with another process by IPC handle, bucket by bucket.

Tensors are packed into bounded-size CUDA buffers (the flat format of ``bandpo.weight_sync.format``)
whose IPC handles travel pickled; the receiver maps each buffer and loads views of it. Peak extra
memory is one bucket. No trainer path uses this yet (see the package docstring).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Iterator

import torch

from bandpo.weight_sync.format import align, layout, metas_from_wire, metas_to_wire, views

DEFAULT_BUCKET_BYTES = 512 << 20


def iter_ipc_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[bytes]:
    """GPU: pack CUDA tensors into buckets of at most ``bucket_bytes`` and yield one pickled IPC payload each.

    A bucket's memory stays valid until the generator is resumed, so the consumer must finish
    loading a payload (``open_ipc_bucket``) before asking for the next one. A single tensor
    larger than ``bucket_bytes`` gets a bucket of its own.
    """
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0
    held = None  # the last bucket's buffer: alive until the consumer resumes the generator
    for name, t in named_tensors:
        nbytes = align(t.numel() * t.element_size())
        if pending and size + nbytes > bucket_bytes:
            payload, held = _pack_ipc(pending)
            yield payload
            pending, size = [], 0
        pending.append((name, t))
        size += nbytes
    if pending:
        payload, held = _pack_ipc(pending)
        yield payload
    del held


def _pack_ipc(named: list[tuple[str, torch.Tensor]]) -> tuple[bytes, torch.Tensor]:
    """Copy tensors into one CUDA buffer; return (pickled IPC handle + metas, the buffer to keep alive)."""
    from torch.multiprocessing.reductions import reduce_tensor

    metas, tensors, total = layout(named)
    buf = torch.empty(max(total, 1), dtype=torch.uint8, device=tensors[0].device)
    for (_, view), t in zip(views(buf, metas), tensors):
        view.copy_(t.detach())
    # The consumer reads on its own stream in another process: the copies must be done first.
    torch.cuda.current_stream(buf.device).synchronize()
    _, args = reduce_tensor(buf)
    uuid = str(torch.cuda.get_device_properties(buf.device).uuid)
    return pickle.dumps({"uuid": uuid, "args": args, "metas": metas_to_wire(metas)}), buf


def open_ipc_bucket(payload: bytes) -> Iterator[tuple[str, torch.Tensor]]:
    """GPU, receiving side: rebuild a bucket from ``iter_ipc_buckets`` and yield ``(name, tensor)`` views.

    The sender is found by GPU UUID, because CUDA_VISIBLE_DEVICES (set per Ray actor) makes
    device indices differ between processes.
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    msg = pickle.loads(payload)  # payload comes from our own trainer process, never from users
    local = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
    if msg["uuid"] not in local:
        raise RuntimeError(f"IPC bucket lives on GPU {msg['uuid']}, which this process cannot see")
    args = list(msg["args"])
    args[6] = local[msg["uuid"]]  # reduce_tensor's args: index 6 is the storage's device index
    buf = rebuild_cuda_tensor(*args)
    yield from views(buf, metas_from_wire(msg["metas"]))
