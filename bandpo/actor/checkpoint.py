"""Checkpoint plumbing for the actor: RNG states, atomic directory publishing, HF export.

A checkpoint is a directory written by every rank (DeepSpeed shards optimizer state per
rank) into ``<path>.tmp``; rank 0 renames it to ``<path>`` only after all ranks finished
writing and flushing, so a crash mid-save never leaves a half-written ``<path>``. Multi-node
runs need ``path`` on storage all ranks share.

No rank does the slow part alone while the others wait in a collective (whose timeout would
end the run): every rank flushes its own writes to disk, in parallel (``sync_filesystem``
for DeepSpeed's files, whose names are DeepSpeed's business; ``fsync`` for the files it
wrote itself), and the HF export's weight files are written by all ranks, bucket by bucket
in turn; rank 0's own step is the renames.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import random
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from bandpo.errors import UnsafeCheckpoint
from bandpo.run import safe_load
from bandpo.run.checkpoint import fsync_dir

log = logging.getLogger(__name__)


def staging_dir(path: str | os.PathLike) -> Path:
    """Where a checkpoint for ``path`` is written before it is published."""
    path = Path(path)
    return path.with_name(path.name + ".tmp")


def rng_state() -> dict:
    """Python, numpy and torch (CPU + CUDA when present) RNG states, as tensors and plain data only
    (a checkpoint file loads with ``weights_only=True``): numpy's key array becomes an int64 tensor."""
    np_state = np.random.get_state(legacy=False)  # {bit_generator, state: {key, pos}, has_gauss, gauss}
    key = torch.from_numpy(np_state["state"]["key"].astype(np.int64))  # uint32 values: exact in int64
    state = {
        "python": random.getstate(),  # (version, tuple of ints, gauss_next)
        "numpy": {**np_state, "state": {**np_state["state"], "key": key}},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` captured, exactly."""
    random.setstate(state["python"])
    np_state = state["numpy"]
    key = np_state["state"]["key"].numpy().astype(np.uint32)
    np.random.set_state({**np_state, "state": {**np_state["state"], "key": key}})
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
        state = safe_load.load(file)
    except UnsafeCheckpoint:
        _refuse_old_rng_format(file)
        raise
    except Exception as e:
        raise RuntimeError(f"corrupt checkpoint: {file} is unreadable ({e})") from e
    set_rng_state(state)


def _refuse_old_rng_format(file: Path) -> None:
    """Raise when ``file`` is an RNG file of the format bandpo wrote before it loaded checkpoints
    with ``weights_only`` (numpy's state pickled with its ndarray); return otherwise."""
    names = safe_load.unsafe_globals(file)
    if names and all(n.startswith("numpy.") for n in names):
        raise RuntimeError(
            f"old checkpoint format: {file} holds numpy's RNG state as pickled numpy objects, which bandpo "
            f"no longer loads (checkpoint files may hold only tensors and plain data); resume from a "
            f"checkpoint written since, or start anew with trainer.resume=never")


def check_files(folder: str | os.PathLike) -> None:
    """Refuse an actor checkpoint before any rank reads it: an RNG file of the older format, or a file
    whose pickle names code (``UnsafeCheckpoint``, naming it). Imports no DeepSpeed (its classes are
    allowed by name); the ranks' own loads refuse the same files."""
    for file in sorted(Path(folder).glob("rng_rank*.pt")):
        _refuse_old_rng_format(file)
    safe_load.check_folder(folder, names=safe_load.DEEPSPEED_GLOBALS)


def raise_naming_unreadable_file(folder: str | os.PathLike, error: BaseException) -> None:
    """After a failed load from ``folder``: raise naming the first ``.pt`` file torch cannot open
    (``UnsafeCheckpoint`` for one holding code, else "corrupt checkpoint").

    Returns (without raising) when every file opens, so the caller re-raises the original error.
    Cheap enough for an error path: with ``mmap`` the tensor data is mapped, not read.
    """
    allowed = safe_load.deepspeed_globals()
    for file in sorted(Path(folder).rglob("*.pt")):
        try:
            safe_load.load(file, allowed, map_location="cpu", mmap=True)
        except UnsafeCheckpoint as e:
            raise e from error
        except Exception as e:
            raise RuntimeError(f"corrupt checkpoint: {file} is unreadable ({e})") from error


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


def save_hf_folder(
    module,
    buckets: Iterable[list[tuple[str, torch.Tensor]]],
    out: str | os.PathLike,
    source: str,
    rank: int,
    world_size: int,
) -> list[Path]:
    """Write ``module``'s config + the streamed full weights + ``source``'s tokenizer as a HF folder
    into the existing folder ``out``; returns the files this rank wrote (not yet flushed).

    Every rank must drain ``buckets`` (under ZeRO-3 each bucket is a collective gather). Bucket i
    is written by rank ``i % world_size`` as ``model-<i+1>.safetensors``, so the ranks write in
    parallel and each holds one bucket at a time; rank 0 also writes the config, the generation
    config, the index naming every tensor's file, and the tokenizer (no publishing here). A model
    of one bucket is one ``model.safetensors`` without an index, as ``save_pretrained`` writes it.
    """
    from safetensors.torch import save_file

    out = Path(out)
    weight_map: dict[str, str] = {}
    mine: list[Path] = []
    total = 0
    for i, bucket in enumerate(buckets):
        file = out / f"model-{i + 1:05d}.safetensors"
        weight_map.update((name, file.name) for name, _ in bucket)
        total += sum(t.numel() * t.element_size() for _, t in bucket)
        if i % world_size == rank:
            save_file({name: t.contiguous() for name, t in bucket}, str(file), metadata={"format": "pt"})
            mine.append(file)
    if rank != 0:
        return mine
    module.config.save_pretrained(str(out))
    if module.can_generate() and module.generation_config is not None:
        module.generation_config.save_pretrained(str(out))
    if len(set(weight_map.values())) == 1:  # one bucket: rank 0 wrote it
        single = out / "model.safetensors"
        mine[0].rename(single)
        mine[0] = single
        weight_map = dict.fromkeys(weight_map, single.name)
    else:
        index = out / "model.safetensors.index.json"
        index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    _copy_tokenizer(source, out)
    return mine + [p for p in out.iterdir() if p.is_file() and p.name not in weight_map.values()]


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
