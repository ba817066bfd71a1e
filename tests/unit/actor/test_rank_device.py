"""An actor rank's device and precision against its plan (``bandpo.actor.rank_device``), its report, and how
the group turns a rank's mismatch into one line (``bandpo.actor.group``). Pure functions, and one real
``Actor`` that stops before it builds anything."""

from __future__ import annotations

import pytest
import torch

from bandpo.actor.group import device_error_line, report_lines
from bandpo.actor.rank_device import check_rank_device, check_rank_precision, weight_dtype
from bandpo.errors import RankDeviceError

NODE = "node 10.0.0.7 (host gpu-b)"


@pytest.mark.parametrize(
    "expected,accelerator,gpus,problem",
    [
        ("cuda", "cpu", 8, "DeepSpeed's accelerator is cpu"),  # DS_ACCELERATOR=cpu from a CPU head
        ("cuda", "cuda", 0, "torch sees no CUDA device"),
        ("cpu", "cuda", 8, "DeepSpeed's accelerator is cuda"),
    ],
)
def test_a_rank_off_its_plans_device_is_one_line_naming_its_node(expected, accelerator, gpus, problem):
    with pytest.raises(RankDeviceError) as e:
        check_rank_device(3, expected, accelerator, gpus, NODE)
    msg = str(e.value)
    assert msg.startswith(f"actor rank 3 on {NODE}: the plan puts it on {expected} but {problem}"), msg
    assert "\n" not in msg


def test_a_rank_on_its_plans_device_passes():
    check_rank_device(0, "cuda", "cuda", 1, NODE)
    check_rank_device(0, "cpu", "cpu", 0, NODE)
    check_rank_device(0, None, "cpu", 0, NODE)  # no plan (an actor built in-process): nothing to check


def test_precision_off_the_plan_is_one_line():
    check_rank_precision(1, True, torch.bfloat16, torch.bfloat16, NODE)
    check_rank_precision(1, False, torch.float32, torch.float32, NODE)
    with pytest.raises(RankDeviceError) as e:
        check_rank_precision(1, True, torch.float32, torch.float32, NODE)
    assert str(e.value) == (
        f"actor rank 1 on {NODE}: the plan trains in bfloat16 but DeepSpeed computes in float32 "
        "and most weights are float32"
    )
    with pytest.raises(RankDeviceError):
        check_rank_precision(1, True, torch.bfloat16, torch.float32, NODE)


def test_weight_dtype_counts_elements_and_zero3_partitions_by_full_size():
    m = torch.nn.Sequential(torch.nn.Linear(8, 8).bfloat16(), torch.nn.Linear(2, 2))  # 72 bf16, 6 fp32
    assert weight_dtype(m) == torch.bfloat16
    # ZeRO-3: the parameter is empty, its partition (ds_tensor) holds the dtype, ds_numel the full size
    big = torch.nn.Linear(1, 1, bias=False)
    big.weight.ds_tensor, big.weight.ds_numel = torch.zeros(1, dtype=torch.float16), 1000
    assert weight_dtype(torch.nn.Sequential(m, big)) == torch.float16


def test_the_group_finds_the_ranks_line_in_rays_error_and_reports_per_node():
    ray_text = (
        "The actor died because of an error raised in its creation task, ray::Actor.__init__()\n"
        '  File "bandpo/actor/rank_device.py", line 50, in check_rank_device\n'
        f"bandpo.errors.RankDeviceError: actor rank 3 on {NODE}: the plan puts it on cuda but x"
    )
    assert device_error_line(ray_text) == f"actor rank 3 on {NODE}: the plan puts it on cuda but x"
    assert device_error_line("ray.exceptions.ActorDiedError: out of memory") is None
    rep = dict(accelerator="cuda", precision="computes in bfloat16, weights bfloat16")
    reports = [
        {"rank": 0, "node": "node a", "device": "cuda:0", **rep},
        {"rank": 1, "node": "node a", "device": "cuda:1", **rep},
        {"rank": 2, "node": "node b", "device": "cuda:0", **rep},
    ]
    assert report_lines(reports) == [
        "[bandpo] actor ranks 0,1 on node a: devices cuda:0,cuda:1; DeepSpeed accelerator cuda, "
        "computes in bfloat16, weights bfloat16",
        "[bandpo] actor ranks 2 on node b: devices cuda:0; DeepSpeed accelerator cuda, "
        "computes in bfloat16, weights bfloat16",
    ]


def test_a_real_actor_planned_on_cuda_stops_before_building_on_this_cpu():
    from bandpo.actor import Actor

    assert not torch.cuda.is_available()
    with pytest.raises(RankDeviceError, match=r"^actor rank 0 on .*: the plan puts it on cuda but"):
        Actor("/no/model", mini_batch_size=1, micro_batch_size=1, expected_device="cuda")
