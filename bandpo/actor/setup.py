"""Building blocks of an actor rank: seeding, process group, LR schedule, its DeepSpeed engines and GPU."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from bandpo.distributed.ports import free_port


class LinearWarmup:
    """LR multiplier: (step + 1) / warmup_steps for the first ``warmup_steps`` steps, then 1.

    A class rather than a lambda so the scheduler's state (saved in checkpoints) pickles.
    """

    def __init__(self, warmup_steps: int):
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.warmup_steps = warmup_steps

    def __call__(self, step: int) -> float:
        return 1.0 if step >= self.warmup_steps else (step + 1) / self.warmup_steps


def adamw(params, lr: float, betas, weight_decay: float) -> torch.optim.AdamW:
    """torch's AdamW, fused: one vectorised, multi-threaded pass over the weights, m and v a step
    (its CPU and CUDA kernels). The default path on CPU, a loop of whole-tensor ops, makes ~6 passes
    over ZeRO's flat fp32 partition and allocates a temporary of its size."""
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay, fused=True)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def cpu_threads_per_rank(world_size: int) -> int:
    """This process's usable cores (its CPU affinity) shared evenly by ``world_size`` ranks, at least 1."""
    return max(1, len(os.sched_getaffinity(0)) // max(world_size, 1))


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak memory since it started, GiB: what torch allocated on a CUDA ``device``
    (``max_memory_allocated``, the caching allocator's headroom excluded), else the process's peak
    resident set (``ru_maxrss``, KiB on Linux), which counts every library's memory too."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def init_distributed(
    rank: int,
    world_size: int,
    local_rank: int,
    addr: str,
    port: int | None,
    backend: str,
    timeout_min: float = 60,
) -> None:
    """Join (or check) the process group; DeepSpeed reads the rendezvous from the environment.

    ``timeout_min``: how long a collective waits for the slowest rank before the run is ended
    (DeepSpeed's own default is 10 minutes, shorter than a large checkpoint or HF export can take).
    """
    from datetime import timedelta

    import deepspeed

    if torch.distributed.is_initialized():
        if torch.distributed.get_world_size() != world_size or torch.distributed.get_rank() != rank:
            raise RuntimeError(
                f"torch.distributed already initialised as rank {torch.distributed.get_rank()}/"
                f"{torch.distributed.get_world_size()}, but Actor asked for rank {rank}/{world_size}"
            )
        return
    if port is None:
        if world_size > 1:
            raise ValueError("master_port is required when world_size > 1 (rank 0's rendezvous port)")
        port = free_port()
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
    )
    if backend == "gloo":
        from bandpo.actor.jit_lock import SHM_OP, wait_for_build

        if world_size == 1:
            # One rank exchanges nothing, and DeepSpeed's CPU backend would compile its shared-memory
            # all-reduce op first: 67 s of CPU on a fresh machine (2.4 s to load once cached), most of
            # the first command's start-up. DeepSpeed reads the op's entry in this dict before building.
            import deepspeed.ops

            deepspeed.ops.__compatible_ops__[SHM_OP] = False
        else:
            wait_for_build()  # the op's build by another rank (bandpo.actor.jit_lock)
    deepspeed.init_distributed(
        dist_backend=backend, auto_mpi_discovery=False, timeout=timedelta(minutes=timeout_min)
    )


def destroy_engines(engines: list, zero_stage: int) -> None:
    """Undo what keeps DeepSpeed ``engines`` alive after their last reference is dropped (other
    entries, e.g. ZeRO-2's reference model as a plain module, are skipped).

    The optimizer and ZeRO-3's parameter hooks hold the module and the module holds them:
    ``destroy`` removes the hooks, a cyclic collection the rest. DeepSpeed 0.19's ZeRO-3 also keeps
    two process-wide references: the top module on its module-level ``FWD_MODULE_STACK`` (pushed at
    initialisation, never popped), and every parameter coordinator in the class-level ``lru_cache``
    of its ``__params_to_release`` method (keyed by ``self``).
    """
    engines = [e for e in engines if hasattr(e, "destroy")]
    if zero_stage == 3:
        from deepspeed.runtime.zero import parameter_offload
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

        own = {id(m) for e in engines for m in e.module.modules()}
        parameter_offload.FWD_MODULE_STACK[:] = [
            m for m in parameter_offload.FWD_MODULE_STACK if id(m) not in own
        ]
        # A cache: emptying it costs the other engines of this process (if any) one recomputation.
        # The lru_cache sits under DeepSpeed's nvtx wrapper, which keeps it in its closure.
        wrapper = PartitionedParameterCoordinator._PartitionedParameterCoordinator__params_to_release
        for cell in wrapper.__closure__ or ():
            if hasattr(cell.cell_contents, "cache_clear"):
                cell.cell_contents.cache_clear()
    for engine in engines:
        engine.destroy()


def build_engines(
    model_path: str,
    device: torch.device,
    ds_config: dict,
    *,
    zero_stage: int,
    bf16: bool,
    lr: float,
    betas,
    weight_decay: float,
    warmup_steps: int,
    gradient_checkpointing: bool,
    padding_free: bool,
    ref_model: bool,
    lora=None,
):
    """``(DeepSpeed training engine, frozen reference model or None, whether the packed attention runs)``.

    The model is built where it lives: partitioned under ZeRO-3, else on ``device``
    (``bandpo.actor.loading``), in bf16 with ``bf16`` (DeepSpeed keeps the fp32 master weights,
    on GPU and CPU alike: ``bandpo.actor.ds_config``; set from a float32 checkpoint's own values,
    ``restore_fp32_masters``), else fp32. The reference model takes the
    same dtype and, under ZeRO-3, the same partitioning.

    ``lora`` (a ``bandpo.actor.lora.LoraSettings`` that is on): the model is wrapped by PEFT first and
    only the adapter factors go to the optimizer (ZeRO-2 or ZeRO-3; under ZeRO-3 the frozen base stays
    partitioned as built); no reference model is loaded (``ref_model`` is then ignored): the reference is
    the same module with its adapters off (``bandpo.actor.lora``).
    """
    import deepspeed

    from bandpo.actor.attention import use_packed_attention
    from bandpo.actor.ds_config import build_inference_config
    from bandpo.actor.loading import load_model, restore_fp32_masters, weight_files

    dtype = torch.bfloat16 if bf16 else torch.float32
    model = load_model(model_path, dtype, device, ds_config if zero_stage == 3 else None)
    packed_attention = padding_free and use_packed_attention(model)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    use_lora = lora is not None and lora.on
    if use_lora:
        from bandpo.actor.lora import apply_lora

        # Under ZeRO-3 the factors are made whole, outside zero.Init: deepspeed.initialize partitions them.
        model = apply_lora(model, lora)
    # Frozen parameters (LoRA's base weights) get no optimizer state at all.
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = adamw(trainable, lr, betas, weight_decay)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        config=ds_config,
        dist_init_required=False,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, LinearWarmup(warmup_steps)),
    )
    if bf16:  # the fp32 masters from the checkpoint's own values, not from the bf16 copy
        restore_fp32_masters(engine.module, weight_files(model_path), zero3=zero_stage == 3)
    if not ref_model or use_lora:
        return engine, None, packed_attention
    inf_config = build_inference_config(zero_stage=zero_stage, bf16=bf16)
    ref = load_model(model_path, dtype, device, inf_config if zero_stage == 3 else None)
    ref.requires_grad_(False)
    if padding_free and use_packed_attention(ref) != packed_attention:
        raise RuntimeError("the reference model loaded with another attention implementation than the actor")
    if zero_stage == 3:  # partitioned like the actor; DeepSpeed gathers layers during forward
        ref = deepspeed.initialize(model=ref, config=inf_config, dist_init_required=False)[0]
    else:
        ref = ref.to(device)
    ref.eval()  # DeepSpeedEngine.eval() returns None, so not chained
    return engine, ref, packed_attention


def assigned_gpu(rank: int, device_count: int) -> int:
    """This rank's torch device index: from the GPU ids Ray assigned to it, else ``rank % device_count``."""
    from bandpo.distributed import local_gpu_index

    try:
        import ray

        assigned = ray.get_gpu_ids() if ray.is_initialized() else []
    except ImportError:
        assigned = []
    return local_gpu_index(assigned, os.environ.get("CUDA_VISIBLE_DEVICES"), rank, device_count)
