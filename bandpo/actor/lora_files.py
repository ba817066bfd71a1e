"""The actor's LoRA adapter as a PEFT-format folder: what ``rollout.lora_sync=adapter`` sends the engines.

The folder is the one the run's export writes (``bandpo.checkpoint.lora_adapter.save_adapter_folder``,
PEFT's own state dict and config): ``adapter_model.safetensors`` (each target's factors,
``base_model.model.<module>.lora_A.weight`` [rank, in] and ``.lora_B.weight`` [out, rank]) and
``adapter_config.json``. PEFT's ``PeftModel.from_pretrained`` and vLLM's LoRA loader both read it. Only the factors go out: the
base weights never change while LoRA trains, so the engines keep the ones they started with.

Rank 0 writes it: under ZeRO-2 every rank holds the whole adapter (its parameters are replicated);
under ZeRO-3 the factors are partitioned, and every rank takes part in their gather first
(``ActorStateIO.publish_adapter``), so the file is the same. Files are written in place: the engine
reads them only inside the sync's load.
"""

from __future__ import annotations

import os

import torch

from bandpo.actor.lora import LoraSettings
from bandpo.checkpoint.lora_adapter import ADAPTER_WEIGHTS, save_adapter_folder
from bandpo.lora_weights import is_lora, lora_factors

# Bounds on what the two files add to the factors' values: safetensors' JSON header per tensor (its
# name, ~80 characters here, dtype, shape and offsets: under 300 bytes) and adapter_config.json (~1 KB).
HEADER_BYTES_PER_TENSOR = 512
CONFIG_BYTES = 8192


def adapter_file_bytes(module: torch.nn.Module) -> int:
    """An upper bound on the bytes ``write_adapter`` writes for ``module``: its factors' values (whole:
    under ZeRO-3 inside their gather) plus ``HEADER_BYTES_PER_TENSOR`` each and ``CONFIG_BYTES``."""
    factors = lora_factors(getattr(module, "module", module))
    return sum(p.numel() * p.element_size() + HEADER_BYTES_PER_TENSOR for p in factors) + CONFIG_BYTES


def write_adapter(folder: str, module: torch.nn.Module, base_model_path: str) -> int:
    """Write ``module``'s adapter (a PEFT model, or a DeepSpeed engine around one) into ``folder``
    (created if missing; the two files replaced) once its file system has room for them
    (``bandpo.shm.adapter_dirs.check_adapter_space``); returns the bytes of the weights file (what a
    sync moves, the small config aside). Under ZeRO-3 the factors must be gathered around the call."""
    from bandpo.shm.adapter_dirs import check_adapter_space

    inner = getattr(module, "module", module)
    if not is_lora(inner):
        raise ValueError("write_adapter: the model carries no LoRA adapter (actor.lora.rank is 0)")
    check_adapter_space(folder, adapter_file_bytes(inner))
    os.makedirs(folder, exist_ok=True)
    save_adapter_folder(inner, folder, base_model_path)
    return os.path.getsize(os.path.join(folder, ADAPTER_WEIGHTS))


def adapter_bytes(
    settings: LoraSettings, shapes: dict[str, tuple[int, int]], layers: int, bytes_per: int
) -> int:
    """Bytes of one adapter: per layer, ``rank * (in + out)`` values for each target of ``shapes``
    ({module name: (out, in)}), times ``layers`` and the dtype's ``bytes_per``."""
    per_layer = sum(
        settings.rank * (o + i) for name, (o, i) in shapes.items() if name in settings.target_modules
    )
    return per_layer * layers * bytes_per
