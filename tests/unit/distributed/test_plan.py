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
    cfg = compose(["model=qwen2.5-7b", "actor.gpus=4", "rollout.gpus=4", "actor.num_workers=4",
                   "rollout.num_workers=2"])
    plan = make_plan(cfg, ClusterShape(1, 8), "cuda")
    assert {w.gpu for w in plan.of("actor")}.isdisjoint({w.gpu for w in plan.of("rollout")})


@pytest.mark.parametrize("overrides, key", [
    (["model=qwen2.5-7b", "rollout.num_workers=3"], "rollout.num_workers x rollout.tensor_parallel_size"),
    (["model=qwen2.5-7b", "trainer.gpus_per_node=4"], "8 GPUs asked, 4 found"),
    (["model=qwen2.5-7b", "actor.gpus=4"], "actor.gpus and rollout.gpus"),
    (["model=qwen2.5-7b", "rollout.tensor_parallel_size=8", "rollout.num_workers=1", "trainer.gpus_per_node=4",
      "trainer.nnodes=2"], "rollout.tensor_parallel_size"),
])
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


@pytest.mark.parametrize("assigned, visible, rank, count, index", [
    ([5], "5", 3, 1, 0),  # Ray narrowed the visible devices to the assigned GPU
    ([5], "4,5", 3, 2, 1),  # two GPUs visible (e.g. a 2-GPU worker): the assigned one's position
    (["5"], None, 3, 8, 5),  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: all visible, the id is the index
    ([], None, 11, 8, 3),  # no Ray GPU: a launcher showing all GPUs, rank % count
])
def test_local_gpu_index_is_the_gpu_ray_assigned(assigned, visible, rank, count, index):
    from bandpo.distributed import local_gpu_index

    assert local_gpu_index(assigned, visible, rank, count) == index


def test_local_gpu_index_refuses_an_assigned_gpu_it_cannot_see():
    from bandpo.distributed import local_gpu_index

    with pytest.raises(RuntimeError, match="assigned GPU 5"):
        local_gpu_index([5], "0,1", 0, 2)
