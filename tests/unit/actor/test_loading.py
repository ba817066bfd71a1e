"""The actor's model loading (one process, no DeepSpeed): exactly ``from_pretrained``'s weights
and buffers, tensor by tensor from the safetensors files; clear errors for a broken folder.
The partitioned (ZeRO-3) and two-rank paths: tests/integration/actor/test_loading.py.

Exact equality throughout: loading copies (and at most casts) the stored values, the same
cast ``from_pretrained`` applies, so there is no rounding to allow for.
"""

from __future__ import annotations

import pytest
import torch

from bandpo.actor.loading import load_model, model_config, weight_files
from tests.helpers.models import tiny_qwen2


def reference(path: str, dtype: torch.dtype):
    """What the actor loaded before: the whole model through ``from_pretrained``."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, config=model_config(path), dtype=dtype)


def assert_same_model(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    buffers = dict(b.named_buffers())
    for name, buf in a.named_buffers():  # non-persistent ones too (rotary frequencies)
        assert torch.equal(buf, buffers[name]), name
    assert a.training == b.training and a.config._attn_implementation == b.config._attn_implementation
    assert a.generation_config.to_dict() == b.generation_config.to_dict()


def save_qwen2(path, *, tied: bool, dtype=torch.float32, shard: str | None = None) -> str:
    model = tiny_qwen2(
        vocab_size=300,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        attention_dropout=0.1,
    ).to(dtype)
    model.save_pretrained(str(path), safe_serialization=True, **({"max_shard_size": shard} if shard else {}))
    return str(path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_model_equals_from_pretrained(tiny_model_dir, dtype):
    model = load_model(tiny_model_dir, dtype)
    assert_same_model(model, reference(tiny_model_dir, dtype))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as the checkpoint says


@pytest.mark.parametrize(
    "tied,file_dtype,shard", [(False, torch.float32, "40KB"), (True, torch.bfloat16, None)]
)
def test_load_model_untied_sharded_and_cast(tmp_path, tied, file_dtype, shard):
    path = save_qwen2(tmp_path, tied=tied, dtype=file_dtype, shard=shard)
    if shard:
        assert len(weight_files(path)) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    model = load_model(path, torch.float32)
    assert model.config.attention_dropout == 0.0 and model.config.use_cache is False
    assert_same_model(model, reference(path, torch.float32))
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_broken_weight_folders_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_qwen2(tmp_path / "m", tied=False)
    file = tmp_path / "m" / "model.safetensors"
    state = load_file(str(file))
    state["model.norm.weight"] = torch.ones(3)
    save_file(state, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.safetensors: model.norm.weight has shape \(3,\)"):
        load_model(path, torch.float32)
    del state["model.norm.weight"], state["lm_head.weight"]
    save_file(state, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no tensor for 2 parameters .*lm_head.weight, model.norm.weight"):
        load_model(path, torch.float32)
    file.unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors weights"):
        load_model(path, torch.float32)
