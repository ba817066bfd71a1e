"""Pinned host memory of ``actor.offload_during_rollout``, per actor rank and per node, from the config's sizes.

Pure arithmetic (no torch). ``bandpo.actor.offload`` moves the actor's states into page-locked host
memory while vLLM generates; every one of those tensors comes from torch's pinned (caching host)
allocator, which rounds each block up to the next power of two (so that freed blocks are reused by
size; the blocks stay cached across steps). The 6.2 GB bf16 flat buffer of Qwen2.5-3B under ZeRO-2
pins 8 GiB: what a node needs is the sum of the rounded blocks (``pinned_block``), 1.3-1.5x the
tensors' bytes for the shipped models.

What is pinned, per rank (P parameters, T that train, W ranks, lp bytes a weight; ``bandpo.actor.offload``):
    ZeRO-2  lp_params     DeepSpeed's bf16 flat buffer, one block: 2P (LoRA: the adapter's 2T)
            hp_params     its fp32 master partition, one block: 4T/W
            adam          exp_avg and exp_avg_sq of that partition, a block each: 4T/W
            frozen        LoRA: each frozen base weight its own block (lp bytes a value)
            ref           the reference model (kl_coef > 0, no LoRA): each parameter its own block
    ZeRO-3  hp_params     the fp32 partition in sub-groups of DeepSpeed's 1e9 elements, a block each
            adam          two blocks per sub-group
            lp_grads      the fp32 gradient partition, one block: 4T/W
            ref           each parameter's partition (numel / W, rounded up) its own block
ZeRO-2's gradient partition goes to pageable memory (``.to("cpu")``: not pinned, not counted); the
bf16 weight partitions of ZeRO-3 stay on the GPU (the weight sync gathers them). Biases (Qwen2's q, k,
v) are left out: a few KB a layer.
"""

from __future__ import annotations

from bandpo.distributed.footprint import ModelShape

GIB = float(1 << 30)
SUB_GROUP_ELEMENTS = 10**9  # DeepSpeed's default zero_optimization.sub_group_size (ZeRO-3)


def pinned_block(nbytes: int) -> int:
    """Bytes torch's pinned allocator takes for a tensor of ``nbytes``: the next power of two."""
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


def parameter_sizes(shape: ModelShape, num_params: int | None = None) -> list[int]:
    """Elements of every weight tensor of a Qwen2/Llama model of ``shape`` (biases left out): per layer
    q, k, v, o, gate, up, down and two norms; the embedding, the final norm and, when ``num_params``
    says the embeddings are not tied (more than half a [V, H] beyond the tied count), the lm_head."""
    H, I, K, V = shape.hidden_size, shape.intermediate_size, shape.kv_size, shape.vocab_size
    layer = [H * H, K * H, K * H, H * H, I * H, I * H, I * H, H, H]
    sizes = layer * shape.num_layers + [V * H, H]
    total = shape.num_params if num_params is None else num_params
    if total - sum(sizes) > V * H // 2:
        sizes.append(V * H)
    return sizes


def pinned_terms(
    shape: ModelShape, world: int, zero_stage: int, lp: int, trainable: int, lora: bool, ref: bool
) -> list[tuple[str, int, int]]:
    """One rank's pinned tensors while vLLM generates: ``(what, bytes, pinned bytes)`` per kind (module
    docstring); ``trainable``: T, the parameters the optimizer steps."""
    W, T, P = max(1, world), int(trainable), int(shape.num_params)
    part = -(-T // W)  # elements of the rank's partition of the trainable parameters
    blocks: dict[str, list[int]] = {}
    if zero_stage == 2:
        blocks["lp_params"] = [lp * (T if lora else P)]
        blocks["hp_params"] = [4 * part]
        blocks["adam"] = [4 * part, 4 * part]
        if lora:
            blocks["frozen"] = [lp * n for n in parameter_sizes(shape)]
        elif ref:
            blocks["ref"] = [lp * n for n in parameter_sizes(shape)]
    elif zero_stage == 3:
        n_sub = -(-part // SUB_GROUP_ELEMENTS)
        subs = [4 * -(-part // n_sub)] * n_sub
        blocks["hp_params"] = subs
        blocks["adam"] = subs * 2
        blocks["lp_grads"] = [4 * part]
        if ref and not lora:
            blocks["ref"] = [lp * -(-n // W) for n in parameter_sizes(shape)]
    else:
        raise ValueError(f"offload during rollout supports ZeRO stages 2 and 3, got {zero_stage!r}")
    return [(k, sum(v), sum(pinned_block(b) for b in v)) for k, v in blocks.items()]


def host_estimate(
    shape: ModelShape,
    world: int,
    ranks_per_node: int,
    zero_stage: int,
    lp: int,
    trainable: int,
    lora: bool,
    ref: bool,
) -> dict:
    """``{"rank_gib", "rank_pinned_gib", "node_gib", "node_pinned_gib", "terms"}``: ``pinned_terms`` (same
    arguments) for one rank, and for ``ranks_per_node`` of them on a node; ``terms``: what -> (GiB, pinned GiB)."""
    terms = pinned_terms(shape, world, zero_stage, lp, trainable, lora, ref)
    raw, pinned = sum(t[1] for t in terms), sum(t[2] for t in terms)
    return {
        "rank_gib": raw / GIB,
        "rank_pinned_gib": pinned / GIB,
        "node_gib": ranks_per_node * raw / GIB,
        "node_pinned_gib": ranks_per_node * pinned / GIB,
        "terms": {k: (r / GIB, p / GIB) for k, r, p in terms},
    }


def host_line(est: dict | None, ranks_per_node: int) -> str:
    """The estimate's line in the plan command's memory table."""
    if est is None:
        return ""
    terms = "  ".join(f"{k} {p:.1f}" for k, (_, p) in est["terms"].items())
    return (
        f"  pinned host memory while vLLM generates: {est['rank_pinned_gib']:.1f} GiB a rank ({terms}), "
        f"{est['node_pinned_gib']:.1f} GiB on a node of {ranks_per_node} ranks; the tensors are "
        f"{est['node_gib']:.1f} GiB, torch's pinned allocator rounds each up to a power of two"
    )
