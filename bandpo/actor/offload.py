"""The actor's states in host memory while vLLM generates, and back for its stages (colocated GPU layout).

``actor.offload_during_rollout`` (on by default where an actor rank and an engine shard share a
GPU): after the update the trainer calls ``ActorGroup.offload`` before the engines wake,
``ActorGroup.offload_weights`` once the weight sync has read the actor's weights (the IPC and
NCCL transports read them on the GPU), and ``ActorGroup.reload`` once the engines sleep again,
before the log-probs. What moves, per ZeRO stage (``moves``):

- ZeRO-2: DeepSpeed 0.19's ``engine.offload_states`` moves the fp32 master weights (hp_params)
  and the gradient partition (lp_grads), and, in ``offload_weights``, the bf16 weights
  (lp_params); ``reload_states`` brings back whatever it moved. The reduce bucket stays (stage
  1/2 does not offload it).
- ZeRO-3: ``offload_states`` moves the gradient partition and the reduce bucket (contiguous
  grad buffer). It refuses the master weights and Adam's state for any optimizer but
  DeepSpeed's FusedAdam (ours is torch's AdamW), so those move here. The bf16 weight partition
  stays: the weight sync gathers it with NCCL, which needs it on the GPU.
- ZeRO-2 with LoRA: the frozen base weights are outside the optimizer, so ``lp_params`` holds only
  the adapters; the parameters that need no gradient move here, with the weights
  (``offload_weights``), once the sync has read them.
- ZeRO-3 with LoRA: as without; the optimizer's flat fp32 partitions are the adapter's, and the bf16
  partitions of the frozen base and of the factors stay like every weight partition.
- Both: Adam's ``exp_avg`` / ``exp_avg_sq`` (moved here, each tensor back to the device it
  came from: DeepSpeed's own helper would also move AdamW's CPU ``step`` counters to the GPU),
  and the reference model (a module under ZeRO-2, its parameter partitions under ZeRO-3).

Host copies are pinned, so the copies back run at PCIe speed. After a move the caching
allocator's free blocks are returned (``empty_cache``): vLLM maps its own memory outside
PyTorch's allocator and can use only what the actor's process gave back.
"""

from __future__ import annotations

import torch

# What DeepSpeed's ``engine.offload_states`` moves per ZeRO stage (OffloadStateTypeEnum values).
DEEPSPEED_STATES = {2: ("hp_params", "lp_params", "lp_grads"), 3: ("lp_grads", "contiguous_grad_buffer")}
# Of those, the weights the weight sync reads: they leave only once the engines have them.
WEIGHT_STATES = ("lp_params",)
# What this module moves itself per ZeRO stage.
OWN_STATES = {2: ("optim_states",), 3: ("hp_params", "optim_states")}


def moves(zero_stage: int, ref_model: bool) -> dict[str, tuple[str, ...]]:
    """``{"deepspeed": states, "own": states, "ref": ("ref_model",) or ()}`` moved for ``zero_stage``."""
    if zero_stage not in DEEPSPEED_STATES:
        raise ValueError(f"offload during rollout supports ZeRO stages 2 and 3, got {zero_stage!r}")
    return {
        "deepspeed": DEEPSPEED_STATES[zero_stage],
        "own": OWN_STATES[zero_stage],
        "ref": ("ref_model",) if ref_model else (),
    }


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t``, page-locked where it comes from a GPU (a CPU tensor has nothing to pin for)."""
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.device.type == "cuda")
    host.copy_(t)
    return host


class ActorOffload:
    """Moves one rank's states (``engine``: its DeepSpeed engine, ``ref``: the reference model or
    None) between ``device`` and pinned host memory; ``offload`` / ``offload_weights`` / ``reload``
    are idempotent."""

    def __init__(self, engine, ref, zero_stage: int, device: torch.device):
        self.engine, self.ref, self.zero_stage, self.device = engine, ref, zero_stage, device
        self.what = moves(zero_stage, ref is not None)
        self.offloaded = False
        self.weights_offloaded = False
        self._adam: list[tuple[dict, str, torch.device]] = []  # (state, key, device it came from)
        self._frozen: list[tuple[torch.nn.Parameter, torch.device]] = []  # (parameter, device it came from)

    def offload(self) -> None:
        """Everything in ``moves`` but the weights the sync reads (``offload_weights``)."""
        if self.offloaded:
            return
        self._offload_deepspeed([s for s in self.what["deepspeed"] if s not in WEIGHT_STATES])
        optimizer = self.engine.optimizer
        if "hp_params" in self.what["own"]:  # ZeRO-3: the flat fp32 partitions the optimizer steps
            for flat in optimizer.fp32_partitioned_groups_flat:
                flat.data = _pinned(flat.data)
        self._adam = []
        for state in optimizer.optimizer.state.values():  # the wrapped torch optimizer's per-parameter state
            for key, value in state.items():
                if torch.is_tensor(value) and value.device.type != "cpu":
                    self._adam.append((state, key, value.device))
                    state[key] = _pinned(value)
        self._move_ref("cpu")
        self.offloaded = True
        self._release()

    def offload_weights(self) -> None:
        """The bf16 weights DeepSpeed can move (ZeRO-2's lp_params; none under ZeRO-3), after the sync."""
        if self.weights_offloaded:
            return
        self._offload_deepspeed([s for s in self.what["deepspeed"] if s in WEIGHT_STATES])
        self._frozen = [(p, p.device) for p in self._frozen_params()]
        for p, _ in self._frozen:
            p.data = _pinned(p.data)
        self.weights_offloaded = True
        self._release()

    def _offload_deepspeed(self, states: list[str]) -> None:
        if not states:
            return
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

        # offload_states skips what is already on the host; reload_states brings back all it moved.
        self.engine.offload_states(
            include=[OffloadStateTypeEnum(s) for s in states],
            device=OffloadDeviceEnum.cpu,
            pin_memory=self.device.type != "cpu",
        )

    def reload(self) -> None:
        if not (self.offloaded or self.weights_offloaded):
            return
        optimizer = self.engine.optimizer
        self.engine.reload_states()
        if "hp_params" in self.what["own"]:
            for flat in optimizer.fp32_partitioned_groups_flat:
                flat.data = flat.data.to(self.device, non_blocking=True)
        for state, key, device in self._adam:
            state[key] = state[key].to(device, non_blocking=True)
        self._adam = []
        for p, device in self._frozen:
            p.data = p.data.to(device, non_blocking=True)
        self._frozen = []
        self._move_ref(self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the pinned sources may go once the copies are done
        self.offloaded = self.weights_offloaded = False

    def _frozen_params(self) -> list[torch.nn.Parameter]:
        """ZeRO-2: the module's parameters outside the optimizer (LoRA's base weights), which DeepSpeed's
        ``lp_params`` does not move; none without LoRA. (ZeRO-3 keeps its weight partition anyway.)"""
        module = getattr(self.engine, "module", None)
        if self.zero_stage != 2 or module is None:
            return []
        return [p for p in module.parameters() if not p.requires_grad]

    def _move_ref(self, device) -> None:
        if self.ref is None:
            return
        if self.zero_stage == 3:  # a DeepSpeed engine: each parameter's own partition (ds_tensor)
            for p in self.ref.module.parameters():
                p.ds_tensor.data = (
                    _pinned(p.ds_tensor.data) if device == "cpu" else p.ds_tensor.data.to(device)
                )
        else:  # a module: Module.to("cpu") would give pageable memory, so each tensor moves on its own
            for t in [*self.ref.parameters(), *self.ref.buffers()]:
                t.data = _pinned(t.data) if device == "cpu" else t.data.to(device, non_blocking=True)

    def _release(self) -> None:
        import gc

        gc.collect()
        torch.cuda.empty_cache()
