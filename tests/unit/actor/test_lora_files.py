"""The adapter folder of ``rollout.lora_sync=adapter`` (``bandpo.actor.lora_files``): PEFT's own saved
names and values, PEFT loads it back into the actor's model, the bytes one sync moves."""

from __future__ import annotations

import json

import pytest
import torch

from bandpo.actor.lora import LoraSettings, apply_lora
from bandpo.actor.lora_files import adapter_bytes, write_adapter
from bandpo.checkpoint.lora_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from bandpo.shm.adapter_dirs import read_adapter_files, write_adapter_files

pytest.importorskip("peft")

SETTINGS = LoraSettings(rank=4, alpha=8.0)


def _trained(model_dir: str):
    """The tiny model wrapped by PEFT, its B factors random (a trained adapter's stand-in: B = 0 would
    make the adapter the identity and the round trip prove nothing)."""
    from transformers import AutoModelForCausalLM

    model = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), SETTINGS).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def test_written_weights_are_peft_saved_state(tiny_model_dir, tmp_path):
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    model = _trained(tiny_model_dir)
    write_adapter(str(tmp_path), model, tiny_model_dir)
    ours, peft = load_file(str(tmp_path / ADAPTER_WEIGHTS)), get_peft_model_state_dict(model)
    assert sorted(ours) == sorted(peft) and len(ours) == 2 * 7 * 2  # A and B of 7 targets x 2 layers
    assert all(torch.equal(ours[n], peft[n]) for n in peft)


def test_written_folder_loads_in_peft_with_the_actors_logits(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = _trained(tiny_model_dir)
    folder = tmp_path / "adapter"
    nbytes = write_adapter(str(folder), model, tiny_model_dir)
    assert nbytes == (folder / ADAPTER_WEIGHTS).stat().st_size
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(folder)).eval()
    ids = torch.randint(3, 400, (2, 12), generator=torch.Generator().manual_seed(1))  # [B, T]
    with torch.no_grad():
        want, got = model(input_ids=ids).logits, loaded(input_ids=ids).logits  # [B, T, V]
        with loaded.disable_adapter():
            plain = loaded(input_ids=ids).logits
    # The same factors through the same PEFT layers in the same order: the same fp32 arithmetic.
    assert torch.equal(got, want)
    assert float((plain - want).abs().max()) > 1e-3  # the adapter is in the loaded model

    # Another node's copy: the same bytes in another folder.
    files = read_adapter_files(str(folder))
    assert write_adapter_files(str(tmp_path / "copy"), files) == sum(len(b) for b in files.values())
    assert read_adapter_files(str(tmp_path / "copy")) == files
    with pytest.raises(ValueError, match="unexpected file"):
        write_adapter_files(str(tmp_path / "copy"), {"model.safetensors": b""})


def test_write_adapter_refuses_a_model_without_adapter(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="no LoRA adapter"):
        write_adapter(str(tmp_path), AutoModelForCausalLM.from_pretrained(tiny_model_dir), tiny_model_dir)


# (out, in) of each target; layers; bytes per value.
SMOLLM2_135M = ({"q_proj": (576, 576), "k_proj": (192, 576), "v_proj": (192, 576), "o_proj": (576, 576),
                 "gate_proj": (1536, 576), "up_proj": (1536, 576), "down_proj": (576, 1536)}, 30)  # fmt: skip
QWEN25_7B = ({"q_proj": (3584, 3584), "k_proj": (512, 3584), "v_proj": (512, 3584), "o_proj": (3584, 3584),
              "gate_proj": (18944, 3584), "up_proj": (18944, 3584), "down_proj": (3584, 18944)}, 28)  # fmt: skip


def test_adapter_bytes_of_the_documented_models():
    """docs/gpu.md's numbers. SmolLM2-135M, rank 64, fp32: per layer 64 x (1152 + 768 + 768 + 1152 + 2112
    x 3) = 651,264 values, x 30 layers x 4 B = 78,151,680 B (~78 MB) vs 538 MB of fp32 weights.
    Qwen2.5-7B, rank 64, bf16: 64 x (7168 + 4096 + 4096 + 7168 + 22528 x 3) = 5,767,168 values per
    layer, x 28 x 2 B = 322,961,408 B (~323 MB) vs 15.2 GB of bf16 weights."""
    rank64 = LoraSettings(rank=64, alpha=128.0)
    assert adapter_bytes(rank64, *SMOLLM2_135M, 4) == 78_151_680
    assert adapter_bytes(rank64, *QWEN25_7B, 2) == 322_961_408
    attention_only = LoraSettings(rank=64, target_modules=("q_proj", "v_proj"))
    assert adapter_bytes(attention_only, *QWEN25_7B, 2) == 64 * (7168 + 4096) * 28 * 2
