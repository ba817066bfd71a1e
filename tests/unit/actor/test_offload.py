"""Offload during rollout (bandpo.actor.offload) on CPU: the decision, what moves per ZeRO stage, and
the moves themselves on a stand-in engine (the real DeepSpeed calls run in the gpu-marked test,
tests/integration/actor/test_offload_gpu.py)."""

import inspect
from types import SimpleNamespace

import pytest
import torch

from bandpo.actor import offload as offload_module
from bandpo.actor.offload import ActorOffload, moves
from bandpo.config import compose
from bandpo.distributed.memory import offload_during_rollout


@pytest.mark.parametrize(
    "value, layout, want",
    [
        ("null", "colocated", True),
        ("null", "split", False),
        ("null", "cpu", False),
        ("false", "colocated", False),
        ("true", "split", True),
        ("true", "cpu", False),
    ],
)
def test_offload_is_on_by_default_only_where_the_actor_shares_its_gpu_with_vllm(value, layout, want):
    cfg = compose([f"actor.offload_during_rollout={value}"])
    assert offload_during_rollout(cfg, layout) is want


def test_what_moves_per_zero_stage():
    assert moves(2, ref_model=True) == {
        "deepspeed": ("hp_params", "lp_params", "lp_grads"),
        "own": ("optim_states",),
        "ref": ("ref_model",),
    }
    # ZeRO-3 keeps its bf16 weight partition on the GPU: the weight sync gathers it with NCCL.
    assert moves(3, ref_model=False) == {
        "deepspeed": ("lp_grads", "contiguous_grad_buffer"),
        "own": ("hp_params", "optim_states"),
        "ref": (),
    }
    with pytest.raises(ValueError, match="ZeRO stages 2 and 3"):
        moves(1, ref_model=False)


def test_offload_contract_with_the_installed_deepspeed():
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    for stage in (2, 3):
        for name in moves(stage, True)["deepspeed"] + moves(stage, True)["own"]:
            OffloadStateTypeEnum(name)  # a renamed state fails here
    params = inspect.signature(DeepSpeedEngine.offload_states).parameters
    assert {"include", "device", "pin_memory"} <= set(params) and OffloadDeviceEnum("cpu")
    assert "non_blocking" in inspect.signature(DeepSpeedEngine.reload_states).parameters
    # Why stage 3's master weights and Adam state move here: DeepSpeed offloads them for its FusedAdam only.
    assert "supported only for DeepSpeed FusedAdam" in inspect.getsource(
        DeepSpeedZeroOptimizer_Stage3.offload_states
    )


class _Engine:
    """Records offload_states / reload_states; its ZeRO optimizer wraps a torch AdamW's per-parameter
    state (a host step counter, m and v on "the device": meta here) and ZeRO-3's flat master partition."""

    def __init__(self):
        flat = torch.empty(4, device="meta")
        adam = {
            "step": torch.tensor(3.0),
            "exp_avg": torch.empty(4, device="meta"),
            "exp_avg_sq": torch.empty(4, device="meta"),
        }
        self.optimizer = SimpleNamespace(
            optimizer=SimpleNamespace(state={flat: adam}), fp32_partitioned_groups_flat=[flat]
        )
        self.calls = []

    def offload_states(self, include, device, pin_memory):
        self.calls.append(("offload_states", tuple(s.value for s in include), device.value, pin_memory))

    def reload_states(self):
        self.calls.append(("reload_states",))


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_offload_then_reload_on_a_stand_in_engine(monkeypatch, zero_stage):
    # On CPU there is no device to leave: "the device" is a meta device here and the "pinned host
    # copy" a new meta tensor, recorded, so the test sees which tensors moved and that they came back.
    moved = []
    monkeypatch.setattr(
        offload_module, "_pinned", lambda t: moved.append(tuple(t.shape)) or torch.empty_like(t)
    )
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    engine = _Engine()
    (state,) = engine.optimizer.optimizer.state.values()
    (flat,) = engine.optimizer.fp32_partitioned_groups_flat
    before = dict(state)
    ref = torch.nn.Linear(4, 3, device="meta")  # ZeRO-2's reference model: a module, each tensor pinned
    ref.register_buffer("scale", torch.empty(3, device="meta"))
    ref_tensors = [ref.weight, ref.bias, ref.scale]
    off = ActorOffload(engine, ref if zero_stage == 2 else None, zero_stage, torch.device("meta"))
    off.offload()
    off.offload()  # idempotent
    # ZeRO-2's bf16 weights stay for the weight sync (IPC / NCCL read them on the GPU) ...
    first = {2: ("hp_params", "lp_grads"), 3: moves(3, False)["deepspeed"]}[zero_stage]
    assert engine.calls == [("offload_states", first, "cpu", True)]
    assert [k for k in state if state[k] is not before[k]] == ["exp_avg", "exp_avg_sq"]  # not the host step
    # (ZeRO-3's master partition,) Adam's m and v, (ZeRO-2's reference model: its parameters and buffers)
    assert moved == [(4,)] * ((zero_stage == 3) + 2) + ([(3, 4), (3,), (3,)] if zero_stage == 2 else [])
    off.offload_weights()  # ... and leave once it has read them (ZeRO-3 keeps its partition: nothing)
    off.offload_weights()
    assert engine.calls[1:] == ([("offload_states", ("lp_params",), "cpu", True)] if zero_stage == 2 else [])
    calls = len(engine.calls)
    off.reload()
    off.reload()
    assert engine.calls[calls:] == [("reload_states",)]
    # Each tensor goes back where it came from: AdamW's step counter stays on the host.
    assert {k: v.device.type for k, v in state.items()} == {
        "step": "cpu",
        "exp_avg": "meta",
        "exp_avg_sq": "meta",
    }
    if zero_stage == 2:  # the reference model went to the host and came back: the same tensors, on the device
        assert [t.device.type for t in ref_tensors] == ["meta"] * 3
        assert [t is u for t, u in zip(ref_tensors, [ref.weight, ref.bias, ref.scale])] == [True] * 3


def test_host_copies_are_plain_on_a_cpu_machine_and_equal():
    # No GPU: nothing to page-lock for (pin_memory needs one); the copy is the tensor's.
    t = torch.arange(6.0).view(2, 3)
    host = offload_module._pinned(t)
    assert torch.equal(host, t) and host.data_ptr() != t.data_ptr() and not host.is_pinned()


@pytest.mark.gpu
def test_the_zero2_reference_model_waits_in_pinned_host_memory():
    device = torch.device("cuda", 0)
    ref = torch.nn.Linear(64, 32).to(device)
    ref.register_buffer("scale", torch.ones(32, device=device))
    want = {k: v.clone() for k, v in ref.state_dict().items()}
    off = ActorOffload(SimpleNamespace(), ref, 2, device)
    off._move_ref("cpu")
    assert all(t.device.type == "cpu" and t.is_pinned() for t in [*ref.parameters(), *ref.buffers()])
    off._move_ref(device)
    torch.cuda.synchronize(device)
    assert all(torch.equal(v, want[k]) and v.device == device for k, v in ref.state_dict().items())


def test_zero2_frozen_base_weights_leave_with_the_weights_and_come_back(monkeypatch):
    """LoRA under ZeRO-2: DeepSpeed's lp_params are the adapters only; the frozen base weights (most of
    the model) move here, after the sync has read them, and come back as the same parameters. As above,
    the "device" is meta and a "host copy" a recorded new meta tensor."""
    moved = []
    monkeypatch.setattr(
        offload_module, "_pinned", lambda t: moved.append(tuple(t.shape)) or torch.empty_like(t)
    )
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    engine = _Engine()
    engine.module = torch.nn.Sequential(
        torch.nn.Linear(4, 3, device="meta"), torch.nn.Linear(3, 2, device="meta")
    )
    engine.module[0].requires_grad_(False)  # the "base" layer; the second one trains
    frozen = [engine.module[0].weight, engine.module[0].bias]
    off = ActorOffload(engine, None, 2, torch.device("meta"))
    off.offload()
    assert (3, 4) not in moved  # the sync still reads them
    moved.clear()
    off.offload_weights()
    off.offload_weights()  # idempotent
    assert moved == [(3, 4), (3,)]  # the frozen ones only: the trainable one is DeepSpeed's lp_params
    off.reload()
    assert frozen[0] is engine.module[0].weight and frozen[1] is engine.module[0].bias
    assert [p.device.type for p in frozen] == ["meta", "meta"] and off._frozen == []
