"""The actor ranks' checkpoint: DeepSpeed's state of every rank, each rank's RNG states, and the HF export.

``ActorCheckpoints`` is a base of ``bandpo.actor.worker.Actor`` (Ray calls its methods on every rank):
``save_checkpoint`` / ``load_checkpoint`` write and restore ``<step>/actor`` (``bandpo.checkpoint.run_folders``
holds the step folder around it), ``export_hf`` the run's ``hf/`` folder (``bandpo.checkpoint.hf_export``)
and, with LoRA, its ``hf_adapter/`` (``bandpo.checkpoint.lora_adapter``).

A checkpoint is a directory written by every rank (DeepSpeed shards optimizer state per
rank) into ``<path>.tmp``; rank 0 renames it to ``<path>`` only after all ranks finished
writing and flushing, so a crash mid-save never leaves a half-written ``<path>``. Multi-node
runs need ``path`` on storage all ranks share.

No rank does the slow part alone while the others wait in a collective (whose timeout would
end the run): every rank flushes its own writes to disk, in parallel (``sync_filesystem``
for DeepSpeed's files, whose names are DeepSpeed's business; ``fsync`` for the files it
wrote itself: ``bandpo.checkpoint.atomic``), and the HF export's weight files are written by
all ranks, bucket by bucket in turn; rank 0's own step is the renames.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from bandpo.checkpoint import atomic, safe_load
from bandpo.checkpoint.hf_export import save_hf_folder
from bandpo.checkpoint.lora_adapter import adapter_path, save_adapter_folder, writes
from bandpo.checkpoint.run_folders import CKPT_TAG
from bandpo.errors import UnsafeCheckpoint
from bandpo.lora_weights import base_model, lora_factors


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
            f"checkpoint written since, or start anew with trainer.resume=never"
        )


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


class ActorCheckpoints:
    """Checkpoints and the HF export of one actor rank (see the module docstring).

    Reads the actor's ``engine`` (DeepSpeed), ``rank``, ``world_size``, ``model_path``, ``lora``, ``offloader``,
    its ``offload`` / ``reload``, ``named_weights``, ``_gathered`` and ``_barrier``
    (``bandpo.actor.state_io.ActorStateIO``).
    Every method is collective: all ranks call it.
    """

    def save_checkpoint(self, path: str, client_state: dict | None = None) -> None:
        """Model, optimizer, LR schedule, step counters and RNG states, written atomically to ``path``.

        Every rank flushes its own writes (in parallel); rank 0 only renames (``bandpo.checkpoint.atomic``).
        """
        tmp = atomic.staging_dir(path)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        self._barrier()
        self.engine.save_checkpoint(
            str(tmp), tag=CKPT_TAG, client_state={"bandpo": dict(client_state or {})}, save_latest=False
        )
        save_rng(tmp, self.rank)
        atomic.sync_filesystem(tmp)
        self._barrier()
        if self.rank == 0:
            atomic.publish(tmp, path)
        self._barrier()

    def load_checkpoint(self, path: str) -> dict:
        """Restore what ``save_checkpoint`` wrote; returns its ``client_state``."""
        if not os.path.isdir(os.path.join(path, CKPT_TAG)):
            raise FileNotFoundError(
                f"load_checkpoint: {path!r} is not an actor checkpoint (no {CKPT_TAG}/ inside)"
            )
        offloaded = self.offloader is not None and self.offloader.offloaded
        self.reload()  # DeepSpeed loads into the states where it made them
        try:
            # DeepSpeed's torch.load calls pass weights_only=False: overridden, its own classes allowed
            with safe_load.weights_only_loads(os.path.join(path, CKPT_TAG), safe_load.deepspeed_globals()):
                load_path, client = self.engine.load_checkpoint(
                    path, tag=CKPT_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
                )
        except UnsafeCheckpoint:
            raise
        except Exception as e:  # DeepSpeed's own errors do not say which file is damaged
            raise_naming_unreadable_file(os.path.join(path, CKPT_TAG), e)
            raise
        if offloaded:  # the weights stay for the sync that follows a resume
            self.offload()
        if load_path is None:
            raise FileNotFoundError(f"load_checkpoint: DeepSpeed found no checkpoint in {path!r}")
        load_rng(path, self.rank)
        return dict((client or {}).get("bandpo", {}))

    def export_hf(self, path: str) -> None:
        """Write the run's final Hugging Face export (``bandpo.checkpoint.lora_adapter``).

        ``path``: a HF folder (config, safetensors weights, tokenizer) loadable by transformers and vLLM,
        in the training dtype, with a LoRA run's adapters merged into the base model's weights; the
        ranks write their share of the weight files and fsync them. With LoRA, ``actor.lora.export``
        chooses that merged model, the adapter in PEFT's format at ``<path>_adapter`` (written by rank
        0: under ZeRO-2 every rank holds the whole adapter, under ZeRO-3 all ranks gather it first), or both; a previous export of the
        kind not chosen is removed, so no older model lies beside this one. Each folder appears
        atomically.
        """
        lora = getattr(self, "lora", None)
        merged, adapter = writes(lora.export) if lora is not None else (True, False)
        if merged:
            tmp = atomic.staging_dir(path)
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
            self._barrier()
            written = save_hf_folder(
                base_model(self.engine.module),
                self.named_weights(),
                tmp,
                self.model_path,
                self.rank,
                self.world_size,
            )
            atomic.fsync_files(written)
            self._barrier()
        if merged and self.rank == 0:
            atomic.publish(tmp, path)
        if adapter:  # under ZeRO-3 every rank takes part in the factors' gather; rank 0 writes
            with self._gathered(lora_factors(self.engine.module)):
                if self.rank == 0:
                    tmp_adapter = atomic.staging_dir(adapter_path(path))
                    shutil.rmtree(tmp_adapter, ignore_errors=True)
                    os.makedirs(tmp_adapter)
                    written = save_adapter_folder(self.engine.module, tmp_adapter, self.model_path)
            if self.rank == 0:
                atomic.fsync_files(written)
                atomic.publish(tmp_adapter, adapter_path(path))
        if self.rank == 0:
            if not merged:  # a previous export's merged model
                shutil.rmtree(path, ignore_errors=True)
            if lora is not None and not adapter:
                shutil.rmtree(adapter_path(path), ignore_errors=True)
        self._barrier()
