"""Per-GPU memory of a placement plan, phase by phase, from the model's sizes in the config.

Pure arithmetic (no torch, no Ray): what ``python -m bandpo.distributed`` and the dry run print,
and what they refuse (exit 2) when a phase does not fit the GPU.

Colocated layout (an actor rank and an engine shard on every GPU), two phases per step:
- rollout: vLLM generates with its share (``rollout.gpu_memory_utilization`` x the GPU's memory:
  weights, activations, KV cache) while the actor's residue stays on the GPU;
- train (log-probs and update): the actor at its peak while vLLM sleeps (level 1: weights
  copied to host memory, KV cache discarded, CUDA graph pools released; what stays is the
  memory vLLM allocated outside its sleep-mode pool, ``VLLM_ASLEEP_GIB``);
and once, at start-up (and on resume, when a checkpoint loads into the states), the actor holds
every state it keeps between stages: with offload the actor starts first and offloads before the
engines start (``bandpo.trainer.launch``), and a resume loads while they sleep; without, the
engines hold their share meanwhile.
Every GPU also holds one CUDA context per process on it (``CUDA_CONTEXT_GIB``).

The actor (DeepSpeed ZeRO over W ranks, P parameters, bf16 with an fp32 master copy), with T the
parameters that train: T = P in full fine-tuning, T = A, the LoRA adapter's, with
``actor.lora.rank > 0`` (``footprint.adapter_params``):
    weights      2P (ZeRO-2) or 2P/W (ZeRO-3)     bf16 (with LoRA the frozen base model)
    adapter      LoRA: 2A (ZeRO-2 keeps whole parameters on every rank) or 2A/W (ZeRO-3), the
                 adapter factors in bf16
    ref_weights  as the weights, when algorithm.kl_coef > 0 and LoRA is off (frozen reference model)
    master       4T/W    fp32 master weights
    optimizer    8T/W    Adam's m and v in fp32
    grads        4T/W    the gradient partition, accumulated in fp32 (bandpo.actor.ds_config)
    bucket       2 x 5e8  ZeRO's reduce bucket (DeepSpeed's default reduce_bucket_size, bf16 staging)
    live_params  ZeRO-3: the largest gathered module (the [V, H] lm_head) + the 5e7-element prefetch bucket
    activations  what autograd keeps per token (``bandpo.distributed.footprint``, from the hidden and
                 intermediate sizes and the heads): every layer's, or with gradient checkpointing each
                 layer's input plus one layer recomputed in backward; and the final norm and head's
    optimizer_step  the optimizer step's temporary: one fp32 tensor the size of the rank's partition,
                 4T/W (footprint); activations are freed by then, so the peak holds the larger of the two
    head         padding-free: the chunked lm_head's fp32 [chunk, V] logits, probabilities and gradient
                 (3 x 4 x chunk x V) and, when the lm_head trains (not with LoRA), its weight gradient:
                 an fp32 [V, H] accumulator and its bf16 copy (6 V H, bandpo.actor.chunked); padded:
                 fp32 logits and softmax per token (8 V)

LoRA (``bandpo.actor.lora``) departs from full fine-tuning in these terms only: the base weights
are frozen (no gradient, master copy or Adam state: those are the adapter's, T = A) and, being
outside the optimizer, not partitioned by ZeRO-2, which partitions the optimizer's states and
gradients only (the adapter's own bf16 factors are whole on every rank too); ZeRO-3 partitions
every parameter, so there the frozen base is 2P/W and the factors 2A/W, as full fine-tuning's
weights are, and the same largest module is gathered (live_params); no reference model is loaded
(the reference is the same model with the adapters off); the lm_head never takes an adapter, so the chunked head computes no weight
gradient. The activations are LoRA's own (``footprint.lora_layer_activation_bytes``, exact against
saved-tensor hooks on a tiny Qwen2 and Llama layer at ``actor.lora.dropout`` 0): every target keeps
its input in the adapter's dtype, the model's (``bandpo.actor.lora``), shared by the targets reading
the same tensor, and its [tokens, rank] ``x A^T``; the frozen norms and the linears without an
adapter keep no input. With the seven targets a layer keeps 2 lp H less than in full fine-tuning plus
7 lp rank. Adapter dropout (> 0) is not counted: each target then keeps its
dropped input and the mask, (6H + I) elements of each a layer and token for the seven targets
(the mask 1 byte an element on CUDA's fused dropout, lp bytes on CPU).
Tokens per update forward: ``actor.max_tokens_per_micro_batch`` packed (padding-free), else
``actor.micro_batch_size`` x ``model.max_model_len``.

What stays on the GPU while vLLM generates (the residue): with ``actor.offload_during_rollout``
(``bandpo.actor.offload``) the master weights, Adam's state, the gradients, the reference
model and, under ZeRO-2, the bf16 weights (with LoRA the frozen base and the adapter) go to host
memory; ZeRO-2 keeps its reduce bucket, ZeRO-3 its bf16 weight partition (with LoRA the base's and
the adapter's: the weight sync gathers them on the GPU). Without, every state
but the transient ones (live_params, activations, head) stays. The actor empties PyTorch's cache after each stage, so no reserved peak blocks
stay behind either way.

Split layout: the actor's GPUs hold the actor (its peak in the train phase, its residue in the
rollout phase), the engines' GPUs vLLM's share in both. Figures are allocated bytes; the caching
allocator's fragmentation comes on top (typically a few percent), which is why a phase within a
GiB or two of the capacity is worth a margin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from bandpo.distributed.footprint import (
    adapter_params,
    head_activation_bytes,
    layers_activation_bytes,
    model_shape,
    optimizer_step_bytes,
)
from bandpo.distributed.host_memory import host_estimate, host_line
from bandpo.distributed.plan import Plan
from bandpo.distributed.precision import resolve_bf16

if TYPE_CHECKING:
    from bandpo.config.schema import TrainConfig

GIB = float(1 << 30)
# Per process on a GPU: the CUDA context, cuBLAS/cuDNN workspaces and NCCL's communicator buffers.
CUDA_CONTEXT_GIB = 0.6
# vLLM asleep (level 1): NCCL buffers and tensors allocated outside its sleep-mode pool.
VLLM_ASLEEP_GIB = 1.0
ZERO_BUCKET_ELEMENTS = 5e8  # DeepSpeed's default reduce_bucket_size
ZERO3_PREFETCH_ELEMENTS = 5e7  # DeepSpeed's default stage3_prefetch_bucket_size


PHASES = ("startup", "rollout", "train")
Terms = list[tuple[str, float | None]]  # (what, GiB) adding up to a phase on one kind of GPU


@dataclass
class MemoryEstimate:
    """GiB per GPU: the actor's ``parts``, and for each kind of GPU (``colocated``, or ``actor`` and
    ``engine`` in the split layout) the terms each phase adds up (``gpus[kind][phase]``).

    A phase's figure is its worst GPU; a phase with vLLM's share in it (and ``peak``) is None when
    the GPU's memory is unknown (the share is a fraction of it). ``capacity_from`` says where the capacity came from.
    ``lora``: with LoRA on, its rank, target modules and parameter counts (``lora_summary``), else None;
    ``zero_stage``: ``actor.zero_stage`` (whether LoRA's frozen base is partitioned).
    """

    parts: dict[str, float]
    offload: bool
    capacity: float | None
    gpus: dict[str, dict[str, Terms]]
    capacity_from: str = "trainer.gpu_memory_gib"
    lora: dict | None = None
    zero_stage: int = 2
    host: dict | None = None  # with offload: pinned host memory (``bandpo.distributed.host_memory``)
    ranks_per_node: int = 0

    def on(self, gpu: str, phase: str) -> float | None:
        terms = self.gpus[gpu][phase]
        return None if any(v is None for _, v in terms) else sum(v for _, v in terms)

    def phase(self, name: str) -> float | None:
        values = [self.on(g, name) for g in self.gpus]
        return None if any(v is None for v in values) else max(values)

    @property
    def rollout(self) -> float | None:
        return self.phase("rollout")

    @property
    def train(self) -> float | None:
        return self.phase("train")

    @property
    def peak(self) -> float | None:
        phases = [self.phase(p) for p in PHASES]
        return None if None in phases else max(phases)

    def as_json(self) -> dict[str, float | None]:
        def r(v):
            return None if v is None else round(v, 2)

        return {
            "rollout": r(self.rollout),
            "train": r(self.train),
            "startup": r(self.phase("startup")),
            "peak": r(self.peak),
            "capacity": r(self.capacity),
            "host_pinned_per_node": r(self.host["node_pinned_gib"]) if self.host else None,
        }


def offload_during_rollout(cfg: TrainConfig, layout: str) -> bool:
    """``actor.offload_during_rollout``: null (auto) = on in the colocated GPU layout only; never on CPU."""
    value = cfg.actor.offload_during_rollout
    if layout == "cpu":
        return False
    return layout == "colocated" if value is None else bool(value)


def lora_of(cfg: TrainConfig) -> tuple[int, tuple[str, ...]] | None:
    """``(actor.lora.rank, actor.lora.target_modules)`` when LoRA is on (rank > 0), else None."""
    lora = cfg.actor.lora
    rank = int(lora.rank)
    return (rank, tuple(lora.target_modules or ())) if rank > 0 else None


def trainable_params(cfg: TrainConfig, shape) -> int:
    """T: the parameters the optimizer steps, the model's or with LoRA the adapter's
    (``footprint.adapter_params``: a ``ConfigError`` naming ``actor.lora.target_modules`` for a
    target it cannot size)."""
    lora = lora_of(cfg)
    return shape.num_params if lora is None else adapter_params(shape, *lora)


def actor_parts(cfg: TrainConfig, world: int, bf16: bool = True) -> dict[str, float] | None:
    """The actor's memory in GiB on one of ``world`` ranks (module docstring: full fine-tuning, or
    LoRA's frozen base and trainable adapter); None without model sizes in the config."""
    m, a = cfg.model, cfg.actor
    shape = model_shape(m)
    if shape is None:
        return None
    P, H, V = float(shape.num_params), shape.hidden_size, shape.vocab_size
    lora = lora_of(cfg) is not None
    T = float(trainable_params(cfg, shape))  # = P without LoRA
    W = max(1, world)
    z3 = int(a.zero_stage) == 3
    lp = 2 if bf16 else 4  # bytes per weight as the model computes
    parts = {
        "weights": lp * P / (W if z3 else 1),
        "master": 4 * T / W,
        "optimizer": 8 * T / W,
        "grads": 4 * T / W,
        "bucket": lp * ZERO_BUCKET_ELEMENTS,
    }
    if lora:
        parts["adapter"] = lp * T / (W if z3 else 1)
    elif float(cfg.algorithm.kl_coef) > 0:
        parts["ref_weights"] = parts["weights"]
    if z3:
        parts["live_params"] = lp * (V * H + ZERO3_PREFETCH_ELEMENTS)
    ckpt = bool(a.gradient_checkpointing or m.gradient_checkpointing)
    padding_free = bool(a.padding_free and a.max_tokens_per_micro_batch)
    if padding_free:
        tokens = int(a.max_tokens_per_micro_batch)
        chunk = int(a.logits_chunk_tokens or 512)
        head_weight_grad = 0 if lora else (4 + (lp if lp != 4 else 0)) * V * H
        parts["head"] = 3 * 4 * chunk * V + head_weight_grad
    else:
        tokens = int(a.micro_batch_size) * int(m.max_model_len)
        parts["head"] = 0.0
    per_token = layers_activation_bytes(shape, lp, ckpt, packed=padding_free, lora=lora_of(cfg))
    parts["activations"] = tokens * (per_token + head_activation_bytes(shape, lp, padding_free))
    parts["optimizer_step"] = optimizer_step_bytes(shape, W, int(a.zero_stage), T)
    return {k: v / GIB for k, v in parts.items()}


def lora_summary(cfg: TrainConfig) -> dict | None:
    """With LoRA on: ``{"rank", "target_modules", "adapter_params", "base_params"}`` (the adapter's
    parameters train, the base model's ``model.num_params`` are frozen); None when off or without
    model sizes."""
    lora, shape = lora_of(cfg), model_shape(cfg.model)
    if lora is None or shape is None:
        return None
    return {
        "rank": lora[0],
        "target_modules": list(lora[1]),
        "adapter_params": adapter_params(shape, *lora),
        "base_params": shape.num_params,
    }


RESIDENT = (
    "weights",
    "adapter",
    "ref_weights",
    "master",
    "optimizer",
    "grads",
    "bucket",
)  # between the actor's stages
TRANSIENT = ("live_params", "activations", "head")  # during a forward/backward only
STEP = ("optimizer_step",)  # during the optimizer step only, after the activations are freed


def actor_residue(parts: dict[str, float], offload: bool, zero_stage: int) -> float:
    """GiB the actor leaves on its GPU while vLLM generates (module docstring)."""
    if not offload:
        return sum(parts.get(k, 0.0) for k in RESIDENT)
    # ZeRO-3 keeps every bf16 partition: the weights' and, with LoRA, the adapter's
    return parts["weights"] + parts.get("adapter", 0.0) if zero_stage == 3 else parts["bucket"]


def memory_estimate(
    cfg: TrainConfig,
    plan: Plan,
    capacity_gib: float | None = None,
    capacity_from: str = "trainer.gpu_memory_gib",
) -> MemoryEstimate | None:
    """Per-GPU memory by phase for ``cfg`` laid out as ``plan`` on GPUs of ``capacity_gib`` (None:
    unknown); None on CPU or without model sizes in the config."""
    if plan.layout == "cpu":
        return None
    # GPU layouts only (CPU returned above): auto is bf16 there, the same resolution as the trainer's.
    parts = actor_parts(cfg, len(plan.of("actor")), resolve_bf16(cfg.actor.bf16, "cuda"))
    if parts is None:
        return None
    offload = offload_during_rollout(cfg, plan.layout)
    resident = sum(parts.get(k, 0.0) for k in RESIDENT)
    peak = resident + max(sum(parts.get(k, 0.0) for k in TRANSIENT), sum(parts.get(k, 0.0) for k in STEP))
    residue = actor_residue(parts, offload, int(cfg.actor.zero_stage))
    share = None if capacity_gib is None else float(cfg.rollout.gpu_memory_utilization) * capacity_gib
    parts = {**parts, "actor_peak": peak, "actor_residue": residue}
    if share is not None:
        parts["vllm_share"] = share
    vllm = ("vLLM's share (rollout.gpu_memory_utilization x GPU memory)", share)
    actor_left = (f"actor residue (actor.offload_during_rollout={str(offload).lower()})", residue)
    if plan.layout == "colocated":
        ctx = ("CUDA contexts (actor + vLLM)", 2 * CUDA_CONTEXT_GIB)
        before = [("vLLM asleep or not started", VLLM_ASLEEP_GIB)] if offload else [vllm]
        gpus = {
            "colocated": {
                "startup": [("actor's states as built or loaded", resident), *before, ctx],
                "rollout": [actor_left, vllm, ctx],
                "train": [("actor peak", peak), ("vLLM asleep", VLLM_ASLEEP_GIB), ctx],
            }
        }
    else:
        ctx = ("CUDA context", CUDA_CONTEXT_GIB)
        gpus = {
            "actor": {
                "startup": [("actor's states as built or loaded", resident), ctx],
                "rollout": [actor_left, ctx],
                "train": [("actor peak", peak), ctx],
            },
            "engine": {"startup": [vllm, ctx], "rollout": [vllm, ctx], "train": [vllm, ctx]},
        }
    per_node = max(sum(1 for a in plan.of("actor") if a.node == n) for n in range(plan.nodes))
    bf16 = resolve_bf16(cfg.actor.bf16, "cuda")
    host = None
    if offload:
        lora, shape = lora_of(cfg) is not None, model_shape(cfg.model)
        ref = not lora and float(cfg.algorithm.kl_coef) > 0
        trainable = trainable_params(cfg, shape)
        world, z = len(plan.of("actor")), int(cfg.actor.zero_stage)
        host = host_estimate(shape, world, per_node, z, 2 if bf16 else 4, trainable, lora, ref)
    return MemoryEstimate(
        parts,
        offload,
        capacity_gib,
        gpus,
        capacity_from,
        lora_summary(cfg),
        int(cfg.actor.zero_stage),
        host,
        per_node,
    )


# What shrinks each phase, named in the message when it does not fit. With LoRA under ZeRO-2 the frozen
# base weights are whole on every rank: more ranks shard only the adapter's small states
# (``NOT_WITH_LORA_ZERO2``); ZeRO-3 shards the base too.
REMEDIES = {
    "startup": (
        "rollout.gpu_memory_utilization (vLLM's share)",
        "actor.zero_stage=3 (weights sharded)",
        "actor.num_workers (more ranks shard the states)",
    ),
    "rollout": (
        "rollout.gpu_memory_utilization (vLLM's share)",
        "actor.offload_during_rollout=true",
        "actor.zero_stage=3 (the actor's residue)",
    ),
    "train": (
        "actor.max_tokens_per_micro_batch (activations)",
        "actor.zero_stage=3 (weights sharded)",
        "actor.num_workers (more ranks shard the states)",
        "actor.gradient_checkpointing=true",
        "actor.logits_chunk_tokens",
    ),
}


NOT_WITH_LORA_ZERO2 = ("actor.num_workers",)


def memory_errors(est: MemoryEstimate | None) -> list[str]:
    """One line per GPU kind and phase that does not fit ``est.capacity`` (none when it is unknown)."""
    if est is None or est.capacity is None:
        return []
    out = []
    for gpu, phases in est.gpus.items():
        for phase, terms in phases.items():
            need = est.on(gpu, phase)
            if need is not None and need > est.capacity:
                sums = " + ".join(f"{name} {v:.1f}" for name, v in terms)
                base_whole = est.lora is not None and est.zero_stage != 3
                remedies = [
                    r for r in REMEDIES[phase] if not (base_whole and r.startswith(NOT_WITH_LORA_ZERO2))
                ]
                out.append(
                    f"memory: the {phase} phase needs {need:.1f} GiB on a{'n' if gpu[0] in 'aeiou' else ''} "
                    f"{gpu} GPU, more than its {est.capacity:.1f} GiB ({est.capacity_from}): {sums}; "
                    f"shrink it with {', '.join(remedies)}"
                )
    return out


def memory_table(est: MemoryEstimate | None, plan: Plan) -> str:
    """The estimate as printed by the plan command and the dry run."""
    if plan.layout == "cpu":
        return "memory: CPU layout (no GPU estimate)"
    if est is None:
        return (
            "memory: no model sizes (model.num_params / hidden_size / intermediate_size / num_layers / "
            "num_heads / num_kv_heads / vocab_size) in the config"
        )
    p = est.parts
    keys = [
        k
        for k in (
            "weights",
            "adapter",
            "ref_weights",
            "master",
            "optimizer",
            "grads",
            "bucket",
            "live_params",
            "activations",
            "head",
            "optimizer_step",
            "actor_peak",
            "actor_residue",
            "vllm_share",
        )
        if k in p
    ]
    cap = "unknown" if est.capacity is None else f"{est.capacity:.1f}"
    lines = [
        f"memory per GPU (GiB of {cap}; offload during rollout: {'on' if est.offload else 'off'}): "
        + "  ".join(f"{k} {p[k]:.1f}" for k in keys)
    ]
    if est.lora:
        lo = est.lora
        where = "partitioned over the ranks" if est.zero_stage == 3 else "whole on every rank"
        lines.append(
            f"  LoRA rank {lo['rank']} on {', '.join(lo['target_modules'])}: {lo['adapter_params']:,} adapter "
            f"parameters train ({100 * lo['adapter_params'] / lo['base_params']:.2f}% of the base's "
            f"{lo['base_params']:,}, frozen in weights, {where}); master, optimizer and grads "
            "are the adapter's; no reference model; the head computes no weight gradient"
        )
    for gpu in est.gpus:
        shown = [(ph, est.on(gpu, ph)) for ph in PHASES]
        lines.append(
            f"  {gpu} GPU: " + "  ".join(f"{ph} {'?' if v is None else f'{v:.1f}'}" for ph, v in shown)
        )
    if est.capacity is None:
        lines.append(
            "  GPU memory unknown: vLLM's share (rollout.gpu_memory_utilization x the GPU's memory) and the "
            "rollout phase are not computed; set trainer.gpu_memory_gib (or --gpu-gib) to check the fit"
        )
    else:
        lines.append(f"  peak {est.peak:.1f} of {est.capacity:.1f} GiB")
    if est.host:
        lines.append(host_line(est.host, est.ranks_per_node))
    return "\n".join(lines)


def estimate_for(cfg: TrainConfig, plan: Plan, shape, gpu_gib: float | None = None) -> MemoryEstimate | None:
    """``memory_estimate`` on GPUs of ``gpu_gib`` (the command's flag) if given, else
    ``trainer.gpu_memory_gib``, else the memory the cluster shape reports, else unknown."""
    if gpu_gib is not None:
        return memory_estimate(cfg, plan, float(gpu_gib), "--gpu-gib")
    if cfg.trainer.gpu_memory_gib is not None:
        return memory_estimate(cfg, plan, float(cfg.trainer.gpu_memory_gib), "trainer.gpu_memory_gib")
    found = getattr(shape, "gpu_gib", None)
    return memory_estimate(cfg, plan, found, "reported by the GPU") if found else memory_estimate(cfg, plan)
