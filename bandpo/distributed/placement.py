"""A ``Plan`` turned into Ray placement groups and the exact ``.options(...)`` of every worker.

The trainer and ``bandpo.distributed.check`` both take their scheduling options from here,
so what the simulated check places is what a real run places.

Engines (as OpenRLHF / verl start vLLM in a hybrid engine):
- TP = 1: the engine actor itself holds its share of bundle i's GPU.
- TP = T > 1: the engine actor holds no GPU; it sits in bundle i with
  ``placement_group_capture_child_tasks=True`` and builds ``vllm.LLM`` with
  ``distributed_executor_backend="ray"``; vLLM's Ray executor then finds the placement group
  (``ray.util.get_current_placement_group``) and starts its T workers in the bundles listed in
  ``VLLM_RAY_BUNDLE_INDICES`` = i..i+T-1, each asking ``VLLM_RAY_PER_WORKER_GPUS`` of a GPU.
"""

from __future__ import annotations

from typing import Any

from bandpo.distributed.plan import ACTOR_GPU_SHARE, ENGINE_GPU_SHARE, Plan
from bandpo.errors import PlacementError


def create_placement_groups(plan: Plan, timeout_s: float = 60.0) -> list:
    """One STRICT_PACK group per node of the plan; raises ``PlacementError`` if not placed within ``timeout_s``."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pgs = [
        placement_group(bundles, strategy="STRICT_PACK", name=f"bandpo-node{n}")
        for n, bundles in enumerate(plan.bundles)
    ]
    ready, pending = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=timeout_s)
    if pending:
        for pg in pgs:
            remove_placement_group(pg)
        res = ray.cluster_resources()
        raise PlacementError(
            f"{len(pending)} of {len(pgs)} node placement groups (bundles {plan.bundles[0][0]} x "
            f"{[len(b) for b in plan.bundles]}) not placed within {timeout_s:.0f} s; the cluster has "
            f"{res.get('GPU', 0):.0f} GPUs and {res.get('CPU', 0):.0f} CPUs in "
            f"{len([n for n in ray.nodes() if n.get('Alive')])} node(s)"
        )
    return pgs


def _strategy(pg, bundle: int, capture: bool = False):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=bundle, placement_group_capture_child_tasks=capture
    )


def actor_options(plan: Plan, pgs: list, rank: int) -> dict[str, Any]:
    """Ray options of actor rank ``rank``."""
    w = plan.of("actor")[rank]
    gpus = ACTOR_GPU_SHARE if plan.layout == "colocated" else 1.0
    return {"num_cpus": 1, "num_gpus": gpus, "scheduling_strategy": _strategy(pgs[w.node], w.gpu)}


def engine_gpu_share(plan: Plan) -> float:
    return ENGINE_GPU_SHARE if plan.layout == "colocated" else 1.0


def engine_launch(plan: Plan, pgs: list, engine: int) -> tuple[dict[str, Any], dict[str, str]]:
    """``(ray options, env vars)`` for rollout engine ``engine``.

    TP > 1: the engine builds vLLM with its Ray executor (``distributed_executor_backend="ray"``,
    set by ``bandpo.parts.rollout_engine_kwargs``), which reads the env vars.
    """
    shards = plan.engine_shards(engine)
    first = shards[0]
    share = engine_gpu_share(plan)
    if plan.tp == 1:
        return {
            "num_cpus": 1,
            "num_gpus": share,
            "scheduling_strategy": _strategy(pgs[first.node], first.gpu),
        }, {}
    env = {
        "VLLM_RAY_BUNDLE_INDICES": ",".join(str(s.gpu) for s in shards),
        "VLLM_RAY_PER_WORKER_GPUS": str(share),
    }
    opts = {
        "num_cpus": 1,
        "num_gpus": 0,
        "scheduling_strategy": _strategy(pgs[first.node], first.gpu, capture=True),
    }
    return opts, env


def verifier_options(plan: Plan, index: int) -> dict[str, Any]:
    """Ray options of verifier actor ``index``: CPU only, spread over the nodes."""
    return {"num_cpus": plan.verifier_cpus, "num_gpus": 0, "scheduling_strategy": "SPREAD"}


def remove_placement_groups(pgs: list) -> None:
    from ray.util.placement_group import remove_placement_group

    for pg in pgs:
        remove_placement_group(pg)
