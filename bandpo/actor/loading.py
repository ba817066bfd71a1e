"""Building an actor rank's model without a full copy of it in host memory per rank.

``from_pretrained`` builds the whole model in host memory on every rank. In transformers 5
a tensor whose dtype is the file's stays a private mapping of the file (pages shared by the
node's ranks through the page cache, though every rank's RSS counts all of them); a cast
(a bf16 checkpoint trained in fp32, an fp32 one in bf16) is a whole anonymous copy per rank,
actor and reference model each, and under ZeRO-3 every rank holds the whole model until
``deepspeed.initialize`` partitions it. Here the model is first allocated where it will
live, uninitialised (transformers' ``no_init_weights``), and then every tensor is copied in
from the memory-mapped safetensors files, one at a time:

* ZeRO-3: allocated inside ``deepspeed.zero.Init`` with the engine's own config, so each rank
  only ever holds its partition; a tensor is copied in by rank 0 inside
  ``GatheredParameters(modifier_rank=0)``, which scatters it to the ranks' partitions.
  ``deepspeed.initialize`` then keeps the partitioning (it repartitions only parameters
  not made under ``zero.Init``).
* Otherwise (ZeRO-2 replicates the weights on every rank): allocated straight on the rank's
  device, each rank reading the files through the shared page cache (one copy per node,
  reclaimable) into its device tensors. On CPU, where the device is host memory, a parameter
  of the file's dtype keeps the file's pages (shared by the node's ranks until written, as
  ``from_pretrained``'s are); one of another dtype is a rank's own working copy.

Why not stagger the ranks of a node (each loading whole in turn) instead: it bounds the peak
to one full copy at a time but serialises start-up; streaming needs no copy at all and no
coordination. transformers' own ZeRO-3 path (``HfDeepSpeedConfig``) needs the ``accelerate``
package, which bandpo does not depend on, and reads every shard whole on every rank.

The result equals ``from_pretrained(path, config=model_config(path), dtype=dtype)`` exactly
(tests/integration/actor/test_loading.py); only safetensors checkpoints are read.
"""

from __future__ import annotations

import json
import os
from contextlib import nullcontext
from pathlib import Path

import torch

WEIGHT_PATTERNS = ["*.safetensors", "*.safetensors.index.json"]
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}  # safetensors' dtype names


def model_config(path: str):
    """The HF config with dropout off (the ratio must be exactly 1 before the first step) and no KV cache."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    for key, value in list(vars(config).items()):
        if "dropout" in key and isinstance(value, float):
            setattr(config, key, 0.0)
    config.use_cache = False
    return config


def weight_files(path: str) -> list[Path]:
    """The safetensors files of the model at ``path`` (a folder, or a hub id resolved through the
    Hugging Face cache): those named by its index when it has one, else every ``*.safetensors``."""
    if os.path.isdir(path):
        folder = Path(path)
    else:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(path, allow_patterns=WEIGHT_PATTERNS))
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"model {path}: no *.safetensors weights in {folder} (the actor reads safetensors "
            "only; re-save the model with save_pretrained(..., safe_serialization=True))"
        )
    return files


def load_model(
    path: str, dtype: torch.dtype, device: torch.device | str = "cpu", zero3_config: dict | None = None
):
    """HF causal LM of ``path`` in ``dtype``, in eval mode, on ``device`` or, with ``zero3_config``
    (the DeepSpeed config its engine will get), partitioned over the ranks by ZeRO-3.

    Under ZeRO-3 every rank must call it (each tensor is scattered by a collective).
    """
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.initialization import no_init_weights

    config, files = model_config(path), weight_files(path)
    if zero3_config is not None:
        import deepspeed
        from deepspeed.runtime.zero.partition_parameters import DeepSpeedTensorOverride

        # Tensors made in __init__ go to the rank's device but keep the dtype the model gives them:
        # by default zero.Init turns every float tensor into the training dtype, rotary frequencies
        # included (bf16 inv_freq), which from_pretrained + deepspeed.initialize keep in fp32.
        # Parameters are in ``dtype`` anyway (from_config builds under it).
        place = deepspeed.zero.Init(
            config_dict_or_path=zero3_config, dtype=dtype, tensor_overrides=[DeepSpeedTensorOverride.device]
        )
    else:
        place = torch.device(device)
    with place, no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # no_init_weights skipped init_weights, which ties them
    copy_weights(model, files, zero3=zero3_config is not None)
    try:  # the checkpoint's sampling defaults travel with an HF export, as from_pretrained's do
        model.generation_config = GenerationConfig.from_pretrained(path)
    # none saved: from_config's, derived from the model config (from_pretrained's fallback too)
    except OSError:
        pass
    return model.eval()


def copy_weights(model: torch.nn.Module, files: list[Path], zero3: bool) -> None:
    """Copy every parameter of ``model`` from the safetensors ``files`` (cast to its dtype), one
    tensor at a time. A parameter the files lack, or one of another shape, raises naming it and
    the file; tensors the model has no parameter for are left alone (as ``from_pretrained``
    warns and drops them). Tied parameters are filled once, under their first name."""
    from safetensors import safe_open

    params = dict(model.named_parameters())  # tied weights once, under their first name
    loaded: set[str] = set()
    writer = not zero3 or torch.distributed.get_rank() == 0
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in sorted(set(f.keys()) & params.keys()):  # the same order on every rank
                param = params[name]
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(getattr(param, "ds_shape", param.shape)):
                    raise ValueError(
                        f"{file}: {name} has shape {shape}, the model's parameter "
                        f"{tuple(getattr(param, 'ds_shape', param.shape))}"
                    )
                with _gathered(param, zero3), torch.no_grad():
                    if writer:
                        _fill(param, f, name, share=not zero3)
                loaded.add(name)
    missing = sorted(params.keys() - loaded)
    if missing:
        raise ValueError(
            f"model weights {files[0].parent}: no tensor for {len(missing)} parameters "
            f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''})"
        )


def _fill(param: torch.nn.Parameter, f, name: str, share: bool) -> None:
    """Copy tensor ``name`` of the open safetensors file ``f`` into ``param``. With ``share``, a CPU
    parameter of the file's dtype takes the file's pages themselves instead (a private mapping:
    shared by the node's ranks through the page cache until a write copies a page), as
    ``from_pretrained`` does."""
    if share and param.device.type == "cpu" and f.get_slice(name).get_dtype() == _ST_DTYPES.get(param.dtype):
        param.data = f.get_tensor(name)
    else:
        param.copy_(f.get_tensor(name))


def restore_fp32_masters(model: torch.nn.Module, files: list[Path], zero3: bool) -> int:
    """Set the ZeRO optimizer's fp32 master copy of every trainable parameter from the checkpoint's own
    float32 tensors; returns how many were set.

    Why: in bf16 the module is built in bf16 and ``deepspeed.initialize`` makes its fp32 masters from that
    bf16 copy, so a float32 checkpoint (the tiny and SmolLM2 builds, an fp32 HF export) would start
    training from its weights rounded to 8 mantissa bits (relative error up to 2^-9), a perturbation the
    fp32 run does not have and that every later update carries. The bf16 module copy stays as it is: it
    is the rounding of these same values. Tensors stored in bf16 or fp16 (most hub releases) have no
    lost bits and are skipped. Call after ``deepspeed.initialize``, on every rank (each sets its own
    partition); a no-op for parameters outside the optimizer (LoRA's frozen base)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_local_fp32_param
    from safetensors import safe_open

    params = {n: p for n, p in model.named_parameters() if p.requires_grad and p.dtype != torch.float32}
    rank = torch.distributed.get_rank() if zero3 else 0
    done = 0
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in sorted(set(f.keys()) & params.keys()):
                if f.get_slice(name).get_dtype() != "F32":
                    continue
                param, value = params[name], f.get_tensor(name).to(params[name].device)
                if zero3:  # DeepSpeed's full setter reads past the value on a padded last partition
                    part = param.ds_tensor.numel()
                    flat = torch.zeros(part * torch.distributed.get_world_size(), dtype=torch.float32)
                    flat[: value.numel()] = value.flatten()
                    safe_set_local_fp32_param(param, flat[rank * part : (rank + 1) * part].to(value.device))
                else:
                    safe_set_full_fp32_param(param, value)
                done += 1
    return done


def _gathered(param: torch.nn.Parameter, zero3: bool):
    """Under ZeRO-3: the full parameter on every rank, rank 0's values scattered back on exit."""
    if not zero3:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([param], modifier_rank=0)
