"""What ``checkpoint=X`` of the eval command names, and which HF folder evaluates each (a training
checkpoint consolidated into one first: ``bandpo.checkpoint.hf_export.consolidate``).

``X`` may be:
  - a Hugging Face model folder (or a folder holding ``hf/`` / ``huggingface/``) or a hub id;
  - a training checkpoint ``runs/<name>/checkpoints/step_N`` (``step_12`` and ``step_000012`` alike),
    ZeRO-2 or ZeRO-3 with any number of ranks: its weights are consolidated with DeepSpeed's own
    ``zero_to_fp32`` utilities, config and tokenizer come from the run's model (``model.path`` in
    ``runs/<name>/config.yaml``, or ``base_model=``);
  - a LoRA adapter folder in PEFT's format (``adapter_config.json``: a LoRA run's ``hf_adapter/``, or a
    folder holding one and no ``hf/``): merged into its base model (``base_model_name_or_path`` of its
    config, or ``base_model=`` when the base has moved) with PEFT's ``merge_and_unload``
    (``bandpo.checkpoint.lora_adapter.merge_adapter_folder``);
  - a run folder ``runs/<name>``: its latest checkpoint, or ``step=N``, or every kept one (``steps=all``).

The consolidated folder is cached as ``step_N/hf`` (removed with the checkpoint when it is
pruned), a merged adapter as ``<adapter>/merged`` (rebuilt when the adapter file or the base
changes, replaced with the adapter folder when it is exported again), or, with ``cache=temp``, in a
temporary folder removed after the evaluation.
User mistakes raise ``EvalUsageError`` (the CLI prints its one line and exits 2).
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bandpo.checkpoint.hf_export import consolidate
from bandpo.checkpoint.lora_adapter import (
    adapter_base,
    is_adapter_folder,
    merge_adapter_folder,
    merged_is_current,
)
from bandpo.checkpoint.run_folders import ACTOR_DIR, CKPT_TAG, STEP_RE, CheckpointManager
from bandpo.errors import EvalUsageError

HF_NAMES = ("", "hf", "huggingface")
ADAPTER_NAMES = ("", "hf_adapter")  # a LoRA run's adapter export (bandpo.checkpoint.lora_adapter)
MERGED_CACHE = "merged"  # an adapter folder's merged model, cached inside it
CACHE_CHOICES = ("beside", "temp")


@dataclass
class Target:
    """One model to evaluate: a HF folder/hub id now, or a training checkpoint to consolidate first."""

    label: str  # what the user named (shown in outputs)
    hf_path: str | None = None  # ready-made HF folder or hub id
    step_dir: Path | None = None  # a training checkpoint folder (consolidated on demand)
    adapter_dir: Path | None = None  # a PEFT LoRA adapter folder (merged into its base on demand)
    step: int | None = None
    run_dir: Path | None = None


def find_hf_folder(path: Path) -> Path | None:
    """``path`` itself, ``path/hf`` or ``path/huggingface`` when it holds ``config.json``."""
    for name in HF_NAMES:
        candidate = path / name if name else path
        if (candidate / "config.json").is_file():
            return candidate
    return None


def find_adapter_folder(path: Path) -> Path | None:
    """``path`` itself or ``path/hf_adapter`` when it holds ``adapter_config.json`` (PEFT's adapter folder)."""
    for name in ADAPTER_NAMES:
        candidate = path / name if name else path
        if is_adapter_folder(candidate):
            return candidate
    return None


def is_step_dir(path: Path) -> bool:
    return (path / ACTOR_DIR / CKPT_TAG).is_dir()


def is_run_dir(path: Path) -> bool:
    return (path / "checkpoints").is_dir()


def kept_steps(run_dir: Path) -> list[Path]:
    """Complete checkpoint folders of a run, oldest first."""
    return CheckpointManager(run_dir / "checkpoints")._steps()


def step_number(step_dir: Path) -> int:
    return int(step_dir.name.split("_")[1])


def resolve_targets(checkpoint: str, step: int | None = None, steps: object = None) -> list[Target]:
    """The models ``checkpoint`` (+ ``step=`` / ``steps=``) names, in step order; checks paths only, loads nothing."""
    path = Path(checkpoint)
    if not path.exists():
        m = re.fullmatch(r"step_(\d+)", path.name)
        if m and path.parent.is_dir():  # step_12 typed for step_000012
            padded = path.parent / f"step_{int(m.group(1)):06d}"
            if padded.exists():
                path = padded
        if not path.exists():
            if _looks_like_hub_id(checkpoint) and step is None and steps is None:
                return [Target(label=checkpoint, hf_path=checkpoint)]
            hint = ""
            if m and path.parent.is_dir():
                hint = f"; kept steps there: {_step_list(path.parent.parent) or 'none'}"
            raise EvalUsageError(
                f"checkpoint not found: {checkpoint} (give a HF model folder, hub id owner/name, "
                f"run folder runs/<name> or runs/<name>/checkpoints/step_N{hint})"
            )
    if step is not None or steps is not None:
        if not is_run_dir(path):
            raise EvalUsageError(f"step=/steps= need a run folder (one holding checkpoints/), got {path}")
    if is_run_dir(path):
        return _run_targets(path, step, steps)
    if is_step_dir(path):
        run_dir = path.parent.parent if path.parent.name == "checkpoints" else None
        return [Target(label=str(path), step_dir=path, step=_maybe_step(path), run_dir=run_dir)]
    if is_adapter_folder(path):  # before config.json: an adapter folder may hold the base's config too
        return [Target(label=checkpoint, adapter_dir=path)]
    hf = find_hf_folder(path)
    if hf is not None:
        return [Target(label=checkpoint, hf_path=str(hf))]
    adapter = find_adapter_folder(path)
    if adapter is not None:
        return [Target(label=checkpoint, adapter_dir=adapter)]
    raise EvalUsageError(
        f"{path} holds neither Hugging Face weights (config.json in it, hf/ or huggingface/) nor a LoRA adapter "
        f"(adapter_config.json in it or hf_adapter/) nor a training checkpoint ({ACTOR_DIR}/{CKPT_TAG}/) "
        "nor a run (checkpoints/)"
    )


def run_model_path(run_dir: Path | None, base_model: str | None) -> str:
    """Where a run's config and tokenizer come from: ``base_model`` or ``model.path`` of ``run_dir/config.yaml``."""
    if base_model:
        return base_model
    file = run_dir / "config.yaml" if run_dir else None
    if file is None or not file.is_file():
        raise EvalUsageError(
            f"no run config ({file or 'checkpoint is not inside runs/<name>/checkpoints'}) "
            f"to take the model's config and tokenizer from; give base_model=PATH_OR_HUB_ID"
        )
    from omegaconf import OmegaConf

    try:
        path = OmegaConf.select(OmegaConf.load(file), "model.path", throw_on_resolution_failure=True)
    except Exception as e:
        raise EvalUsageError(
            f"{file}: cannot read model.path ({e}); give base_model=PATH_OR_HUB_ID"
        ) from None
    if not path:
        raise EvalUsageError(f"{file} has no model.path; give base_model=PATH_OR_HUB_ID")
    return str(path)


def run_lora(run_dir: Path | None) -> tuple[int, float] | None:
    """(actor.lora.rank, actor.lora.alpha) of ``run_dir/config.yaml``; None without one or with LoRA off."""
    file = run_dir / "config.yaml" if run_dir else None
    if file is None or not file.is_file():
        return None
    from omegaconf import OmegaConf

    block = OmegaConf.select(OmegaConf.load(file), "actor.lora")
    if block is None or not block.get("rank"):
        return None
    return int(block.rank), float(block.alpha)


def materialize(target: Target, *, base_model: str | None, cache: str, temp_root: Path | None) -> str:
    """The HF folder (or hub id) of ``target``, consolidating (and caching) a training checkpoint or merging
    (and caching) an adapter folder into its base first."""
    if target.hf_path is not None:
        return target.hf_path
    if target.adapter_dir is not None:
        return _merged_adapter(target.adapter_dir, base_model, cache, temp_root)
    assert target.step_dir is not None
    cached = target.step_dir / "hf"
    if (cached / "config.json").is_file():
        return str(cached)
    source = run_model_path(target.run_dir, base_model)
    if cache == "temp":
        root = temp_root or Path(tempfile.mkdtemp(prefix="bandpo-eval-"))
        out = root / target.step_dir.name
    else:
        out = cached
    return str(consolidate(target.step_dir, source, out, lora=run_lora(target.run_dir)))


def _merged_adapter(adapter_dir: Path, base_model: str | None, cache: str, temp_root: Path | None) -> str:
    base = adapter_base(adapter_dir, base_model)
    if cache == "temp":
        root = temp_root or Path(tempfile.mkdtemp(prefix="bandpo-eval-"))
        return str(merge_adapter_folder(adapter_dir, base, root / f"{adapter_dir.name}-merged"))
    cached = adapter_dir / MERGED_CACHE
    if merged_is_current(cached, adapter_dir, base):
        return str(cached)
    return str(merge_adapter_folder(adapter_dir, base, cached))


def _run_targets(run_dir: Path, step: int | None, steps: object) -> list[Target]:
    kept = kept_steps(run_dir)
    if not kept:
        raise EvalUsageError(f"run {run_dir} has no complete checkpoint in {run_dir / 'checkpoints'}")
    if steps is not None:
        if steps == "all":
            chosen = kept
        elif isinstance(steps, (list, tuple)) and all(isinstance(s, int) for s in steps):
            by_step = {step_number(p): p for p in kept}
            unknown = [s for s in steps if s not in by_step]
            if unknown:
                raise EvalUsageError(
                    f"steps={list(steps)}: no checkpoint for {unknown}; kept steps: {_step_list(run_dir)}"
                )
            chosen = [by_step[s] for s in sorted(set(steps))]
        else:
            raise EvalUsageError(f"steps={steps!r}: expected 'all' or a list of steps, e.g. steps=[4,8]")
    elif step is not None:
        chosen = [p for p in kept if step_number(p) == step]
        if not chosen:
            raise EvalUsageError(
                f"step={step}: no checkpoint in {run_dir}; kept steps: {_step_list(run_dir)}"
            )
    else:
        try:
            chosen = [CheckpointManager(run_dir / "checkpoints").latest() or kept[-1]]
        except RuntimeError as e:  # a stale `latest` pointer: name it and the steps that can be chosen
            raise EvalUsageError(f"{e}; or pick one with step=N (kept: {_step_list(run_dir)})") from None
    return [
        Target(label=f"{run_dir}@step{step_number(p)}", step_dir=p, step=step_number(p), run_dir=run_dir)
        for p in chosen
    ]


def _step_list(run_dir: Path) -> str:
    return ", ".join(str(step_number(p)) for p in kept_steps(run_dir)) if run_dir.is_dir() else ""


def _maybe_step(path: Path) -> int | None:
    return step_number(path) if STEP_RE.match(path.name) else None


def _looks_like_hub_id(s: str) -> bool:
    return s.count("/") == 1 and not s.startswith((".", "/", "~")) and not s.startswith("runs/")


ENGINE_DTYPES = ("float32", "bfloat16", "float16")


def model_dtype(model_path: str) -> str:
    """The dtype the config of ``model_path`` (a folder or a hub id) names: what the eval engine loads the
    model in unless ``eval.engine.dtype`` is given.

    Passed explicitly because vLLM's own ``auto`` loads a float32 checkpoint in bf16 (its rule for
    fp32 models): not the numerics the checkpoint was trained in, and on a CPU without native bf16
    two orders of magnitude slower. A config naming no dtype, or another one, is an error naming ``eval.engine.dtype``.
    """
    import torch
    from transformers import AutoConfig

    from bandpo.errors import InputError
    from bandpo.hub import hub_error, keyed

    try:
        config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError) as e:
        raise keyed(hub_error(f"model {model_path}", e), "checkpoint", "checkpoint=<local folder>") from e
    dtype = getattr(config, "dtype", None)
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, (torch.dtype, str)) else None
    if name not in ENGINE_DTYPES:
        raise InputError(
            f"eval.engine.dtype: the config of {model_path} names {'no dtype' if name is None else name}; "
            "give the engine's with eval.engine.dtype=float32 (or bfloat16)"
        )
    return name
