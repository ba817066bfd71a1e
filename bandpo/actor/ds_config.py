"""DeepSpeed config for the actor, and the batch arithmetic behind it.

Batch vocabulary (rows = responses):
    mini_batch_size   global rows per optimizer step (all data-parallel ranks together)
    micro_batch_size  rows per forward/backward on one rank
    grad_accum        micro-batches per rank per optimizer step
                      = mini_batch_size / (world_size * micro_batch_size)

The optimizer and LR schedule are built by the worker (torch AdamW + LambdaLR) and handed
to ``deepspeed.initialize``; the config therefore has no "optimizer"/"scheduler" sections
and sets ``zero_allow_untested_optimizer`` so ZeRO accepts the client optimizer.

With bf16 the gradients are accumulated in fp32 (``data_types.grad_accum_dtype``): DeepSpeed's
default is the model's dtype, and summing tens of packed micro-batches per optimizer step in
bf16 (8 mantissa bits) loses the small contributions of the later ones. The price is the ZeRO
gradient partition in 4 instead of 2 bytes per parameter (``bandpo.distributed.memory``).

bf16 is DeepSpeed's own bf16 mode on GPU and CPU alike (``actor.bf16``, resolved by
``bandpo.distributed.precision``): the module's weights and activations in bf16, fp32 master
weights in the ZeRO optimizer (ZeRO-2's ``single_partition_of_fp32_groups``, ZeRO-3's
``fp32_partitioned_groups_flat``), which AdamW steps. The alternative on CPU, torch.autocast
around an fp32 model, was not needed: DeepSpeed 0.19.8's CPU accelerator runs this mode
unchanged, checked with ZeRO-2 and ZeRO-3 on one rank and on two gloo ranks (torch 2.13's gloo
all-reduces and gathers bf16 tensors; both ranks end with the same gradient norms and weights).
So CPU trains as the GPU does, with the bf16 weight copy the rollout engines are sent and half
the weight memory, where autocast would keep fp32 weights and cast them to bf16 again in every
forward and backward.
"""

from __future__ import annotations

from bandpo.config.checks import check_batch_split


def grad_accum_steps(mini_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """Micro-batches per rank per optimizer step; raises if the sizes do not divide evenly (``check_batch_split``)."""
    check_batch_split(mini_batch_size, micro_batch_size, world_size)
    return mini_batch_size // world_size // micro_batch_size


def build_ds_config(
    *,
    zero_stage: int,
    micro_batch_size: int,
    grad_accum: int,
    world_size: int,
    grad_clip: float,
    bf16: bool,
) -> dict:
    """A DeepSpeed config dict for one actor engine (training)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch_size * grad_accum * world_size,
        "gradient_clipping": float(grad_clip) if grad_clip and grad_clip > 0 else 0.0,
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": bool(bf16)},
        "zero_allow_untested_optimizer": True,
        # DeepSpeed prints throughput every `steps_per_print` steps; the trainer logs its own.
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if bf16:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def build_inference_config(*, zero_stage: int, bf16: bool) -> dict:
    """Config for the frozen reference model under ZeRO-3 (parameters partitioned, no optimizer)."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": bool(bf16)},
        "steps_per_print": 2**31 - 1,
    }
