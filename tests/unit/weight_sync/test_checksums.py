"""The sync verification's checksum and comparison (``bandpo.weight_sync.checksums``) on hand-made weights.

The checksum is an integer sum, so every expected value below is exact (bit patterns written out
by hand) and every comparison is equality: no tolerance.
"""

from __future__ import annotations

import pytest
import torch

from bandpo.weight_sync.checksums import (
    EngineEntry,
    WeightSyncMismatch,
    actor_checksums,
    checksum,
    compare,
    entries_of,
    module_entries,
    requested_dtypes,
)


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(8, 4, generator=g),
        "layer.up.weight": torch.randn(6, 4, generator=g),
        "norm.weight": torch.ones(4),
    }


def _check(sent: dict[str, torch.Tensor], reports: list[list[list[EngineEntry]]]) -> int:
    return compare(actor_checksums(sent.items(), requested_dtypes(reports)), reports)


def test_checksum_is_the_exact_sum_of_the_bit_patterns():
    # bf16: 1.0 = 0x3F80 = 16256, -2.0 = 0xC000 = -16384 as int16; -0.0 counts as +0.0 (0).
    assert checksum(torch.tensor([1.0, -2.0, 0.0, -0.0], dtype=torch.bfloat16)) == 16256 - 16384
    # fp32: 1.0 = 0x3F800000 = 1065353216, -2.0 = 0xC0000000 = -1073741824.
    assert checksum(torch.tensor([1.0, -2.0, -0.0])) == 1065353216 - 1073741824
    # One ulp more on one element adds exactly 1.
    x = torch.tensor([0.5, 3.0])
    assert checksum(torch.tensor([0.5, torch.nextafter(x[1], torch.tensor(9.0))])) == checksum(x) + 1
    # Additive: a concatenation's checksum is the parts' sum (what lets fused and sharded tensors be cut).
    w = _weights()["layer.up.weight"]
    assert checksum(w) == checksum(w[:2]) + checksum(w[2:5]) + checksum(w[5:])


def test_a_faithful_engine_passes_and_a_one_element_corruption_is_named():
    sent = _weights()
    good = [[entries_of(sent.items())], [entries_of(sent.items())]]  # two engines, one worker each
    assert _check(sent, good) == 6

    bad = {k: v.clone() for k, v in sent.items()}
    bad["layer.up.weight"][3, 1] = torch.nextafter(bad["layer.up.weight"][3, 1], torch.tensor(9.0))  # one ulp
    reports = [[entries_of(sent.items())], [entries_of(bad.items())]]
    with pytest.raises(
        WeightSyncMismatch, match=r"engine 1 tensor layer\.up\.weight, TP rank 0 differs"
    ) as e:
        _check(sent, reports)
    assert "\n" not in str(e.value)


def test_missing_and_unexpected_tensors_are_errors():
    sent = _weights()
    partial = {k: v for k, v in sent.items() if k != "norm.weight"}
    with pytest.raises(WeightSyncMismatch, match=r"engine 0 holds no tensor for norm\.weight"):
        _check(sent, [[entries_of(partial.items())]])
    extra = {**sent, "rotary.inv_freq": torch.ones(2)}
    with pytest.raises(WeightSyncMismatch, match=r"engine 0 tensor rotary\.inv_freq is not among"):
        _check(sent, [[entries_of(extra.items())]])


def test_the_actor_side_is_cast_to_the_engines_dtype():
    sent = _weights()
    bf16 = {k: v.to(torch.bfloat16) for k, v in sent.items()}  # a bf16 engine fed fp32 weights
    assert _check(sent, [[entries_of(bf16.items())]]) == 3
    # A load that truncated instead of rounding to nearest holds other bf16 values.
    truncated = {
        k: (v.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16) for k, v in sent.items()
    }
    with pytest.raises(WeightSyncMismatch, match=r"embed\.weight.*bfloat16"):
        _check(sent, [[entries_of(truncated.items())]])


def test_tensor_parallel_shards_add_up_and_replicas_are_checked_rank_by_rank():
    w = _weights()
    up, norm, embed = w["layer.up.weight"], w["norm.weight"], w["embed.weight"]

    def entry(name, t, copies=1):
        return EngineEntry(name, name, "float32", t.numel(), checksum(t), copies)

    def ranks(up0, norm1):
        return [
            [entry("embed.weight", embed[:4]), entry("layer.up.weight", up0), entry("norm.weight", norm)],
            [entry("embed.weight", embed[4:]), entry("layer.up.weight", up[3:]), entry("norm.weight", norm1)],
        ]

    assert _check(w, [ranks(up[:3], norm)]) == 6  # sharded rows sum, the replicated norm matches on each rank
    with pytest.raises(WeightSyncMismatch, match=r"layer\.up\.weight, summed over its TP ranks"):
        _check(w, [ranks(up[:3] * 2, norm)])
    with pytest.raises(WeightSyncMismatch, match=r"norm\.weight, TP rank 1 differs"):
        _check(w, [ranks(up[:3], norm * 2)])
    # KV heads replicated over 2 ranks (4 ranks, 2 heads): each half is counted twice.
    k = up[:4]
    shards = [[entry("layer.up.weight", part, copies=2)] for part in (k[:2], k[:2], k[2:], k[2:])]
    assert compare(actor_checksums([("layer.up.weight", k)], {}), [shards]) == 4


class _Linear(torch.nn.Module):
    """A vLLM-style linear after CPU packing: ``weight`` emptied, the values only inside the GEMM."""

    def __init__(self, w: torch.Tensor, sizes: list[int], packed: bool, kv_replicas: int | None = None):
        super().__init__()
        self.output_partition_sizes, self.input_size_per_partition = sizes, w.shape[1]
        if kv_replicas is not None:
            self.num_kv_head_replicas = kv_replicas
        self._hidden = w.clone()
        self.weight = torch.nn.Parameter(torch.empty(0) if packed else w.clone(), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.arange(float(sum(sizes))), requires_grad=False)
        self.quant_method = self

    def apply(self, layer, x, bias=None):
        return x @ self._hidden.T


class _Head(torch.nn.Module):
    """A vocabulary table padded to 8 rows with zeros, and its packed logits-GEMM copy."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.cat([table, torch.zeros(8 - len(table), table.shape[1])]), requires_grad=False
        )
        self.embedding_dim = table.shape[1]
        self.shard_indices = type("Indices", (), {"num_org_elements": len(table)})()
        self.cpu_linear, self.quant_method = True, self

    def apply(self, layer, x, bias=None):
        return x @ self.weight.T


@pytest.mark.parametrize("packed", [False, True])
def test_fused_packed_and_tied_vllm_tensors_map_back_to_checkpoint_names(packed):
    g = torch.Generator().manual_seed(1)
    q, k, v, gate, up = (torch.randn(r, 4, generator=g) for r in (4, 2, 2, 3, 3))
    table = torch.randn(6, 4, generator=g)
    model = torch.nn.Module()
    model.packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    model.embed = _Head(table)
    model.qkv_proj = _Linear(torch.cat([q, k, v]), [4, 2, 2], packed, kv_replicas=1)
    model.gate_up_proj = _Linear(torch.cat([gate, up]), [3, 3], packed)
    sent = {
        "embed.weight": table,
        "q_proj.weight": q,
        "k_proj.weight": k,
        "v_proj.weight": v,
        "q_proj.bias": torch.arange(4.0),
        "k_proj.bias": torch.arange(4.0, 6),
        "v_proj.bias": torch.arange(6.0, 8),
        "gate_proj.weight": gate,
        "up_proj.weight": up,
        "gate_proj.bias": torch.arange(3.0),
        "up_proj.bias": torch.arange(3.0, 6),
    }
    entries = module_entries(model, head=model.embed)
    assert {e.name for e in entries} == set(sent)
    assert [e.label for e in entries if e.name == "embed.weight"] == [
        "embed.weight",
        "lm_head GEMM copy (tied to embed.weight)",
    ]
    assert _check(sent, [[entries]]) == len(sent) + 1

    model.gate_up_proj._hidden[4, 0] += 1.0  # a row of up_proj, the second part of the fused tensor
    if not packed:
        model.gate_up_proj.weight.data[4, 0] += 1.0
    with pytest.raises(
        WeightSyncMismatch, match=r"gate_up_proj\.weight \(checkpoint tensor up_proj\.weight\)"
    ):
        _check(sent, [[module_entries(model, head=model.embed)]])


@pytest.mark.gpu
def test_cuda_checksums_equal_the_cpu_ones():
    """The ipc and nccl engines hold CUDA tensors, and the actor sums its own on its GPU: the integer
    sums and the cast to the engine's dtype must give the CPU's exact numbers there too."""
    sent = {**_weights(), "big.weight": torch.randn(3000, 1000, generator=torch.Generator().manual_seed(2))}
    sent["big.weight"][0, :3] = torch.tensor([0.0, -0.0, 1.0])
    on_gpu = {k: v.cuda() for k, v in sent.items()}
    wanted = {k: ["bfloat16", "float32"] for k in sent}
    assert actor_checksums(on_gpu.items(), wanted) == actor_checksums(sent.items(), wanted)
    bf16 = {k: v.to(torch.bfloat16) for k, v in on_gpu.items()}
    assert _check(sent, [[entries_of(bf16.items())]]) == 4
