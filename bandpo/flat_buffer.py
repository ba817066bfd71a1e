"""The flat weight buffer every transport shares: tensors laid out back to back in one byte buffer.

Outside both its users, the transports (``bandpo.weight_sync``) and the node-local weight file
(``bandpo.shm.weight_files``), so that ``bandpo.shm`` imports nothing from ``bandpo.weight_sync``
(which imports it); torch is its only dependency.

Each tensor starts at an ``ALIGN``-byte boundary and is described by a ``TensorMeta`` (name,
dtype, shape, byte offset); a receiver rebuilds typed zero-copy views from the buffer and the
metas alone. vLLM's ``collective_rpc`` turns tensors in its arguments into plain lists, so the
metas travel as plain tuples (``metas_to_wire``), never the tensors themselves.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

ALIGN = 64  # bytes; keeps every view cache-line aligned (and aligned for any dtype)


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


def align(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN``."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> tuple[list[TensorMeta], list[torch.Tensor], int]:
    """Assign aligned offsets. Returns (metas, tensors in the same order, total bytes)."""
    named = list(named_tensors)
    metas, total = plan_layout((n, t.dtype, tuple(t.shape)) for n, t in named)
    return metas, [t for _, t in named], total


def plan_layout(
    specs: Iterable[tuple[str, torch.dtype | str, tuple[int, ...]]],
) -> tuple[list[TensorMeta], int]:
    """Offsets from ``(name, dtype, shape)`` alone, so a writer can size the buffer before holding any
    tensor (ZeRO-3 gathers each bucket only when it is copied). Returns (metas, total bytes)."""
    metas, offset = [], 0
    for name, dtype, shape in specs:
        meta = TensorMeta(name, str(dtype).removeprefix("torch."), tuple(int(s) for s in shape), offset)
        metas.append(meta)
        offset = align(offset + meta.nbytes)
    return metas, offset


def views(buf: torch.Tensor, metas: list[TensorMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """Typed views into a flat uint8 buffer ``buf`` [total_bytes]."""
    for m in metas:
        yield m.name, buf[m.offset : m.offset + m.nbytes].view(_dtype(m.dtype)).view(m.shape)


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
    for (_, view), t in zip(views(buf, metas), tensors):
        view.copy_(t.detach())
    return total


class HostCopyCounter:
    """Counts the bytes torch copies INTO host (CPU) memory while active: ``copy_`` into a CPU tensor,
    ``.to("cpu")`` / ``clone`` producing one. A dispatch mode, so thread-local: copies on other
    threads (``shm.copy_into`` with threads > 1) are not seen. For benchmarks and tests.

        with HostCopyCounter() as c:
            ...
        c.bytes
    """

    def __init__(self) -> None:
        self.bytes = 0
        self._mode = None

    def __enter__(self) -> HostCopyCounter:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = func.overloadpacket.__name__
                dst = args[0] if name == "copy_" else out if name in ("_to_copy", "clone") else None
                if isinstance(dst, torch.Tensor) and dst.device.type == "cpu":
                    counter.bytes += dst.numel() * dst.element_size()
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
