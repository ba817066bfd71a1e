"""The plan's memory with LoRA on the actor (bandpo.distributed.memory, footprint.adapter_params).

The adapter's parameter count is checked against the trainable parameters PEFT gives a tiny Qwen2
and Llama built on the fly (integers: exact). The footprint's terms are pinned to hand-computed
bytes: exact float64 arithmetic on integers below 2**53 divided by 2**30, so the tolerance is a
relative 1e-12 (rounding of the divisions and sums only).
"""

import json

import pytest

from bandpo.config import compose
from bandpo.distributed.__main__ import main as plan_main
from bandpo.distributed.footprint import ModelShape, adapter_params
from bandpo.distributed.memory import CUDA_CONTEXT_GIB, VLLM_ASLEEP_GIB, memory_errors
from bandpo.errors import ConfigError
from bandpo.train import main as train_main
from tests.helpers.memory import SMALL, estimate

GIB = 2**30
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Grouped-query attention (4 heads, 2 KV heads: k/v out 2 x 16 = 32 of H 64) so k/v differ from q.
H, I, HEADS, KV, LAYERS, RANK = 64, 96, 4, 2, 3, 4


def _peft_trainable(kind: str, targets: list[str]) -> int:
    """The slow, obvious reference: PEFT's own count of the wrapped model's trainable parameters,
    checked against the parameters that require a gradient."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }[kind]
    torch.manual_seed(0)
    model = model_cls(
        config_cls(
            vocab_size=50,
            hidden_size=H,
            intermediate_size=I,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=KV,
        )
    )
    wrapped = get_peft_model(model, LoraConfig(r=RANK, target_modules=targets, bias="none"))
    n = wrapped.num_parameters(only_trainable=True)
    assert n == sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    return n


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize(
    "targets", [ALL, ["q_proj", "v_proj"], ["down_proj", "k_proj", "up_proj"], ["o_proj", "o_proj"]]
)
def test_adapter_params_equal_peft_trainable_parameters(kind, targets):
    shape = ModelShape(
        num_params=0,
        hidden_size=H,
        intermediate_size=I,
        num_layers=LAYERS,
        num_heads=HEADS,
        num_kv_heads=KV,
        vocab_size=50,
    )
    assert adapter_params(shape, RANK, targets) == _peft_trainable(kind, targets)


def test_adapter_params_of_the_shipped_models_by_hand():
    # rank 64, every target, per layer: q and o (H + H), k and v (H + K), gate, up and down (H + I).
    cfg = compose(["model=qwen2.5-7b"]).model  # H 3584, I 18944, K = 4 x 128 = 512, 28 layers
    shape = ModelShape(**{k: int(getattr(cfg, k)) for k in ModelShape.__dataclass_fields__})
    assert adapter_params(shape, 64, ALL) == 64 * 28 * (2 * 7168 + 2 * 4096 + 3 * 22528) == 161_480_704
    cfg = compose(["model=llama3-8b"]).model  # H 4096, I 14336, K = 8 x 128 = 1024, 32 layers
    shape = ModelShape(**{k: int(getattr(cfg, k)) for k in ModelShape.__dataclass_fields__})
    assert adapter_params(shape, 64, ALL) == 64 * 32 * (2 * 8192 + 2 * 5120 + 3 * 18432) == 167_772_160


# ZeRO-2 over W = 2 ranks, P = 2**30, H = 1024, I = 2816, 8 heads, 2 KV heads (K = 256), L = 4,
# V = 32768, 8192 packed tokens, chunk 256, checkpointing; kl_coef > 0, yet no reference model.
SMALL_LORA = [o for o in SMALL if not o.startswith("algorithm.kl_coef=")] + [
    "algorithm.kl_coef=0.001",
    "actor.lora.rank=8",
]


def test_small_lora_footprint_by_hand():
    est = estimate(SMALL_LORA, 16.0)
    P, W, H, I, n, L, V, T, C = 2**30, 2, 1024, 2816, 8, 4, 32768, 8192, 256
    # per layer: q, o 1024 + 1024; k, v 1024 + 256; gate, up 1024 + 2816; down 2816 + 1024
    A = 8 * L * (2 * 2048 + 2 * 1280 + 3 * 3840)
    assert A == 581_632 and est.lora == {
        "rank": 8,
        "target_modules": ALL,
        "adapter_params": A,
        "base_params": P,
    }
    # LoRA's activations: full fine-tuning's recomputed layer (test_memory.packed_bf16_activations,
    # 26 H + 8 I + 4 n + 8) less the frozen norms' normalised inputs (2 x 2 H) plus the seven
    # adapters' x A^T (7 x 2 x rank); the checkpointed inputs and the head as in full fine-tuning
    per_token = 2 * H * L + (22 * H + 8 * I + 4 * n + 8 + 7 * 2 * 8) + (8 * H + 16)
    want = {
        "weights": 2 * P,  # frozen base, bf16, whole on each rank under ZeRO-2
        "adapter": 2 * A,  # the factors in bf16, whole too
        "master": 4 * A / W,
        "optimizer": 8 * A / W,
        "grads": 4 * A / W,
        "bucket": 2 * 5e8,
        "head": 12 * C * V,  # the lm_head is frozen: no [V, H] weight gradient
        "activations": T * per_token,
        "optimizer_step": 4 * A / W,
    }
    assert set(est.parts) == set(want) | {"actor_peak", "actor_residue", "vllm_share"}  # no ref_weights
    for key, nbytes in want.items():
        assert est.parts[key] == pytest.approx(nbytes / GIB, rel=1e-12), key
    resident = 2 * P + 2 * A + 16 * A / W + 1e9
    peak = resident + 12 * C * V + T * per_token  # the head and activations outgrow the step's 4 A / W
    assert est.parts["actor_peak"] == pytest.approx(peak / GIB, rel=1e-12)  # 3.64 GiB
    assert est.train == pytest.approx(peak / GIB + VLLM_ASLEEP_GIB + 2 * CUDA_CONTEXT_GIB, rel=1e-12)
    # Offload on (colocated default): the base and the adapter leave with the weights; the bucket stays.
    assert est.rollout == pytest.approx(1e9 / GIB + 0.5 * 16 + 2 * CUDA_CONTEXT_GIB, rel=1e-12)
    assert est.phase("startup") == pytest.approx(
        resident / GIB + VLLM_ASLEEP_GIB + 2 * CUDA_CONTEXT_GIB, rel=1e-12
    )


def test_small_lora_zero3_footprint_by_hand():
    """ZeRO-3 partitions the frozen base and the factors over the W = 2 ranks, as full fine-tuning's weights."""
    est = estimate(SMALL_LORA + ["actor.zero_stage=3"], 16.0)
    P, W, H, I, n, L, V, T, C = 2**30, 2, 1024, 2816, 8, 4, 32768, 8192, 256
    A = 581_632  # as above
    per_token = 2 * H * L + (22 * H + 8 * I + 4 * n + 8 + 7 * 2 * 8) + (8 * H + 16)  # as above
    want = {
        "weights": 2 * P / W,  # the frozen base, bf16, partitioned: 1 GiB a rank
        "adapter": 2 * A / W,
        "master": 4 * A / W,
        "optimizer": 8 * A / W,
        "grads": 4 * A / W,
        "bucket": 2 * 5e8,
        "live_params": 2 * (V * H + 5e7),  # the gathered [V, H] lm_head and the prefetch bucket
        "head": 12 * C * V,
        "activations": T * per_token,
        "optimizer_step": 4 * A / W,  # below the 1e9-element sub-group
    }
    assert set(est.parts) == set(want) | {"actor_peak", "actor_residue", "vllm_share"}
    for key, nbytes in want.items():
        assert est.parts[key] == pytest.approx(nbytes / GIB, rel=1e-12), key
    resident = P + A + 8 * A + 1e9  # 1.94 GiB
    peak = resident + 2 * (V * H + 5e7) + 12 * C * V + T * per_token
    assert est.parts["actor_peak"] == pytest.approx(peak / GIB, rel=1e-12)  # 2.69 GiB
    assert est.train == pytest.approx(peak / GIB + VLLM_ASLEEP_GIB + 2 * CUDA_CONTEXT_GIB, rel=1e-12)
    # Offload on: ZeRO-3 keeps every bf16 partition, the base's and the adapter's (1 GiB + 1.1 MiB).
    assert est.parts["actor_residue"] == pytest.approx((P + A) / GIB, rel=1e-12)
    assert est.rollout == pytest.approx((P + A) / GIB + 0.5 * 16 + 2 * CUDA_CONTEXT_GIB, rel=1e-12)


def test_lora_that_does_not_fit_names_the_remedies_that_shard_its_base():
    # 5.5 GiB: startup and rollout 2.94 + 2.75 (vLLM's half) + 1.2, train 3.64 + 1.0 + 1.2 (GiB)
    est = estimate(SMALL_LORA + ["actor.offload_during_rollout=false"], 5.5)
    startup, rollout, train = memory_errors(est)
    for e in (startup, train):  # ZeRO-3 shards the frozen base; under ZeRO-2 more ranks do not
        assert "actor.zero_stage=3" in e and "actor.num_workers" not in e
    assert "startup phase" in startup and "rollout.gpu_memory_utilization" in startup
    assert "train phase" in train and "actor.max_tokens_per_micro_batch" in train
    # Under ZeRO-3 more ranks shard the base too. 4.5 GiB: train 2.69 + 1.0 + 1.2 does not fit; startup
    # 1.94 + 1.0 + 1.2 and rollout (offload on) 1.0 + 2.25 + 1.2 do
    (train,) = memory_errors(estimate(SMALL_LORA + ["actor.zero_stage=3"], 4.5))
    assert "train phase needs 4.9 GiB" in train and "actor.num_workers" in train


def test_unknown_target_is_an_error_naming_the_key(capsys):
    shape = ModelShape(1, H, I, LAYERS, HEADS, KV, 50)
    with pytest.raises(ConfigError, match=r"actor\.lora\.target_modules.*'qkv_proj'"):
        adapter_params(shape, RANK, ["q_proj", "qkv_proj"])
    bad = "actor.lora.target_modules=[q_proj,qkv_proj]"
    assert plan_main(["--nodes", "1", "--gpus-per-node", "2", *SMALL_LORA, bad]) == 2
    assert "config error: actor.lora.target_modules has ['qkv_proj']" in capsys.readouterr().err
    dry = ["trainer.dry_run=true", "trainer.nnodes=1", "trainer.gpus_per_node=2"]
    assert train_main([*SMALL_LORA, bad, *dry]) == 2
    assert "actor.lora.target_modules has ['qkv_proj']" in capsys.readouterr().err


def test_command_shows_the_adapter_and_the_lora_terms(capsys):
    args = ["--nodes", "1", "--gpus-per-node", "8", "model=qwen2.5-7b", "actor.zero_stage=2"]
    args += ["actor.lora.rank=64", "--gpu-gib", "80"]
    assert plan_main(["--json", *args]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lora"] == {
        "rank": 64,
        "target_modules": ALL,
        "adapter_params": 161_480_704,
        "base_params": 7_615_616_512,
    }
    assert out["memory"]["adapter"] == pytest.approx(2 * 161_480_704 / GIB, rel=1e-12)
    assert "ref_weights" not in out["memory"] and "live_params" not in out["memory"]
    assert plan_main(args) == 0
    text = capsys.readouterr().out
    assert "adapter 0.3" in text and "LoRA rank 64 on q_proj, k_proj" in text
    assert "161,480,704 adapter parameters train (2.12% of the base's 7,615,616,512" in text
    assert "frozen in weights, whole on every rank" in text
    assert plan_main([*args, "actor.zero_stage=3"]) == 0
    assert "frozen in weights, partitioned over the ranks" in capsys.readouterr().out
