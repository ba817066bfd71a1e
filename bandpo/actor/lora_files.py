"""The actor's LoRA adapter as a PEFT-format folder: what ``rollout.lora_sync=adapter`` sends the engines.

The folder holds ``adapter_model.safetensors`` (each target's factors under PEFT's saved names,
``base_model.model.<module>.lora_A.weight`` [rank, in] and ``.lora_B.weight`` [out, rank], the
adapter name dropped) and ``adapter_config.json`` (rank, alpha, the target modules). PEFT's
``PeftModel.from_pretrained`` and vLLM's LoRA loader both read it. Only the factors go out: the
base weights never change while LoRA trains, so the engines keep the ones they started with.

Under ZeRO-2 every rank holds the whole adapter (its parameters are replicated), so rank 0 alone
writes it. Files are written in place: the engine reads them only inside the sync's load.
"""

from __future__ import annotations

import json
import os

import torch

from bandpo.actor.lora import ADAPTER, PEFT_PREFIX, LoraSettings

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def adapter_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s adapter factors (a PEFT model or a DeepSpeed engine around one) under PEFT's saved
    names, as contiguous CPU copies, in ``named_modules`` order."""
    from peft.tuners.lora import LoraLayer

    inner = getattr(module, "module", module)
    out = {}
    for name, mod in inner.named_modules():
        if isinstance(mod, LoraLayer) and ADAPTER in mod.lora_A:
            for factor, table in (("lora_A", mod.lora_A), ("lora_B", mod.lora_B)):
                out[f"{name}.{factor}.weight"] = table[ADAPTER].weight.detach().to("cpu").contiguous()
    if not out:
        raise ValueError("adapter_tensors: the model carries no LoRA adapter (actor.lora.rank is 0)")
    return out


def adapter_config(settings: LoraSettings, base_model_path: str) -> dict:
    """The ``adapter_config.json`` of ``settings``' adapter on ``base_model_path`` (a plain LoRA:
    no bias, no DoRA, no rsLoRA, the scale alpha / rank)."""
    return {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base_model_path,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": sorted(settings.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def write_adapter(folder: str, module: torch.nn.Module, settings: LoraSettings, base_model_path: str) -> int:
    """Write ``module``'s adapter into ``folder`` (created if missing; the two files replaced);
    returns the bytes of the weights file (what a sync moves, the small config aside)."""
    from safetensors.torch import save_file

    tensors = adapter_tensors(module)
    if not all(n.startswith(PEFT_PREFIX) for n in tensors):
        raise ValueError(
            f"write_adapter: adapter names must start with {PEFT_PREFIX!r}: {next(iter(tensors))}"
        )
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, WEIGHTS_FILE))
    with open(os.path.join(folder, CONFIG_FILE), "w") as f:
        json.dump(adapter_config(settings, base_model_path), f, indent=1)
    return os.path.getsize(os.path.join(folder, WEIGHTS_FILE))


def adapter_bytes(
    settings: LoraSettings, shapes: dict[str, tuple[int, int]], layers: int, bytes_per: int
) -> int:
    """Bytes of one adapter: per layer, ``rank * (in + out)`` values for each target of ``shapes``
    ({module name: (out, in)}), times ``layers`` and the dtype's ``bytes_per``."""
    per_layer = sum(
        settings.rank * (o + i) for name, (o, i) in shapes.items() if name in settings.target_modules
    )
    return per_layer * layers * bytes_per


def read_adapter_files(folder: str) -> dict[str, bytes]:
    """The folder's two files as bytes (another node's copy is written from them: ``write_adapter_files``)."""
    out = {}
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = f.read()
    return out


def write_adapter_files(folder: str, files: dict[str, bytes]) -> int:
    """Write ``read_adapter_files``' result into ``folder``; returns the bytes written."""
    os.makedirs(folder, exist_ok=True)
    for name, data in files.items():
        if name not in (WEIGHTS_FILE, CONFIG_FILE):
            raise ValueError(f"write_adapter_files: unexpected file {name!r}")
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    return sum(len(d) for d in files.values())
