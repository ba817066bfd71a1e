"""The node-local weight file: every tensor in ONE flat file in ``/dev/shm`` (tmpfs, so RAM).

The writer lays the tensors out in the flat format (``bandpo.weight_sync.format``) and sends
``(path, metas)``; the engine maps the file and loads zero-copy views. /dev/shm is per machine,
so each node gets a file of its own (``node_shm_path``; ``bandpo.weight_sync.node``).

The trainer's files are ``SHM_PREFIX`` + driver pid + ``-`` + Ray node id + ``.bin``; those of a
driver that no longer runs are removed at the next start (``remove_stale_weight_files``).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from bandpo.run.shm import alive
from bandpo.weight_sync.format import TensorMeta, layout, metas_from_wire, views

SHM_PREFIX = "/dev/shm/bandpo-weights-"  # + driver pid + "-" + Ray node id + ".bin": a node's weight-sync buffer


def node_shm_path(prefix: str, node_id: str) -> str:
    """The weight file of one Ray node: ``<prefix>-<node id>.bin`` (the id tells nodes sharing a /dev/shm apart)."""
    return f"{prefix}-{node_id}.bin"


def write_weights_shm(named_tensors: Iterable[tuple[str, torch.Tensor]], path: str) -> list[TensorMeta]:
    """Write tensors (any device) into one flat file at ``path`` (use ``/dev/shm/...``); return their metas.

    An existing file is resized and overwritten in place, through a mapping kept from the last
    write to the same file, so a repeat sync costs one memcpy (no page faults on fresh tmpfs
    pages). Readers hold zero-copy views: every reader must finish loading before the next write.
    """
    metas, tensors, total = layout(named_tensors)
    buf = _writable_map(path, max(total, 1))
    for (_, view), t in zip(views(buf, metas), tensors, strict=True):
        view.copy_(t.detach())
    return metas


_WRITE_MAPS: dict[str, tuple[int, int, torch.Tensor]] = {}  # path -> (inode, size, mapped buffer)


def _writable_map(path: str, size: int) -> torch.Tensor:
    """A writable uint8 [size] tensor over the file at ``path`` (created or resized as needed)."""
    # Drop mappings of files deleted or replaced by someone else, so their RAM is returned.
    for p, (inode, _, _) in list(_WRITE_MAPS.items()):
        try:
            current = os.stat(p).st_ino == inode
        except FileNotFoundError:
            current = False
        if not current:
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
    yield from views(buf, metas)


def remove_shm(path: str) -> None:
    """Delete a weight file (frees its RAM); missing files are fine."""
    _WRITE_MAPS.pop(path, None)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


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


def remove_stale_weight_files() -> list[str]:
    """Delete weight-sync buffers of drivers that no longer run (killed mid-sync); returns their paths.

    Each holds a full copy of the weights in RAM (/dev/shm), so a run killed while syncing
    would otherwise leak one model's worth of memory until reboot. Only this machine's files: on a
    multi-node cluster the other nodes' are removed by ``close`` (a killed driver leaves them).
    """
    removed = []
    for path in Path(SHM_PREFIX).parent.glob(Path(SHM_PREFIX).name + "*.bin"):
        pid = path.name[len(Path(SHM_PREFIX).name):-len(".bin")].split("-")[0]
        if pid.isdigit() and not alive(int(pid)):
            try:
                path.unlink()
                removed.append(str(path))
            except OSError:  # another user's file, or removed meanwhile
                pass
    return removed
