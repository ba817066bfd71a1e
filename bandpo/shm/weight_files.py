"""The node-local weight file: every tensor in ONE flat file in ``/dev/shm`` (tmpfs, so RAM).

The writer lays the tensors out in the flat format (``bandpo.flat_buffer``) and sends
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

from bandpo.errors import SharedMemoryFull
from bandpo.flat_buffer import TensorMeta, layout, metas_from_wire, views
from bandpo.shm.vllm_leftovers import alive

COPY_THREADS = 4  # copy threads per weight-file write (``copy_into``)
# + driver pid + "-" + Ray node id + ".bin": a node's weight-sync buffer
SHM_PREFIX = "/dev/shm/bandpo-weights-"


def node_shm_path(prefix: str, node_id: str) -> str:
    """The weight file of one Ray node: ``<prefix>-<node id>.bin`` (the id tells nodes sharing a /dev/shm apart)."""
    return f"{prefix}-{node_id}.bin"


def write_weights_shm(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    path: str,
    *,
    reserve: int = 0,
    threads: int | None = None,
) -> list[TensorMeta]:
    """Write tensors (any device) into one flat file at ``path`` (use ``/dev/shm/...``); return their metas.

    An existing file is resized and overwritten in place, through a mapping kept from the last
    write to the same file, so a repeat sync costs one memcpy (no page faults on fresh tmpfs
    pages). Readers hold zero-copy views: every reader must finish loading before the next write.
    ``reserve``: bytes that must stay free besides the file (``check_shm_space``).
    """
    metas, tensors, total = layout(named_tensors)
    buf = open_weights_shm(path, total, reserve=reserve)
    copy_into(buf, metas, tensors, threads)
    return metas


def open_weights_shm(path: str, total: int, *, reserve: int = 0) -> torch.Tensor:
    """The writable uint8 [total] mapping of the weight file ``path``, after ``check_shm_space``."""
    check_shm_space(path, total, reserve=reserve)
    return _writable_map(path, max(total, 1))


def copy_into(
    buf: torch.Tensor, metas: list[TensorMeta], tensors: list[torch.Tensor], threads: int | None = None
) -> int:
    """Copy each tensor into its view of the flat buffer ``buf``; returns the bytes copied.

    With ``threads`` > 1 the copies run on a thread pool (``copy_`` releases the GIL), largest
    first. benchmarks/rollout.py, 100M model (417 MB), 2 cores shared with other jobs (load
    50-60): 4 threads wrote the kept file in 0.21 s, one thread in 2.98 s; a fresh file 3.85 s
    vs 6.67 s (page faults). On a quiet machine a warm host -> host copy is memory-bandwidth
    bound (7.0 GB/s at 1 or 2 threads, load 4), so there the threads gain little and cost nothing.
    """
    threads = COPY_THREADS if threads is None else threads
    pairs = [(v, t) for (_, v), t in zip(views(buf, metas), tensors, strict=True)]
    if threads <= 1 or len(pairs) < 2:
        for v, t in pairs:
            v.copy_(t.detach())
    else:
        from concurrent.futures import ThreadPoolExecutor

        pairs.sort(key=lambda p: -p[1].numel() * p[1].element_size())
        with ThreadPoolExecutor(min(threads, len(pairs))) as pool:
            list(pool.map(lambda p: p[0].copy_(p[1].detach()), pairs))
    return sum(m.nbytes for m in metas)


def shm_free_bytes(directory: str) -> tuple[int, int]:
    """(free, total) bytes of the file system holding ``directory`` (tmpfs: RAM it may still take)."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def _human(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def check_shm_space(
    path: str, nbytes: int, *, reserve: int = 0, free_total: tuple[int, int] | None = None
) -> None:
    """Raise ``SharedMemoryFull`` unless ``path``'s file system can take ``nbytes`` (+ ``reserve``).

    A write through a shared mapping past a full tmpfs is not an error but a SIGBUS that kills
    the process (Docker's default /dev/shm is 64 MB), so the space is checked before mapping.
    An existing file at ``path`` is rewritten in place: its current size already counts as used.
    ``free_total`` replaces the file system's (free, total) figures (tests).
    """
    try:
        existing = os.path.getsize(path)
    except OSError:
        existing = 0
    parts = f"{nbytes} for the weight file" + (f" + {reserve} for Ray's object-store copy" if reserve else "")
    check_space(
        os.path.dirname(path) or ".",
        nbytes,
        existing=existing,
        reserve=reserve,
        free_total=free_total,
        what="the weight sync",
        parts=parts,
        alternative="set rollout.weight_sync to ipc / nccl on GPU",
    )


def check_space(
    directory: str,
    nbytes: int,
    *,
    existing: int = 0,
    reserve: int = 0,
    free_total: tuple[int, int] | None = None,
    what: str,
    parts: str,
    alternative: str,
) -> None:
    """Raise ``SharedMemoryFull`` unless ``directory``'s file system takes ``nbytes`` more than the
    ``existing`` bytes they replace (+ ``reserve``). The message names ``directory``, ``what`` is
    written there, its size and free space, the bytes needed (``parts``: what they are), the
    container's shared-memory flags and ``alternative``."""
    free, total = free_total if free_total is not None else shm_free_bytes(directory)
    needed = max(nbytes - existing, 0) + reserve
    if needed <= free:
        return
    gib = 1 << 30
    want = -(-(nbytes + reserve + (total - free - existing)) // gib)  # GiB to ask for, rounded up
    raise SharedMemoryFull(
        f"{directory} is too small for {what}: it holds {total} bytes ({_human(total)}) with "
        f"{free} free, and {what} needs {needed} more ({parts}). Give the container more shared memory "
        f"(docker run --shm-size={max(want, 1)}g, or --ipc=host), or {alternative}"
    )


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
    buf = open_weights_shm(path, n)
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
        pid = path.name[len(Path(SHM_PREFIX).name) : -len(".bin")].split("-")[0]
        if pid.isdigit() and not alive(int(pid)):
            try:
                path.unlink()
                removed.append(str(path))
            except OSError:  # another user's file, or removed meanwhile
                pass
    return removed


def driver_weight_files(pids: list[int]) -> list[str]:
    """This machine's weight-sync files of the drivers ``pids`` (the fault test: none may outlive a killed one)."""
    # One file per node, named <pid>-<node id>.bin (<pid>.bin before multi-node sync).
    return sorted(
        str(p)
        for pid in pids
        for pattern in (f"{pid}.bin", f"{pid}-*.bin")
        for p in Path(SHM_PREFIX).parent.glob(Path(SHM_PREFIX).name + pattern)
    )
