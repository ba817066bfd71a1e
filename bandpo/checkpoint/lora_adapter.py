"""A LoRA run's adapter on disk in PEFT's own format, and an adapter folder merged back into a plain HF model.

``actor.lora.export`` (``EXPORTS``) says what the run's final export writes (``ActorCheckpoints.export_hf``):

  - ``merged``: ``<output_dir>/hf/``, the full model of the base architecture with every adapter merged
    into its weight (``W + s * B @ A``), loadable by transformers and vLLM like any model;
  - ``adapter``: ``<output_dir>/hf_adapter/`` (``adapter_path``), what
    ``peft.PeftModel.from_pretrained(base, folder)`` loads: ``adapter_config.json`` (r, lora_alpha,
    lora_dropout, target_modules, ``base_model_name_or_path`` = the run's ``model.path``) and
    ``adapter_model.safetensors`` under PEFT's key names (``save_adapter_folder``);
  - ``both`` (the default): the two folders.

The adapter is written by rank 0 in the training dtype (under ZeRO-2 every rank holds all of it; under
ZeRO-3 every rank takes part in the gather of its partitioned factors first).

The eval (``bandpo.eval.targets``) evaluates an adapter folder by merging it into its base model first
(``merge_adapter_folder``: PEFT's ``merge_and_unload`` in float32), written atomically as an HF folder.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

EXPORTS = ("adapter", "merged", "both")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MERGE_RECORD = "bandpo_merge.json"  # in a merged folder: the adapter and base it was merged from


def check_export(value) -> None:
    """``actor.lora.export`` is one of ``EXPORTS``."""
    if value not in EXPORTS:
        raise ValueError(f"actor.lora.export must be one of {list(EXPORTS)}, got {value!r}")


def writes(export: str) -> tuple[bool, bool]:
    """(merged, adapter): which of the two folders the export ``export`` writes."""
    check_export(export)
    return export in ("merged", "both"), export in ("adapter", "both")


def adapter_path(hf_path: str | os.PathLike) -> Path:
    """Where the adapter goes beside the merged export ``hf_path``: ``<output_dir>/hf`` -> ``<output_dir>/hf_adapter``."""
    hf_path = Path(hf_path)
    return hf_path.with_name(hf_path.name + "_adapter")


def is_adapter_folder(path: str | os.PathLike) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def save_adapter_folder(model, out: str | os.PathLike, base: str) -> list[Path]:
    """Write the adapter of the PEFT model ``model`` into the existing folder ``out`` in PEFT's format,
    its config naming ``base`` as the base model; returns the files written (not yet flushed).

    The state dict is PEFT's own (``get_peft_model_state_dict``: the adapter name dropped from the keys,
    ``base_model.model.<module>.lora_A.weight``); embeddings are never saved (no embedding takes an
    adapter: ``bandpo.actor.lora.apply_lora``), which also keeps PEFT from asking the Hub about ``base``.
    """
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    from bandpo.lora_weights import ADAPTER

    out = Path(out)
    state = get_peft_model_state_dict(model, adapter_name=ADAPTER, save_embedding_layers=False)
    weights = out / ADAPTER_WEIGHTS
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(weights), metadata={"format": "pt"})
    config = copy.deepcopy(model.peft_config[ADAPTER])
    config.base_model_name_or_path = base
    config.inference_mode = True  # as PEFT saves it: loaded for inference unless is_trainable=True
    config.save_pretrained(str(out))
    return [weights, out / ADAPTER_CONFIG]


def adapter_base(adapter_dir: str | os.PathLike, override: str | None) -> str:
    """The base model of ``adapter_dir``: ``override`` (the eval's ``base_model=``), else its config's
    ``base_model_name_or_path``. A local path that does not exist is an ``EvalUsageError`` naming it."""
    from bandpo.errors import EvalUsageError

    file = Path(adapter_dir) / ADAPTER_CONFIG
    if override:
        base, where = override, "base_model="
    else:
        try:
            base = json.loads(file.read_text()).get("base_model_name_or_path")
        except (OSError, ValueError) as e:
            raise EvalUsageError(f"{file} is unreadable ({e})") from None
        where = f"base_model_name_or_path of {file}"
        if not base:
            raise EvalUsageError(f"{file} names no base model; give base_model=PATH_OR_HUB_ID")
    local = base.startswith(("/", ".", "~")) or base.count("/") != 1
    if local and not Path(base).expanduser().is_dir():
        raise EvalUsageError(
            f"base model {base} ({where}) does not exist; give base_model=PATH_OR_HUB_ID when it has moved"
        )
    return str(Path(base).expanduser()) if local else base


def merge_adapter_folder(adapter_dir: str | os.PathLike, base: str, out: str | os.PathLike) -> Path:
    """``adapter_dir`` loaded onto ``base`` and merged (PEFT's ``merge_and_unload``), written as the HF
    folder ``out`` (config, safetensors, the base's tokenizer) atomically; returns ``out``.

    The merge runs in float32 (``W + (B @ A) * s``, rounded once), then the weights are cast to the base
    config's dtype when that is float16/bfloat16 (as ``bandpo.checkpoint.hf_export.consolidate``), so a
    float32 run's adapter gives the bits of its merged export. ``out`` records the adapter file and base
    it was merged from (``MERGE_RECORD``), so a cache is reused only for the same pair
    (``merged_is_current``). A base the adapter does not fit is an ``EvalUsageError`` naming both.
    """
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from bandpo.checkpoint.hf_export import _target_dtype
    from bandpo.errors import EvalUsageError
    from bandpo.hub import hub_error, keyed

    adapter_dir, out = Path(adapter_dir), Path(out)
    try:
        config = AutoConfig.from_pretrained(base)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise keyed(
            hub_error(f"base model {base} of the adapter {adapter_dir}", e),
            "base_model (default: base_model_name_or_path of adapter_config.json)",
            "base_model=<local folder>",
        ) from e
    try:
        merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    except (RuntimeError, ValueError, KeyError) as e:  # shapes or module names of another model
        raise EvalUsageError(
            f"the adapter {adapter_dir} does not fit the base model {base} ({str(e).splitlines()[0]}); "
            "give base_model= the model it was trained on"
        ) from e
    merged.to(_target_dtype(config, "auto"))
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        merged.save_pretrained(str(tmp), safe_serialization=True)
        AutoTokenizer.from_pretrained(base).save_pretrained(str(tmp))
        (tmp / MERGE_RECORD).write_text(json.dumps(_merge_key(adapter_dir, base), indent=2) + "\n")
        shutil.rmtree(out, ignore_errors=True)  # a cache of another base or an older adapter
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def merged_is_current(merged_dir: str | os.PathLike, adapter_dir: str | os.PathLike, base: str) -> bool:
    """Whether ``merged_dir`` holds ``merge_adapter_folder``'s output for this adapter file and base."""
    record = Path(merged_dir) / MERGE_RECORD
    if not record.is_file() or not (Path(merged_dir) / "config.json").is_file():
        return False
    try:
        return json.loads(record.read_text()) == _merge_key(Path(adapter_dir), base)
    except ValueError:
        return False


def _merge_key(adapter_dir: Path, base: str) -> dict:
    """The base and the adapter's weight file (size, mtime): a re-exported adapter is a new file."""
    files = [adapter_dir / ADAPTER_WEIGHTS, adapter_dir / "adapter_model.bin", adapter_dir / ADAPTER_CONFIG]
    weights = next(f for f in files if f.is_file()).stat()
    return {"base": base, "adapter_bytes": weights.st_size, "adapter_mtime_ns": weights.st_mtime_ns}
