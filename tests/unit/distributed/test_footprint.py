"""The per-layer activation formula (bandpo.distributed.footprint) against the tensors a real
tiny Qwen2 and Llama decoder layer saves for backward (saved-tensor hooks, random weights, CPU).

Saved tensors are counted once per storage (views and tensors saved twice share one) and
exclude the layer's parameters and the rotary cos/sin (built once per forward, shared by all
layers). Both sides are integer byte counts, so the comparison is exact.
"""

import contextlib

import pytest
import torch

from bandpo.distributed.footprint import ModelShape, layer_activation_bytes, lora_layer_activation_bytes

H, I, HEADS, KV, T = 256, 704, 4, 2, 64


def _saved_bytes_per_token(
    kind: str,
    dtype: torch.dtype,
    attn: str,
    lora: tuple | None = None,
    adapter_dtype: torch.dtype | None = None,
) -> float:
    """Bytes per token the layer saves; ``lora``: (rank, targets), PEFT's adapters injected, the
    base frozen as the actor's LoRA leaves it (dropout 0), the factors in ``adapter_dtype`` (default
    the layer's ``dtype``)."""
    from transformers import LlamaConfig, Qwen2Config
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    config_cls, layer_cls, rotary_cls = {
        "qwen2": (Qwen2Config, Qwen2DecoderLayer, Qwen2RotaryEmbedding),
        "llama": (LlamaConfig, LlamaDecoderLayer, LlamaRotaryEmbedding),
    }[kind]
    cfg = config_cls(
        hidden_size=H,
        intermediate_size=I,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        num_hidden_layers=1,
        vocab_size=100,
    )
    extra = {}
    if attn == "packed":
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        from bandpo.actor import attention

        AttentionInterface.register(attention.NAME, attention._attention)
        AttentionMaskInterface.register(attention.NAME, attention._mask)
        cfg._attn_implementation = attention.NAME
        # two rows of T/2 tokens, one bucket without padding; built once per forward as the actor does
        layout = attention.build_layout(attention.contiguous_rows([T // 2, T // 2]), T)
        extra[attention.LAYOUT_KW] = layout
        shared = [*layout.buckets, layout.source]
    else:
        cfg._attn_implementation = "sdpa"
        shared = []
    torch.manual_seed(0)
    layer = layer_cls(cfg, 0)
    if lora is not None:
        from peft import LoraConfig, inject_adapter_in_model

        config = LoraConfig(r=lora[0], target_modules=list(lora[1]), bias="none")
        layer = inject_adapter_in_model(config, layer)
        for name, p in layer.named_parameters():
            p.requires_grad_("lora_" in name)
    layer = layer.to(dtype).train()
    for name, p in layer.named_parameters():
        if "lora_" in name and adapter_dtype is not None:
            p.data = p.data.to(adapter_dtype)
    x = torch.randn(1, T, H, dtype=dtype, requires_grad=True)
    pos = torch.cat([torch.arange(T // 2), torch.arange(T // 2)])[None]
    cos, sin = rotary_cls(cfg)(x, pos)
    skip = {t.untyped_storage().data_ptr() for t in [*layer.parameters(), cos, sin, *shared]}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch_linear(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin), **extra)
    return sum(seen.values()) / T


@contextlib.contextmanager
def torch_linear():
    """torch's own ``F.linear`` for the measurement. An earlier test in the same process that built a
    ZeRO-3 model left DeepSpeed's replacement in place (``zero.Init``'s ``mem_efficient_linear``
    patches ``torch.nn.functional.linear`` for the whole process), and its backward keeps every
    linear's input, frozen or not: what this test measures would then depend on the test order."""
    import torch.nn.functional as F

    original = F.linear
    try:
        from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as Init

        F.linear = getattr(Init, "linear_bk", F.linear)
    except ImportError:
        pass
    try:
        yield
    finally:
        F.linear = original


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attn", ["sdpa", "packed"])
def test_layer_saves_what_the_formula_counts(kind, dtype, attn):
    lp = 4 if dtype == torch.float32 else 2
    shape = ModelShape(
        num_params=0,
        hidden_size=H,
        intermediate_size=I,
        num_layers=1,
        num_heads=HEADS,
        num_kv_heads=KV,
        vocab_size=100,
    )
    want = layer_activation_bytes(shape, lp, packed=attn == "packed")
    # by hand, native fp32: 8H + 24H + 8K + 16I + 4n + 8 = 2048 + 6144 + 1024 + 11264 + 24 = 20504
    assert {(4, False): 20504, (2, False): 11288}.get((lp, attn == "packed"), want) == want
    assert _saved_bytes_per_token(kind, dtype, attn) == want


ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("attn", ["sdpa", "packed"])
@pytest.mark.parametrize("targets", [ALL, ("q_proj", "v_proj"), ("o_proj", "down_proj")])
@pytest.mark.parametrize(
    "dtype, adapter_dtype", [(torch.bfloat16, None), (torch.float32, None), (torch.bfloat16, torch.float32)]
)
def test_lora_layer_saves_what_the_lora_formula_counts(kind, attn, targets, dtype, adapter_dtype):
    # Every target in the model's dtype keeps its input (shared by the targets reading it) and its
    # [tokens, rank] x A^T; fp32 factors on a bf16 layer (PEFT's upcast) keep a cast copy per target.
    lp, rank = (2 if dtype == torch.bfloat16 else 4), 8
    la = None if adapter_dtype is None else 4
    shape = ModelShape(0, H, I, 1, HEADS, KV, 100)
    want = lora_layer_activation_bytes(shape, lp, rank, targets, la, packed=attn == "packed")
    assert _saved_bytes_per_token(kind, dtype, attn, (rank, targets), adapter_dtype) == want
    full = layer_activation_bytes(shape, lp, packed=attn == "packed")
    if targets == ALL and la is None:  # by hand: the two frozen norms keep no normalised input
        assert want == full - 2 * lp * H + 7 * lp * rank
    if targets == ALL and la == 4 and attn == "sdpa":
        # by hand, native bf16 with fp32 factors: 2 (4H + 4) + lp (2H + 2K) + 4n + 3 lp I kept whatever
        # trains = 7832; each target's fp32 input, 4 (6H + I) = 8960; 7 x 4 r = 224
        assert want == 7832 + 8960 + 224 == 17016 > full
