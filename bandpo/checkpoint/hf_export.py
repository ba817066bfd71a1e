"""Hugging Face folders from the actor's weights: the live export at the end of a run (``save_hf_folder``,
every rank writing its share: ``bandpo.checkpoint.actor_state.ActorCheckpoints.export_hf``) and the
consolidation of a training checkpoint's ZeRO shards for evaluation (``consolidate``: ``bandpo.eval.targets``).

Both write config, safetensors weights and the tokenizer, loadable by transformers and vLLM; a LoRA run's
adapters are merged into the base model's weights (``bandpo.lora_weights``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from bandpo.checkpoint.run_folders import ACTOR_DIR, CKPT_TAG
from bandpo.errors import EvalUsageError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


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


def consolidate(
    step_dir: Path, model_source: str, out: Path, dtype: str = "auto", lora: tuple[int, float] | None = None
) -> Path:
    """Write ``step_dir``'s weights as a HF folder ``out`` (config + safetensors + tokenizer), atomically.

    DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` merges the ZeRO-2/3 shards of every
    rank into full fp32 tensors; ``dtype`` "auto" keeps them in the base model's config dtype
    when that is a float16/bfloat16 model (as the trainer's ``hf/`` export does on GPU), else fp32.
    A checkpoint of a LoRA run (adapters beside the frozen base weights) is merged into the base
    model (``bandpo.lora_weights.merge_state_dict``) with ``lora`` = (rank, alpha) of its run config.
    """
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from bandpo.checkpoint import safe_load
    from bandpo.hub import hub_error, keyed

    try:  # the run's base model: its config (and below its tokenizer), from a folder, the Hub or its cache
        config = AutoConfig.from_pretrained(model_source)
    except (OSError, ValueError) as e:
        raise keyed(
            hub_error(f"base model {model_source}", e),
            "base_model (default: model.path of the run's config.yaml)",
            "base_model=<local folder>",
        ) from e
    # zero_to_fp32's torch.load calls pass weights_only=False: overridden, DeepSpeed's own classes allowed
    with safe_load.weights_only_loads(step_dir / ACTOR_DIR / CKPT_TAG, safe_load.deepspeed_globals()):
        state = get_fp32_state_dict_from_zero_checkpoint(str(step_dir / ACTOR_DIR), tag=CKPT_TAG)
    if any(".lora_" in k for k in state):
        state = _merge_lora(state, lora, step_dir)
    target = _target_dtype(config, dtype)  # merged in fp32 first, cast once
    state = {k: v.to(target) for k, v in state.items()}
    with torch.device("meta"):  # only the class, config and tied-weight names matter for save_pretrained
        model = AutoModelForCausalLM.from_config(config)
    expected = {n for n, _ in model.named_parameters()}  # tied weights (lm_head) once, as export_hf writes
    known = expected | set(model.state_dict())  # DeepSpeed also restores tied aliases ("shared_params")
    if not expected <= set(state) <= known:
        missing, extra = sorted(expected - set(state))[:5], sorted(set(state) - known)[:5]
        raise EvalUsageError(
            f"{step_dir}: checkpoint weights do not match {model_source} (missing {missing}, "
            f"unexpected {extra}); give base_model= the model the run trained"
        )
    state = {k: v for k, v in state.items() if k in expected}
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(str(tmp), state_dict=state, safe_serialization=True)
        AutoTokenizer.from_pretrained(model_source).save_pretrained(str(tmp))
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _merge_lora(state: dict, lora: tuple[int, float] | None, step_dir: Path) -> dict:
    from bandpo.lora_weights import merge_state_dict

    if lora is None or lora[0] <= 0:
        raise EvalUsageError(
            f"{step_dir} holds LoRA adapters but no actor.lora.rank > 0 / actor.lora.alpha was "
            "found in its run's config.yaml to merge them with; evaluate the run's hf/ export"
        )
    rank, alpha = lora
    ranks = {tuple(v.shape)[0] for k, v in state.items() if ".lora_A." in k}
    if ranks != {rank}:
        raise EvalUsageError(
            f"{step_dir}: adapters of rank {sorted(ranks)}, but actor.lora.rank={rank} in the run config"
        )
    return merge_state_dict(state, alpha / rank)


def _target_dtype(hf_config, dtype: str):
    import torch

    if dtype != "auto":
        return getattr(torch, dtype)
    cfg_dtype = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    if isinstance(cfg_dtype, str):
        cfg_dtype = getattr(torch, cfg_dtype, None)
    return cfg_dtype if cfg_dtype in (torch.float16, torch.bfloat16) else torch.float32
