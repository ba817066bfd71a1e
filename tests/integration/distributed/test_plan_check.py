"""Every shipped model's plan placed on simulated Ray clusters (fake GPUs) with the real workers' options.

One simulated cluster per shape (``check_plan(reuse=True)`` places several plans on it): 1x8 for
the shipped models (qwen2.5-7b with TP=2 engines; llama3-8b's plans are the same plans, asserted below,
so placing it again would check nothing new) and a split layout; 2x8 through ``ray.cluster_utils.Cluster``. (A 1x4 node goes through the same placement code as 1x8;
its own cluster cost CI ~25 s and is not simulated.) Every invariant of ``bandpo.distributed.check``
must hold: each actor rank alone on its GPU, an engine's shards on distinct GPUs of one node, colocated
pairs on the same GPU (the GPU each process computes on: vLLM's Ray workers pick theirs by local
rank), split groups on disjoint GPUs, nothing unplaced.
"""

import pytest

from bandpo.config import compose
from bandpo.distributed.check import check_plan, cpus_needed, simulated_cluster, vllm_ray_executor
from bandpo.distributed.plan import ClusterShape, make_plan

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600), pytest.mark.slow]

SPLIT_7B = [
    "model=qwen2.5-7b",
    "actor.gpus=4",
    "rollout.gpus=4",
    "actor.num_workers=4",
    "rollout.num_workers=2",
]
SHAPES = {
    (1, 8): [["model=qwen2.5-3b"], ["model=qwen2.5-7b"], SPLIT_7B],
    (2, 8): [["model=qwen2.5-7b", "actor.num_workers=16", "rollout.num_workers=8"]],
}


def _check_on(nodes, gpus, overrides_list):
    plans = [make_plan(compose(o), ClusterShape(nodes, gpus), "cuda") for o in overrides_list]
    with simulated_cluster(nodes, gpus, max(cpus_needed(p) for p in plans)):
        return [check_plan(p, reuse=True) for p in plans], plans


def test_llama3_8b_plans_are_the_qwen7b_plans_placed_below():
    """Same TP, worker counts and bundles: the placement checks of qwen2.5-7b hold for llama3-8b."""
    for (nodes, gpus), overrides_list in SHAPES.items():
        for overrides in (o for o in overrides_list if "model=qwen2.5-7b" in o):
            llama = [("model=llama3-8b" if o == "model=qwen2.5-7b" else o) for o in overrides]
            qwen_plan, llama_plan = (
                make_plan(compose(o), ClusterShape(nodes, gpus), "cuda") for o in (overrides, llama)
            )
            assert llama_plan == qwen_plan, (nodes, gpus, overrides)


@pytest.mark.parametrize("shape", list(SHAPES), ids=lambda s: f"{s[0]}x{s[1]}")
def test_plans_hold_on_simulated_cluster(shape):
    nodes, gpus = shape
    reports, plans = _check_on(nodes, gpus, SHAPES[shape])
    for overrides, plan, report in zip(SHAPES[shape], plans, reports):
        assert report["ok"], (overrides, report["errors"])
        placed = [w for w in report["workers"] if w["group"] in ("actor", "rollout")]
        assert len(placed) == len([w for w in plan.workers if w.group in ("actor", "rollout")]), overrides
        used = {(w["node"], w["gpus"][0]) for w in placed}
        assert len({w["node"] for w in placed}) == nodes, overrides  # every node holds workers
        # colocated: every GPU of the cluster is used; split: actor.gpus + rollout.gpus of them
        assert len(used) == (nodes * gpus if plan.layout == "colocated" else 8), overrides
        if plan.tp > 1:
            shards = [w for w in placed if w["group"] == "rollout"]
            assert {w["shard"] for w in shards} == set(range(plan.tp)), overrides
            # vLLM's Ray workers keep every GPU visible and compute on the GPU vLLM picks by local rank
            assert report["executor"] == vllm_ray_executor(), overrides
            assert all(w["cuda_visible_devices"] is None and w["device"] is not None for w in shards), (
                overrides
            )
