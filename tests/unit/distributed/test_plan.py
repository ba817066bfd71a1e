"""The placement plan (pure python): layouts for the shipped models, and bad layouts naming keys."""

import json

import pytest

from bandpo.config import compose
from bandpo.distributed.__main__ import main as plan_main
from bandpo.distributed.plan import ClusterShape, decide_device, make_plan
from bandpo.errors import ConfigError


@pytest.mark.parametrize("model", ["qwen2.5-3b", "qwen2.5-7b", "llama3-8b"])
def test_colocated_pairs_share_gpus_and_engines_stay_on_a_node(model):
    cfg = compose([f"model={model}"])
    plan = make_plan(cfg, ClusterShape(1, 8), "cuda")
    actors = {w.rank: (w.node, w.gpu) for w in plan.of("actor")}
    shards = [(w.node, w.gpu) for w in plan.of("rollout")]
    assert sorted(actors.values()) == sorted(shards) == [(0, g) for g in range(8)]
    for e in {w.rank for w in plan.of("rollout")}:
        assert len({w.node for w in plan.engine_shards(e)}) == 1
        assert len(plan.engine_shards(e)) == plan.tp


def test_two_nodes_and_split():
    cfg = compose(["model=qwen2.5-7b", "actor.num_workers=16", "rollout.num_workers=8"])
    plan = make_plan(cfg, ClusterShape(2, 8), "cuda")
    assert [len(b) for b in plan.bundles] == [8, 8]
    cfg = compose(
        ["model=qwen2.5-7b", "actor.gpus=4", "rollout.gpus=4", "actor.num_workers=4", "rollout.num_workers=2"]
    )
    plan = make_plan(cfg, ClusterShape(1, 8), "cuda")
    assert {w.gpu for w in plan.of("actor")}.isdisjoint({w.gpu for w in plan.of("rollout")})


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model=qwen2.5-7b", "rollout.num_workers=3"], "rollout.num_workers x rollout.tensor_parallel_size"),
        (["model=qwen2.5-7b", "trainer.gpus_per_node=4"], "8 GPUs asked, 4 found"),
        (["model=qwen2.5-7b", "actor.gpus=4"], "actor.gpus and rollout.gpus"),
        (
            [
                "model=qwen2.5-7b",
                "rollout.tensor_parallel_size=8",
                "rollout.num_workers=1",
                "trainer.gpus_per_node=4",
                "trainer.nnodes=2",
            ],
            "rollout.tensor_parallel_size",
        ),
    ],
)
def test_bad_layouts_name_keys(overrides, key):
    with pytest.raises(ConfigError, match=key.replace("(", r"\(").replace("+", r"\+")):
        compose(overrides)


def test_auto_device_follows_the_gpu_count():
    assert decide_device("auto", 0) == "cpu" and decide_device("auto", 8) == "cuda"
    assert decide_device("cpu", 8) == "cpu" and decide_device("cuda", 0) == "cuda"


def test_command_prints_the_plan_and_exits_2_naming_the_key(capsys):
    assert plan_main(["--json", "--nodes", "1", "--gpus-per-node", "8", "model=qwen2.5-7b"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["layout"] == "colocated" and len(out["workers"]) == 8 + 8 + 1
    assert plan_main(["--gpus-per-node", "4", "model=qwen2.5-7b"]) == 2
    assert "8 GPUs asked, 4 found" in capsys.readouterr().err


@pytest.mark.parametrize(
    "assigned, visible, rank, count, index",
    [
        ([5], "5", 3, 1, 0),  # Ray narrowed the visible devices to the assigned GPU
        ([5], "4,5", 3, 2, 1),  # two GPUs visible (e.g. a 2-GPU worker): the assigned one's position
        (
            ["5"],
            None,
            3,
            8,
            5,
        ),  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: all visible, the id is the index
        ([], None, 11, 8, 3),  # no Ray GPU: a launcher showing all GPUs, rank % count
    ],
)
def test_local_gpu_index_is_the_gpu_ray_assigned(assigned, visible, rank, count, index):
    from bandpo.distributed import local_gpu_index

    assert local_gpu_index(assigned, visible, rank, count) == index


def test_local_gpu_index_refuses_an_assigned_gpu_it_cannot_see():
    from bandpo.distributed import local_gpu_index

    with pytest.raises(RuntimeError, match="assigned GPU 5"):
        local_gpu_index([5], "0,1", 0, 2)


def _workers(*gpus, nodes=None):
    nodes = nodes or ["n0"] * len(gpus)
    return [{"node": n, "ip": "10.0.0." + n[1:], "gpus": [g]} for n, g in zip(nodes, gpus)]


def test_vllm_ray_workers_compute_on_the_nodes_sorted_gpus_by_local_rank():
    from bandpo.distributed.check import vllm_worker_devices

    # Ray's GPU ids growing with the bundle order: every worker computes on its own GPU.
    assert vllm_worker_devices("RayExecutorV2", "n0", _workers(2, 3)) == [2, 3]
    # Not growing: rank 0 (bundle of GPU 5) takes sorted([5, 4])[0] = 4, its sibling's GPU.
    assert vllm_worker_devices("RayExecutorV2", "n0", _workers(5, 4)) == [4, 5]
    # Two nodes, the engine's driver on n1: V2 keeps creation order, the legacy executor puts n1's
    # workers first; local ranks count per node either way, so the devices agree here.
    two = _workers(1, 0, 7, 6, nodes=["n0", "n0", "n1", "n1"])
    assert vllm_worker_devices("RayExecutorV2", "n1", two) == [0, 1, 6, 7]
    assert vllm_worker_devices("RayDistributedExecutor", "n1", two) == [0, 1, 6, 7]


def test_check_models_the_executor_the_installed_vllm_picks(monkeypatch):
    from bandpo.distributed.check import vllm_ray_executor

    monkeypatch.delenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", raising=False)
    assert vllm_ray_executor() == "RayExecutorV2"  # vLLM 0.32's default
    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "0")
    assert vllm_ray_executor() == "RayDistributedExecutor"
