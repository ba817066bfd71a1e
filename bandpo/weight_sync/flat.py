"""Moving actor weights into a running rollout engine without a checkpoint on disk.

CPU: the actor writes every tensor into ONE flat file in ``/dev/shm`` (tmpfs, so RAM) and
sends ``(path, metas)``; the engine maps the file and loads zero-copy views. /dev/shm is per
machine, so each node gets a file of its own (``node_shm_path``; ``bandpo.weight_sync.node``). vLLM's
``collective_rpc`` turns tensors in its arguments into plain lists, so tensors never ride the
RPC itself; only the small metadata does (as plain tuples, see ``metas_to_wire``).

GPU: tensors are packed into bounded-size CUDA buckets and shared by CUDA IPC handles
(``iter_ipc_buckets`` / ``open_ipc_bucket``); peak extra memory is one bucket.
"""

from __future__ import annotations

import mmap
import os
import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

ALIGN = 64  # bytes; keeps every view cache-line aligned (and aligned for any dtype)
DEFAULT_BUCKET_BYTES = 512 << 20


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lies in a flat buffer: ``offset`` in bytes, ``dtype`` as in ``torch.<dtype>``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _dtype(self.dtype).itemsize


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise TypeError(f"unknown dtype {name!r}")
    return dt


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[TensorMeta], list[torch.Tensor], int]:
    """Assign aligned offsets. Returns (metas, tensors in the same order, total bytes)."""
    metas, tensors, offset = [], [], 0
    for name, t in named_tensors:
        metas.append(TensorMeta(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
        tensors.append(t)
        offset = _align(offset + t.numel() * t.element_size())
    return metas, tensors, offset


def _views(buf: torch.Tensor, metas: list[TensorMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """Typed views into a flat uint8 buffer ``buf`` [total_bytes]."""
    for m in metas:
        yield m.name, buf[m.offset : m.offset + m.nbytes].view(_dtype(m.dtype)).view(m.shape)


def write_weights_shm(named_tensors: Iterable[tuple[str, torch.Tensor]], path: str) -> list[TensorMeta]:
    """Write tensors (any device) into one flat file at ``path`` (use ``/dev/shm/...``); return their metas.

    An existing file is resized and overwritten in place, through a mapping kept from the last
    write to the same file, so a repeat sync costs one memcpy (no page faults on fresh tmpfs
    pages). Readers hold zero-copy views: every reader must finish loading before the next write.
    """
    metas, tensors, total = layout(named_tensors)
    buf = _writable_map(path, max(total, 1))
    for (_, view), t in zip(_views(buf, metas), tensors, strict=True):
        view.copy_(t.detach())
    return metas


_WRITE_MAPS: dict[str, tuple[int, int, torch.Tensor]] = {}  # path -> (inode, size, mapped buffer)


def _writable_map(path: str, size: int) -> torch.Tensor:
    """A writable uint8 [size] tensor over the file at ``path`` (created or resized as needed)."""
    # Drop mappings of files deleted or replaced by someone else, so their RAM is returned.
    for p, (inode, _, _) in list(_WRITE_MAPS.items()):
        try:
            alive = os.stat(p).st_ino == inode
        except FileNotFoundError:
            alive = False
        if not alive:
            del _WRITE_MAPS[p]
    with open(path, "r+b" if os.path.exists(path) else "w+b") as f:
        if os.fstat(f.fileno()).st_size != size:
            f.truncate(size)
        inode = os.fstat(f.fileno()).st_ino
        cached = _WRITE_MAPS.get(path)
        if cached is not None and cached[:2] == (inode, size):
            return cached[2]
        # MAP_POPULATE faults every page in with one call: ~2x faster than touching them one by one.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        buf = torch.frombuffer(mmap.mmap(f.fileno(), size, flags=flags), dtype=torch.uint8)
    _WRITE_MAPS[path] = (inode, size, buf)
    return buf


def read_weights_shm(path: str, metas: list[TensorMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` views of a file written by ``write_weights_shm`` (zero-copy, read-only use)."""
    metas = metas_from_wire(metas)
    total = max((m.offset + m.nbytes for m in metas), default=0)
    size = os.path.getsize(path)
    if size < total:
        raise ValueError(f"{path} holds {size} bytes but the metadata needs {total}")
    buf = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    yield from _views(buf, metas)


def remove_shm(path: str) -> None:
    """Delete a weight file (frees its RAM); missing files are fine."""
    _WRITE_MAPS.pop(path, None)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def metas_to_wire(metas: Iterable[TensorMeta]) -> list[tuple[str, str, list[int], int]]:
    """Plain tuples that survive vLLM's msgpack RPC unchanged in meaning."""
    return [(m.name, m.dtype, list(m.shape), m.offset) for m in metas]


def metas_from_wire(items: Iterable) -> list[TensorMeta]:
    """Inverse of ``metas_to_wire``; accepts TensorMeta objects, tuples/lists, or dicts."""
    out = []
    for it in items:
        if isinstance(it, TensorMeta):
            out.append(it)
        elif isinstance(it, dict):
            out.append(TensorMeta(it["name"], it["dtype"], tuple(it["shape"]), int(it["offset"])))
        else:
            name, dtype, shape, offset = it
            out.append(TensorMeta(name, dtype, tuple(shape), int(offset)))
    return out


def copy_bytes_baseline(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy every tensor once into a fresh flat buffer in process memory (the benchmark's baseline).

    Returns the bytes copied.
    """
    metas, tensors, total = layout(named_tensors)
    buf = torch.empty(max(total, 1), dtype=torch.uint8)
    for (_, view), t in zip(_views(buf, metas), tensors):
        view.copy_(t.detach())
    return total


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
        nbytes = _align(t.numel() * t.element_size())
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
    for (_, view), t in zip(_views(buf, metas), tensors):
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
    yield from _views(buf, metas_from_wire(msg["metas"]))


def node_shm_path(prefix: str, node_id: str) -> str:
    """The weight file of one Ray node: ``<prefix>-<node id>.bin`` (the id tells nodes sharing a /dev/shm apart)."""
    return f"{prefix}-{node_id}.bin"


def read_file_bytes(path: str):
    """A read-only uint8 numpy view of the whole file at ``path`` (mapped, not copied)."""
    import numpy as np

    size = os.path.getsize(path)
    if size == 0:
        return np.zeros(0, dtype=np.uint8)
    with open(path, "rb") as f:
        return np.frombuffer(mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ), dtype=np.uint8)


def write_file_bytes(data, path: str) -> int:
    """Write a flat uint8 array (e.g. from ``read_file_bytes`` on another node) to ``path``, reusing its mapping.

    Returns the bytes written.
    """
    n = int(data.size)
    buf = _writable_map(path, max(n, 1))
    buf.numpy()[:n] = data  # numpy: the source may be a read-only object-store view, which torch warns about
    return n
