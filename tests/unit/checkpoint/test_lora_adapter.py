"""A LoRA adapter in PEFT's format (the export's ``hf_adapter/``) without DeepSpeed: what PEFT loads from it
computes the wrapped model's logits, and the eval's merge of the folder is PEFT's merge_and_unload of the
live model. The same through the DeepSpeed actor's export: tests/integration/actor/test_actor_lora.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bandpo.actor.lora import LoraSettings, apply_lora, merged_by_peft
from bandpo.checkpoint.lora_adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MERGE_RECORD,
    adapter_path,
    save_adapter_folder,
    writes,
)
from bandpo.errors import EvalUsageError
from bandpo.eval.targets import materialize, resolve_targets

pytest.importorskip("peft")

LORA = LoraSettings(rank=4, alpha=12.0, dropout=0.05, target_modules=("q_proj", "v_proj", "down_proj"))


def _trained(base_dir: str):
    """The tiny model wrapped with ``LORA``, its B factors random (PEFT starts them at zero)."""
    from transformers import AutoModelForCausalLM

    model = apply_lora(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), LORA).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _export(model, folder: Path, base: str) -> Path:
    folder.mkdir(parents=True)
    written = save_adapter_folder(model, folder, base)
    assert sorted(p.name for p in written) == sorted([ADAPTER_WEIGHTS, ADAPTER_CONFIG])
    return folder


def test_export_choices_and_layout():
    assert writes("both") == (True, True) and writes("merged") == (True, False)
    assert writes("adapter") == (False, True)
    with pytest.raises(ValueError, match=r"actor\.lora\.export must be one of"):
        writes("peft")
    assert adapter_path("runs/x/hf") == Path("runs/x/hf_adapter")


def test_adapter_folder_loads_in_peft_and_merges_to_peft_merge_and_unload(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = _trained(tiny_model_dir)
    folder = _export(model, tmp_path / "run" / "hf_adapter", tiny_model_dir)
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 12.0, 0.05)
    assert sorted(config["target_modules"]) == sorted(LORA.target_modules)
    assert config["base_model_name_or_path"] == tiny_model_dir and config["peft_type"] == "LORA"
    keys = set(load_file(str(folder / ADAPTER_WEIGHTS)))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert all(
        ".lora_A.weight" in k or ".lora_B.weight" in k for k in keys
    )  # no adapter name, no base weights

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(folder)).eval()
    ids = torch.randint(0, base.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # the same modules, weights and operations in the same order: fp32 gives the same bits
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)

    # The eval resolves the folder (or the run folder holding it) and merges it with PEFT in fp32:
    # W + (B @ A) * s, PEFT's own merge of the same tensors, so the weights are equal bit for bit.
    (target,) = resolve_targets(str(folder))
    assert resolve_targets(str(tmp_path / "run"))[0].adapter_dir == folder
    path = materialize(target, base_model=None, cache="beside", temp_root=None)
    assert path == str(folder / "merged") and (folder / "merged" / MERGE_RECORD).is_file()
    merged = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference = merged_by_peft(model)
    assert {n for n, _ in merged.named_parameters()} == reference.keys()
    assert all(torch.equal(p, reference[n]) for n, p in merged.named_parameters())
    assert (Path(path) / "tokenizer_config.json").is_file()  # the engines read the base's tokenizer from it

    stamp = (Path(path) / "model.safetensors").stat().st_mtime_ns
    assert materialize(target, base_model=None, cache="beside", temp_root=None) == path  # cached
    assert (Path(path) / "model.safetensors").stat().st_mtime_ns == stamp
    temp = materialize(target, base_model=tiny_model_dir, cache="temp", temp_root=tmp_path / "tmp")
    assert Path(temp).parent == tmp_path / "tmp"


def test_adapter_folder_whose_base_is_missing_or_another_model(tiny_model_dir, tmp_path):
    from bandpo.models.tiny import build_tiny_model

    moved = tmp_path / "moved_base"
    folder = _export(_trained(tiny_model_dir), tmp_path / "hf_adapter", str(moved))
    (target,) = resolve_targets(str(folder))
    with pytest.raises(
        EvalUsageError, match=rf"base model {moved} \(base_model_name_or_path of .*base_model="
    ):
        materialize(target, base_model=None, cache="temp", temp_root=tmp_path / "t")
    with pytest.raises(EvalUsageError, match=r"base model /nowhere/model \(base_model=\) does not exist"):
        materialize(target, base_model="/nowhere/model", cache="temp", temp_root=tmp_path / "t")
    # the override when the base has moved: the same weights as from the base named in the config
    ok = materialize(target, base_model=tiny_model_dir, cache="beside", temp_root=None)
    assert ok == str(folder / "merged")
    other = build_tiny_model(tmp_path / "other", intermediate_size=384)
    with pytest.raises(EvalUsageError, match=rf"does not fit the base model {other}"):
        materialize(target, base_model=str(other), cache="beside", temp_root=None)
    assert (folder / "merged" / "config.json").is_file()  # the cache of the right base is left as it was


def test_adapter_export_is_rank0s_and_replaces_a_merged_export_of_before(tiny_model_dir, tmp_path):
    """``actor.lora.export=adapter`` on two ranks of a stand-in actor (a real PEFT model, no DeepSpeed):
    rank 1 writes nothing (it holds the same adapter under ZeRO-2), rank 0 writes and publishes the
    folder, and removes the merged ``hf/`` an earlier export left, so no older model lies beside it."""
    import contextlib
    import dataclasses
    import types

    from bandpo.actor.worker import Actor

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    model = _trained(tiny_model_dir)
    for rank in (1, 0):
        actor = types.SimpleNamespace(
            rank=rank,
            world_size=2,
            model_path=tiny_model_dir,
            lora=dataclasses.replace(LORA, export="adapter"),
            engine=types.SimpleNamespace(module=model),
            _barrier=lambda: None,
            _gathered=lambda params: contextlib.nullcontext(),  # ZeRO-2: every rank holds the factors
        )
        Actor.export_hf(actor, str(hf))
        if rank == 1:
            assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_adapter"]
    assert sorted(p.name for p in (tmp_path / "hf_adapter").iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
