"""LoRA on the actor without DeepSpeed: config keys, PEFT names -> base names, the merged weights a sync
sends against PEFT's own merge_and_unload, and the reference policy (adapters off) against the base model."""

from __future__ import annotations

import pytest
import torch

from bandpo.actor.lora import LoraSettings, apply_lora, merged_by_peft, reference_mode, sync_entries
from bandpo.config import compose
from bandpo.errors import ConfigError
from bandpo.lora_weights import base_model, base_name, merge_state_dict, merged_weight
from tests.helpers.models import tiny_qwen2

pytest.importorskip("peft")


def _tiny_qwen2(tied: bool = True, dtype=torch.float32):
    return tiny_qwen2(intermediate_size=48, tie_word_embeddings=tied, use_cache=False).to(dtype).eval()


def _lora_model(settings: LoraSettings, **kw):
    """A wrapped tiny model whose B factors are random (PEFT starts them at zero: a merge would be a no-op)."""
    base = _tiny_qwen2(**kw)
    model = apply_lora(base, settings)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.1)
    return model


# ---------------------------------------------------------------- config
@pytest.mark.parametrize(
    "override,key",
    [
        ("actor.lora.rank=-1", "actor.lora.rank"),
        ("actor.lora.rank=1.5", "actor.lora.rank"),
        ("actor.lora.alpha=0", "actor.lora.alpha"),
        ("actor.lora.dropout=1.0", "actor.lora.dropout"),
        ("actor.lora.dropout=-0.1", "actor.lora.dropout"),
        ("actor.lora.target_modules=[]", "actor.lora.target_modules"),
        ("actor.lora.export=peft", "actor.lora.export"),
    ],
)
def test_config_refuses_bad_lora_values_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        compose(["model=tiny", "actor.lora.rank=8", override])


def test_config_takes_lora_with_zero3_and_refuses_dropout_with_reused_old_logprobs_naming_both_keys():
    for stage in (2, 3):  # the frozen base whole on every rank (ZeRO-2) or partitioned (ZeRO-3)
        assert (
            compose(["model=tiny", "actor.lora.rank=8", f"actor.zero_stage={stage}"]).actor.zero_stage
            == stage
        )
    with pytest.raises(ConfigError, match=r"actor\.lora\.dropout.*actor\.reuse_old_logprobs"):
        compose(["model=tiny", "actor.lora.rank=8", "actor.lora.dropout=0.05"])
    cfg = compose(
        ["model=tiny", "actor.lora.rank=8", "actor.lora.dropout=0.05", "actor.reuse_old_logprobs=false"]
    )
    assert cfg.actor.lora.rank == 8
    assert compose(["model=tiny"]).actor.lora.rank == 0  # off by default


def test_settings_from_a_config_block():
    assert LoraSettings.of(None) is None and LoraSettings.of({"rank": 0}) is None
    s = LoraSettings.of({"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj"]})
    assert s.target_modules == ("q_proj",) and s.scaling == 2.0 and s.export == "both"
    assert LoraSettings.of(compose(["model=tiny", "actor.lora.rank=4"]).actor.lora).export == "both"


# ---------------------------------------------------------------- names
def test_base_name_strips_the_wrapper_and_base_layer_and_skips_the_factors():
    assert (
        base_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")
        == "model.layers.0.self_attn.q_proj.weight"
    )
    assert base_name("base_model.model.model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert (
        base_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias")
        == "model.layers.0.self_attn.q_proj.bias"
    )
    assert base_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    assert base_name("base_model.model.model.layers.0.mlp.up_proj.lora_B.default.weight") is None


@pytest.mark.parametrize("tied", [True, False])
def test_sync_names_shapes_and_order_are_the_base_models(tied):
    plain = _tiny_qwen2(tied=tied)
    expected = [(n, tuple(p.shape)) for n, p in plain.named_parameters()]
    model = _lora_model(LoraSettings(rank=4), tied=tied)
    assert [(e.name, tuple(e.param.shape)) for e in sync_entries(model)] == expected
    targets = {e.name for e in sync_entries(model) if e.lora_a is not None}
    assert len(targets) == 2 * 7  # 2 layers x (q, k, v, o, gate, up, down)
    assert [(e.name, e.lora_a) for e in sync_entries(plain)] == [(n, None) for n, _ in expected]


# ---------------------------------------------------------------- merged weights
def test_merged_sync_tensors_equal_peft_merge_and_unload_exactly_in_fp32():
    model = _lora_model(LoraSettings(rank=4, alpha=12.0, target_modules=("q_proj", "v_proj", "down_proj")))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fast = {e.name: e.value() for e in sync_entries(model)}
    slow = merged_by_peft(model)
    assert fast.keys() == slow.keys()
    for name in slow:  # same operations in the same order as PEFT's merge: bit for bit
        assert torch.equal(fast[name], slow[name]), name
    moved = [n for n in slow if "q_proj" in n or "v_proj" in n or "down_proj" in n]
    assert moved and all(
        not torch.equal(fast[n], before[f"base_model.model.{n[: -len('weight')]}base_layer.weight"])
        for n in moved
        if n.endswith("weight")
    )
    for n, p in model.named_parameters():  # the training weights are not written by the merge
        assert torch.equal(p, before[n]), n


def test_merged_weight_in_bf16_within_the_derived_bound_of_peft():
    """bf16, u = eps / 2 its unit roundoff, d = s B A: fast = (W + d)(1 + e1) (one rounding, after an
    fp32 sum whose own error is ~2^-24 relative), PEFT = (W + d(1 + e2))(1 + e3), |e_i| <= u. So
    |fast - PEFT| <= 2u |W + d| + u |d| (1 + u) <= eps (1 + eps) (max(|fast|, |PEFT|) + |d|); the
    |d| term matters where W and d cancel (measured on a trained actor: up to 0.98 of this bound)."""
    model = _lora_model(LoraSettings(rank=8, alpha=16.0), dtype=torch.bfloat16)
    slow = merged_by_peft(model)
    eps = torch.finfo(torch.bfloat16).eps
    for e in sync_entries(model):
        got, ref = e.value(), slow[e.name]
        assert got.dtype == torch.bfloat16
        if e.lora_a is None:
            assert torch.equal(got, ref), e.name
            continue
        d = (e.lora_b.detach().float() @ e.lora_a.detach().float()) * e.scaling
        tol = eps * (1 + eps) * (torch.maximum(got.float().abs(), ref.float().abs()) + d.abs())
        assert bool(((got.float() - ref.float()).abs() <= tol).all()), e.name


def test_merged_weight_is_the_formula():
    g = torch.Generator().manual_seed(0)
    # out 5, in 3, r 2
    w, a, b = (torch.randn(s, generator=g, dtype=torch.float64) for s in [(5, 3), (2, 3), (5, 2)])
    got = merged_weight(w.float(), a.float(), b.float(), 0.5).double()
    torch.testing.assert_close(got, w + 0.5 * b @ a, atol=1e-6, rtol=0)


# ---------------------------------------------------------------- reference policy
def test_adapters_off_is_the_base_model_exactly():
    plain = _tiny_qwen2()
    model = _lora_model(LoraSettings(rank=4))
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base_logits = plain(input_ids=ids).logits
        with reference_mode(model):
            off = model(input_ids=ids).logits
        on = model(input_ids=ids).logits
        with reference_mode(model, active=False):
            still_on = model(input_ids=ids).logits
    assert torch.equal(off, base_logits)
    assert not torch.allclose(on, base_logits) and torch.equal(still_on, on)
    assert base_model(model).config is model.config and base_model(plain) is plain


def test_only_the_factors_train():
    model = _lora_model(LoraSettings(rank=4))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)


def test_merge_state_dict_equals_peft_merge_and_unload():
    """What the eval's consolidation does with a LoRA checkpoint's state dict (PEFT names, factors)."""
    model = _lora_model(LoraSettings(rank=4, alpha=12.0))
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    merged, slow = merge_state_dict(state, 12.0 / 4), merged_by_peft(model)
    assert merged.keys() == slow.keys()
    assert all(torch.equal(merged[n], slow[n]) for n in slow)
    broken = {n: t for n, t in state.items() if "layers.1.mlp.up_proj.lora_B" not in n}
    with pytest.raises(ValueError, match="layers.1.mlp.up_proj"):
        merge_state_dict(broken, 3.0)


def test_eval_reads_the_runs_lora_settings_and_refuses_adapters_without_them(tmp_path):
    from bandpo.checkpoint.hf_export import _merge_lora
    from bandpo.errors import EvalUsageError
    from bandpo.eval.targets import run_lora

    assert run_lora(None) is None and run_lora(tmp_path) is None
    (tmp_path / "config.yaml").write_text("actor:\n  lora:\n    rank: 0\n    alpha: 16.0\n")
    assert run_lora(tmp_path) is None
    (tmp_path / "config.yaml").write_text("actor:\n  lora:\n    rank: 4\n    alpha: 12.0\n")
    assert run_lora(tmp_path) == (4, 12.0)
    state = {n: p.detach() for n, p in _lora_model(LoraSettings(rank=4, alpha=12.0)).named_parameters()}
    with pytest.raises(EvalUsageError, match="holds LoRA adapters"):
        _merge_lora(state, None, tmp_path)
    with pytest.raises(EvalUsageError, match=r"rank \[4\].*actor\.lora\.rank=8"):
        _merge_lora(state, (8, 12.0), tmp_path)
    assert "model.layers.0.self_attn.q_proj.weight" in _merge_lora(state, (4, 12.0), tmp_path)


@pytest.mark.parametrize(
    "targets,match",
    [
        (("no_such_proj",), "no_such_proj"),
        (("embed_tokens",), "Embedding"),
        (("q_proj", "lm_head"), "output embedding"),
    ],
)
def test_targets_that_cannot_work_are_refused_naming_the_key(targets, match):
    with pytest.raises(ValueError, match=rf"actor\.lora\.target_modules.*{match}"):
        apply_lora(_tiny_qwen2(tied=False), LoraSettings(rank=4, target_modules=targets))
