"""Pinned host memory of the offload (``bandpo.distributed.host_memory``): torch's pinned allocator rounds
every block up to a power of two, so Qwen2.5-3B's 6.2 GB bf16 flat buffer under ZeRO-2 pins 8 GiB.
Hand-computed from the shipped qwen2.5-3b sizes (configs/model/qwen2.5-3b.yaml)."""

from __future__ import annotations

import pytest

from bandpo.distributed.footprint import ModelShape
from bandpo.distributed.host_memory import parameter_sizes, pinned_block, pinned_terms

GIB, MIB = 1 << 30, 1 << 20
QWEN3B = ModelShape(
    num_params=3_085_938_688,
    hidden_size=2048,
    intermediate_size=11008,
    num_layers=36,
    num_heads=16,
    num_kv_heads=2,
    vocab_size=151936,
)
P = QWEN3B.num_params


@pytest.mark.parametrize(
    "nbytes, pinned",
    [
        (0, 0),
        (1, 1),
        (4096, 4096),
        (4097, 8192),
        (2 * P, 8 * GIB),
        (8 * GIB, 8 * GIB),
        (8 * GIB + 1, 16 * GIB),
    ],
)
def test_a_pinned_block_is_the_next_power_of_two(nbytes, pinned):
    assert pinned_block(nbytes) == pinned


def test_qwen3b_parameters_are_tied_and_count_all_but_the_biases():
    sizes = parameter_sizes(QWEN3B)
    # a layer: q, o 2048^2; k, v 256 x 2048; gate, up, down 11008 x 2048; two norms; embedding; final norm
    assert len(sizes) == 36 * 9 + 2
    assert P - sum(sizes) == 36 * (2048 + 2 * 256)  # the q, k, v biases, left out; no lm_head (tied)


def test_zero2_pins_the_flat_buffer_at_8_gib():
    # ZeRO-2, 8 ranks, bf16, no reference model: partition ceil(P / 8) = 385,742,336 fp32 values
    part = 385_742_336
    assert pinned_terms(QWEN3B, 8, 2, 2, P, lora=False, ref=False) == [
        ("lp_params", 2 * P, 8 * GIB),  # 6,171,877,376 bytes
        ("hp_params", 4 * part, 2 * GIB),  # 1,542,969,344
        ("adam", 8 * part, 4 * GIB),
    ]
    # 10.06 GiB of tensors pin 14 GiB a rank: 1.39x; 112 GiB on a node of 8 where the tensors are 80.5
    assert (2 * P + 12 * part) / GIB == pytest.approx(10.0591, abs=1e-4)


def test_the_reference_model_pins_each_tensor_rounded():
    (ref,) = [t for t in pinned_terms(QWEN3B, 8, 2, 2, P, lora=False, ref=True) if t[0] == "ref"]
    # a layer: q, o 8 MiB; k, v 1 MiB; gate, up, down 45,088,768 B -> 64 MiB each; norms 4 KiB each;
    # the embedding 622,329,856 B -> 1 GiB; the final norm 4 KiB
    layer = 2 * 8 * MIB + 2 * MIB + 3 * 64 * MIB + 2 * 4096
    assert ref == ("ref", 2 * (P - 36 * 2560), 36 * layer + GIB + 4096)
    assert ref[2] == 9_001_275_392


def test_zero3_pins_the_partitions_and_the_gradient():
    part = 385_742_336  # one sub-group: under DeepSpeed's 1e9 elements
    assert pinned_terms(QWEN3B, 8, 3, 2, P, lora=False, ref=False) == [
        ("hp_params", 4 * part, 2 * GIB),
        ("adam", 8 * part, 4 * GIB),
        ("lp_grads", 4 * part, 2 * GIB),
    ]
    # one rank alone: 3,085,938,688 values in 4 sub-groups of 771,484,672 (3.09 GB fp32 -> 4 GiB each)
    hp = pinned_terms(QWEN3B, 1, 3, 2, P, lora=False, ref=False)[0]
    assert hp == ("hp_params", 4 * P, 4 * 4 * GIB)


def test_the_plan_command_reports_the_rounded_figure():
    from bandpo.config import compose
    from bandpo.distributed.memory import memory_estimate, memory_table
    from bandpo.distributed.plan import ClusterShape, make_plan

    cfg = compose(["model=qwen2.5-3b", "algorithm.kl_coef=0"])
    plan = make_plan(cfg, ClusterShape(1, 8), "cuda")
    est = memory_estimate(cfg, plan, 139.8)
    assert est.host["rank_pinned_gib"] == 14.0 and est.host["node_pinned_gib"] == 112.0
    assert est.host["node_gib"] == pytest.approx(8 * 10.0591, abs=1e-3)
    assert est.as_json()["host_pinned_per_node"] == 112.0
    assert (
        "pinned host memory while vLLM generates: 14.0 GiB a rank (lp_params 8.0  hp_params 2.0  adam 4.0), "
        "112.0 GiB on a node of 8 ranks; the tensors are 80.5 GiB" in memory_table(est, plan)
    )
