"""Durable, atomic writes: what a kill at any moment leaves is the old file or folder or the new one, never
half of one.

A file is written beside its final name, flushed and fsynced, then renamed over it, and the directory
entry fsynced (``write_text_atomic``: the run's ``latest`` pointer, the metrics log, the traces). A
checkpoint folder is written under a staging name (``staging_dir``), each writer flushes its own files
(``sync_filesystem`` for files another library wrote, ``fsync_files`` for its own), and one process
renames it into place (``publish``).
"""

from __future__ import annotations

import ctypes
import os
import shutil
from collections.abc import Iterable
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """fsync a directory, so a rename or new entry inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Write via a temp file + fsync + rename, so readers see the old or the new text."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def staging_dir(path: str | os.PathLike) -> Path:
    """Where a checkpoint for ``path`` is written before it is published."""
    path = Path(path)
    return path.with_name(path.name + ".tmp")


def sync_filesystem(path: str | os.PathLike) -> None:
    """Flush to disk what this node wrote to the filesystem holding ``path`` (``syncfs(2)``; every
    filesystem with ``os.sync`` where the C library has no syncfs). Each rank calls it after its
    own writes: a node can only flush its own page cache, so on shared storage every node must."""
    syncfs = getattr(ctypes.CDLL(None, use_errno=True), "syncfs", None)
    if syncfs is None:
        os.sync()
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        if syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs {path}: {os.strerror(err)}")
    finally:
        os.close(fd)


def fsync_files(files: Iterable[str | os.PathLike]) -> None:
    for file in files:
        with open(file, "rb") as f:
            os.fsync(f.fileno())


def publish(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Rename ``tmp`` to ``path``, replacing an existing ``path`` (rank 0 only, once every rank has
    flushed its files under ``tmp``).

    The directory entries are fsynced first (cheap, unlike the data). Replacing takes two renames
    (old aside, new in); a crash between them leaves ``<path>.old`` holding the previous checkpoint.
    """
    tmp, path = Path(tmp), Path(path)
    for dirpath, _, _ in os.walk(tmp):
        fsync_dir(Path(dirpath))
    old = path.with_name(path.name + ".old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(tmp, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)
