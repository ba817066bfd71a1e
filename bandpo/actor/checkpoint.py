"""Checkpoint plumbing for the actor: RNG states, atomic directory publishing, HF export.

A checkpoint is a directory written by every rank (DeepSpeed shards optimizer state per
rank) into ``<path>.tmp``; rank 0 fsyncs it and renames it to ``<path>`` only after all
ranks finished, so a crash mid-save never leaves a half-written ``<path>``. Multi-node
runs need ``path`` on storage all ranks share.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from bandpo.run.checkpoint import fsync_dir

log = logging.getLogger(__name__)


def staging_dir(path: str | os.PathLike) -> Path:
    """Where a checkpoint for ``path`` is written before it is published."""
    path = Path(path)
    return path.with_name(path.name + ".tmp")


def rng_state() -> dict:
    """Python, numpy and torch (CPU + CUDA when present) RNG states."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` captured."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_rng(folder: str | os.PathLike, rank: int) -> None:
    torch.save(rng_state(), Path(folder) / f"rng_rank{rank}.pt")


def load_rng(folder: str | os.PathLike, rank: int) -> None:
    file = Path(folder) / f"rng_rank{rank}.pt"
    if not file.exists():
        raise FileNotFoundError(
            f"checkpoint {folder} has no RNG state for rank {rank} (saved with fewer ranks?)"
        )
    try:
        # numpy's state is a tuple with an ndarray: not loadable with weights_only.
        state = torch.load(file, weights_only=False)
    except Exception as e:
        raise RuntimeError(f"corrupt checkpoint: {file} is unreadable ({e})") from e
    set_rng_state(state)


def raise_naming_unreadable_file(folder: str | os.PathLike, error: BaseException) -> None:
    """After a failed load from ``folder``: raise naming the first ``.pt`` file torch cannot open.

    Returns (without raising) when every file opens, so the caller re-raises the original error.
    Cheap enough for an error path: with ``mmap`` the tensor data is mapped, not read.
    """
    for file in sorted(Path(folder).rglob("*.pt")):
        try:
            torch.load(file, map_location="cpu", weights_only=False, mmap=True)
        except Exception as e:
            raise RuntimeError(f"corrupt checkpoint: {file} is unreadable ({e})") from error


def _fsync_tree(root: Path) -> None:
    """Flush every file and directory under ``root`` to disk (rename is only atomic for what is on disk)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(dirpath))


def publish(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """fsync ``tmp`` and rename it to ``path``, replacing an existing ``path`` (rank 0 only).

    Replacing takes two renames (old aside, new in); a crash between them leaves
    ``<path>.old`` holding the previous checkpoint.
    """
    tmp, path = Path(tmp), Path(path)
    _fsync_tree(tmp)
    old = path.with_name(path.name + ".old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(tmp, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def save_hf_folder(
    module,
    buckets: Iterable[list[tuple[str, torch.Tensor]]],
    out: str | os.PathLike,
    source: str,
    is_writer: bool,
) -> None:
    """Write ``module``'s config + the streamed full weights + ``source``'s tokenizer as a HF folder.

    Every rank must drain ``buckets`` (under ZeRO-3 each bucket is a collective gather);
    only the writer (rank 0) keeps the tensors and writes ``out`` (no publishing here).
    """
    state: dict[str, torch.Tensor] = {}
    for bucket in buckets:
        if is_writer:
            state.update(bucket)
    if not is_writer:
        return
    module.save_pretrained(str(out), state_dict=state, safe_serialization=True)
    _copy_tokenizer(source, out)


def _copy_tokenizer(source: str, out: str | os.PathLike) -> None:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as e:  # a bare weights folder: vLLM then needs an explicit tokenizer path
        log.warning("export_hf: no tokenizer could be loaded from %s (%s); exported without one", source, e)
        return
    tok.save_pretrained(str(out))


def iter_tensors(buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Flatten ``named_weights`` buckets into (name, tensor) pairs."""
    for bucket in buckets:
        yield from bucket
