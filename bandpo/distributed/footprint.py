"""What one training step of a Qwen2/Llama-architecture model holds, from its sizes: the bytes
autograd saves per token, and the optimizer step's temporaries.

Pure arithmetic (no torch): ``bandpo.distributed.memory`` adds these up per GPU and phase, and
``benchmarks/check_memory_model.py`` compares them with a measured CPU peak.

Activations of one decoder layer (SwiGLU MLP, RMSNorms computing in float32), per token, with
``lp`` bytes per element of the model's dtype (2 bf16, 4 fp32), H the hidden size, I the MLP's
intermediate size, n the attention heads, K = kv_heads x head_dim (grouped-query attention),
listing every tensor autograd keeps for backward (each storage once)::

    input RMSNorm       x in float32 (pow's input; the layer input itself in fp32)    4 H
                        rsqrt(mean(x^2) + eps) (the normalising mul's operand)        4
                        (x * rsqrt).to(dtype) (the weight multiply's operand)         lp H
                        weight * that = the norm's output (q/k/v_proj's input)        lp H
    attention           q after rotary (SDPA's input)                                 lp H
                        k after rotary, v (SDPA's inputs)                             2 lp K
                        SDPA's output (it keeps it for backward), o_proj's input      lp H
                        SDPA's logsumexp, float32 per head                            4 n
    post-attn RMSNorm   as the input norm, on the residual sum                        4 H + 4 + 2 lp H
    MLP                 gate output g (SiLU's input)                                  lp I
                        SiLU(g) and the up output (the product's operands)            2 lp I
                        their product (down_proj's input)                             lp I

    native attention (transformers' sdpa without a mask, flash-attention):
        8 H + 6 lp H + 2 lp K + 4 lp I + 4 n + 8
    packed attention (``bandpo.actor.attention``, the actor's padding-free path): k and v are
    gathered per bucket and repeated to every query head (2 lp H instead of 2 lp K), and o_proj
    reads a gathered copy of SDPA's output (another lp H):
        8 H + 9 lp H + 4 lp I + 4 n + 8

Nothing else is kept: rotary embedding multiplies q and k by cos and sin, so it keeps cos and
sin (computed once per forward and shared by every layer), not q or k; the projections' and
the residual adds' outputs are read by nothing that keeps them. Qwen2.5-7B in bf16 (H 3584,
I 18944, 28 heads, 4 KV heads) keeps 244,856 bytes per token and layer packed (68.3 H), the
34 H of GPT's 4H-MLP layer (Korthikanti et al. 2022) less than half of it. The packed buckets
pad each row to its bucket's longest (at most 1 / BUCKET_RATIO, 1.25x, of the attention terms);
that padding and the attention mask of padded batches (under which CUDA's sdpa repeats k and v
too) are not counted. tests/unit/distributed/test_footprint.py checks the two sums against the
tensors a real Qwen2 and Llama layer saves (saved-tensor hooks).

With LoRA (``bandpo.actor.lora``: the base frozen, adapters of rank r at dropout 0 on some targets,
``lora_layer_activation_bytes``) a layer keeps what its inputs' gradients need whatever trains: both
norms' float32 input and rsqrt (2 (4 H + 4)), q, k, v, SDPA's output and logsumexp (as above), and
the MLP's g, SiLU(g) and up (3 lp I). A frozen norm keeps no normalised input, a frozen linear no
input. Each adapter's lora_A keeps its target's input and lora_B its [tokens, r] x A^T (la r, la the
adapter's bytes per value). With the adapter in the model's dtype a target's input is the tensor
itself, kept once for the targets that read it: the input norm's output (q, k, v: lp H), o_proj's
input (lp H packed, its gathered copy; native, SDPA's output, already kept), the post-attention
norm's output (gate, up: lp H), the MLP product (down: lp I). fp32 factors on a bf16 model (PEFT's
default upcast, which the actor turns off) cast the input first: each target keeps its own fp32 copy
(4 H or 4 I), 4 (6 H + I) for the seven targets against 2 (3 H + I) shared in bf16. With every target
in the model's dtype a layer keeps exactly 2 lp H less than full fine-tuning (the norms) plus 7 lp r.
tests/unit/distributed/test_footprint.py checks it against saved-tensor hooks as well.

Gradient checkpointing (non-reentrant, as the actor enables it) keeps each layer's input (lp H
per token and layer) and recomputes one layer at a time in backward, whose activations then
add up as above: L lp H + A per token.

The optimizer step's temporaries: the actor's AdamW is torch's fused kernel
(``bandpo.actor.setup.adamw``), which updates m, v, the weight decay and the parameters in place
without one; the estimate keeps the foreach path's (``_multi_tensor_adam``: one ``sqrt(v)`` for all
the tensors of a device/dtype group at once), 4 bytes per fp32 parameter it steps, as headroom, so
this term is an upper bound. Under DeepSpeed ZeRO-2 it steps the rank's flat fp32 partition (P / W),
built just before from the gradients (a flat copy of them while the per-parameter ones are still
held, then freed): one fp32 partition's size more than the gradients at either moment. ZeRO-3
steps its partition in sub-groups of at most ``ZERO3_SUB_GROUP_ELEMENTS`` at a time. With LoRA
only the adapter's parameters are stepped: the same temporary, for their number / W.

A LoRA adapter (``bandpo.actor.lora``: PEFT, ``bias="none"``) on a target ``nn.Linear`` of in
and out features trains A [rank, in] and B [out, rank]: ``rank x (in + out)`` parameters per
layer. The targets of a Qwen2/Llama decoder layer (``linear_features``), with H the hidden size,
I the intermediate size and K = kv_heads x head_dim (head_dim = H / heads)::

    q_proj  H -> H      k_proj, v_proj  H -> K      o_proj  H -> H
    gate_proj, up_proj  H -> I                      down_proj  I -> H

so the adapter holds ``L x rank x sum over targets (in + out)`` parameters (``adapter_params``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from bandpo.errors import ConfigError

if TYPE_CHECKING:
    from bandpo.config.schema import ModelConfig

ZERO3_SUB_GROUP_ELEMENTS = 1e9  # DeepSpeed's default stage3 sub_group_size
SIZE_KEYS = (
    "num_params",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "vocab_size",
)


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only SwiGLU model's sizes (``model.<key>`` in the config, ``SIZE_KEYS``)."""

    num_params: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int

    @property
    def kv_size(self) -> int:
        """K: the width of the k and v projections (kv_heads x head_dim, head_dim = H / heads)."""
        return self.num_kv_heads * (self.hidden_size // self.num_heads)


def model_shape(model_cfg: ModelConfig) -> ModelShape | None:
    """The sizes from ``cfg.model``; None when ``model.num_params`` is not set (no estimate), and a
    ``ConfigError`` naming the key when it is set but another size is missing."""
    if model_cfg.num_params is None:
        return None
    missing = [k for k in SIZE_KEYS if getattr(model_cfg, k) is None]
    if missing:
        raise ConfigError(
            f"config error: model.{missing[0]} is required for the memory estimate when model.num_params is set "
            f"(from the model's config.json)"
        )
    return ModelShape(**{k: int(getattr(model_cfg, k)) for k in SIZE_KEYS})


def layer_activation_bytes(shape: ModelShape, lp: int, packed: bool = True) -> int:
    """Bytes one decoder layer keeps for backward per token (module docstring): ``packed`` the
    actor's packed attention, else the native one."""
    H, I, n = shape.hidden_size, shape.intermediate_size, shape.num_heads
    norms = 2 * (4 * H + 4 + 2 * lp * H)
    kv = 2 * lp * (H if packed else shape.kv_size)
    attention = lp * H + kv + lp * H + 4 * n + (lp * H if packed else 0)
    return norms + attention + 4 * lp * I


# The inputs LoRA targets read, each shared by the targets listed: (targets, width of the input).
LORA_INPUTS = (
    (("q_proj", "k_proj", "v_proj"), "hidden"),  # the input RMSNorm's output
    (("o_proj",), "hidden"),  # SDPA's output (packed: its gathered copy)
    (("gate_proj", "up_proj"), "hidden"),  # the post-attention RMSNorm's output
    (("down_proj",), "intermediate"),  # SiLU(gate) x up
)


def lora_layer_activation_bytes(
    shape: ModelShape, lp: int, rank: int, targets, la: int | None = None, packed: bool = True
) -> int:
    """Bytes one decoder layer keeps for backward per token with its weights frozen and LoRA adapters
    (rank ``rank``, ``la`` bytes per value, default ``lp``: the model's dtype) on ``targets``, at
    dropout 0 (module docstring): what every layer keeps whatever trains, each target's input and
    each adapter's ``x A^T``."""
    la = lp if la is None else la
    H, I, n = shape.hidden_size, shape.intermediate_size, shape.num_heads
    targets = set(targets)
    kv = 2 * lp * (H if packed else shape.kv_size)
    kept = 2 * (4 * H + 4) + lp * H + kv + lp * H + 4 * n + 3 * lp * I
    for names, width in LORA_INPUTS:
        reading = len(targets.intersection(names))
        if not reading:
            continue
        size = H if width == "hidden" else I
        if la != lp:  # each target casts the input to the adapter's dtype: its own copy
            kept += reading * la * size
        elif names != ("o_proj",) or packed:  # native: o_proj's input is SDPA's output, kept already
            kept += lp * size
    return kept + la * rank * len(targets)


def layers_activation_bytes(
    shape: ModelShape, lp: int, checkpointing: bool, packed: bool = True, lora: tuple | None = None
) -> int:
    """Bytes per token all layers keep at the start of backward; with gradient checkpointing
    their inputs plus the one layer recomputed at a time. ``lora``: ``(rank, targets)`` of LoRA
    adapters in the model's dtype on a frozen model (``lora_layer_activation_bytes``)."""
    if lora is None:
        layer = layer_activation_bytes(shape, lp, packed)
    else:
        layer = lora_layer_activation_bytes(shape, lp, *lora, packed=packed)
    L, H = shape.num_layers, shape.hidden_size
    return L * lp * H + layer if checkpointing else L * layer


def head_activation_bytes(shape: ModelShape, lp: int, padding_free: bool) -> int:
    """Bytes per token the final RMSNorm and the head keep: the norm as in a layer (its output
    is the head's input), then padding-free float32 log-prob, log Z and entropy
    (``bandpo.actor.chunked``), padded the float32 logits and their log-softmax."""
    H = shape.hidden_size
    return 4 * H + 4 + 2 * lp * H + (12 if padding_free else 8 * shape.vocab_size)


def head_transient_bytes(shape: ModelShape, lp: int, chunk: int) -> int:
    """The chunked head's backward (``bandpo.actor.chunked``): three float32 [chunk, V] buffers
    (log p, p, the logits' gradient) and the weight gradient's float32 [V, H] accumulator plus
    its copy in the model's dtype (none in fp32)."""
    V, H = shape.vocab_size, shape.hidden_size
    return 3 * 4 * chunk * V + (4 + (lp if lp != 4 else 0)) * V * H


def linear_features(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """``{name: (in, out)}`` of every ``nn.Linear`` in a Qwen2/Llama decoder layer that can take a LoRA
    adapter, under the module names ``actor.lora.target_modules`` uses (module docstring)."""
    H, I, K = shape.hidden_size, shape.intermediate_size, shape.kv_size
    Q = shape.num_heads * (H // shape.num_heads)  # heads x head_dim: H whenever heads divide H
    return {
        "q_proj": (H, Q),
        "k_proj": (H, K),
        "v_proj": (H, K),
        "o_proj": (Q, H),
        "gate_proj": (H, I),
        "up_proj": (H, I),
        "down_proj": (I, H),
    }


def adapter_params(shape: ModelShape, rank: int, targets) -> int:
    """The LoRA adapter's parameters: ``rank x (in + out)`` per target linear and layer (A [rank, in]
    and B [out, rank]). A name listed twice counts once (PEFT matches each module once). Raises a
    ``ConfigError`` naming ``actor.lora.target_modules`` for a name ``linear_features`` does not know."""
    features = linear_features(shape)
    unknown = [t for t in targets if t not in features]
    if unknown:
        raise ConfigError(
            f"config error: actor.lora.target_modules has {unknown}, which the memory estimate cannot "
            f"size: it knows the Qwen2/Llama linears {', '.join(features)}"
        )
    per_layer = sum(rank * sum(features[t]) for t in dict.fromkeys(targets))
    return shape.num_layers * per_layer


def optimizer_step_bytes(
    shape: ModelShape, world: int, zero_stage: int, trainable: float | None = None
) -> float:
    """The optimizer step's temporaries on one of ``world`` ranks beyond the states and gradients:
    one fp32 tensor the size of the stepped partition (module docstring); ``trainable``: the
    parameters the optimizer steps (None: all the model's, ``shape.num_params``)."""
    partition = (shape.num_params if trainable is None else trainable) / max(1, world)
    if zero_stage == 3:
        partition = min(partition, ZERO3_SUB_GROUP_ELEMENTS)
    return 4 * partition
