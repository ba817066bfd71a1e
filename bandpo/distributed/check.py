"""Check a ``Plan`` on a simulated Ray cluster: stand-ins placed with the real workers' options.

Every worker of the plan is started as a light stand-in with exactly the options
``bandpo.distributed.placement`` gives the real one (same placement groups, bundle indices,
GPU shares, env); a TP engine's stand-in reads ``VLLM_RAY_BUNDLE_INDICES`` /
``VLLM_RAY_PER_WORKER_GPUS`` and starts its shard stand-ins the way vLLM's Ray executor does
(``get_current_placement_group()``, ``num_cpus=0``, one per listed bundle). Each reports its
node id, ``ray.get_gpu_ids()`` and ``CUDA_VISIBLE_DEVICES``, then holds its seat until all have
reported, so the check sees the whole layout at once.

The stand-ins are Ray tasks, not actors: the scheduling options and hence the GPU each gets
are the same, but finished tasks leave their worker processes for the next plan, so one
simulated cluster checks many plans cheaply (an actor costs a fresh process each time).
"""

from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager

from bandpo.distributed.plan import Plan
from bandpo.errors import PlacementError

UNPLACED_TIMEOUT_S = 60.0


@contextmanager
def simulated_cluster(nodes: int, gpus_per_node: int, cpus_per_node: int):
    """A local Ray cluster of ``nodes`` x (``gpus_per_node`` fake GPUs, ``cpus_per_node`` CPUs)."""
    import ray

    if nodes <= 1:
        # address="local": a new instance, never another Ray already running on this machine.
        ray.init(address="local", num_cpus=cpus_per_node, num_gpus=gpus_per_node, include_dashboard=False,
                 log_to_driver=False)
        try:
            yield
        finally:
            ray.shutdown()
        return
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": cpus_per_node, "num_gpus": gpus_per_node,
                                      "include_dashboard": False})
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=cpus_per_node, num_gpus=gpus_per_node)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield
    finally:
        ray.shutdown()
        cluster.shutdown()


def cpus_needed(plan: Plan) -> int:
    """CPUs per simulated node: the largest node's bundles plus its share of verifier actors, + 1 spare."""
    bundle_cpus = max((sum(b["CPU"] for b in node) for node in plan.bundles), default=0)
    cpu_only = len(plan.of("actor")) + len(plan.of("rollout")) if plan.layout == "cpu" else 0
    verifiers = math.ceil(len(plan.of("verifier")) / max(plan.nodes, 1)) * plan.verifier_cpus
    return int(bundle_cpus + cpu_only + verifiers + 1)


def _gate_cls():
    import asyncio

    import ray

    @ray.remote(num_cpus=0)
    class Gate:
        def __init__(self):
            self.reports, self.open = [], asyncio.Event()

        async def report(self, info):
            self.reports.append(info)

        async def hold(self):
            await self.open.wait()

        async def release(self):
            self.open.set()

        async def get(self):
            return list(self.reports)

    return Gate


def _seen(group: str, rank: int, shard: int) -> dict:
    import ray

    return {"group": group, "rank": rank, "shard": shard, "node": ray.get_runtime_context().get_node_id(),
            "gpus": [int(g) for g in ray.get_gpu_ids()], "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def _stand_in(gate, group: str, rank: int, env: dict | None = None) -> None:
    """A worker's seat: report, start vLLM-style TP shards if the env asks for them, hold until released."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    os.environ.update(env or {})  # as RolloutWorker does before building the engine
    bundles = os.environ.get("VLLM_RAY_BUNDLE_INDICES", "") if group == "rollout" else ""
    if not bundles:
        ray.get(gate.report.remote(_seen(group, rank, 0)))
        ray.get(gate.hold.remote())
        return
    # What vLLM's RayDistributedExecutor does with these two variables (v1/executor/ray_executor.py).
    pg = ray.util.get_current_placement_group()
    per_worker = float(os.environ.get("VLLM_RAY_PER_WORKER_GPUS", "1.0"))
    shard = ray.remote(_shard)
    refs = [shard.options(num_cpus=0, num_gpus=per_worker, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_capture_child_tasks=True, placement_group_bundle_index=int(b)))
        .remote(gate, rank, s) for s, b in enumerate(bundles.split(","))]
    ray.get(refs)


def _shard(gate, engine: int, shard: int) -> None:
    import ray

    ray.get(gate.report.remote(_seen("rollout", engine, shard)))
    ray.get(gate.hold.remote())


def check_plan(plan: Plan, cpus_per_node: int | None = None, reuse: bool = False) -> dict:
    """Place ``plan`` on a simulated cluster of its shape (or, with ``reuse``, the running one); the report.

    Returns ``{"workers": [...], "ok": bool, "errors": [...], "seconds": float}``; each worker as
    seen: group, rank, shard, node id, GPU ids, CUDA_VISIBLE_DEVICES.
    """
    if reuse:
        return _place(plan)
    with simulated_cluster(plan.nodes, plan.gpus_per_node, cpus_per_node or cpus_needed(plan)):
        return _place(plan)


def _place(plan: Plan) -> dict:
    import ray

    from bandpo.distributed.placement import (
        actor_options,
        create_placement_groups,
        engine_launch,
        remove_placement_groups,
        verifier_options,
    )

    t0 = time.monotonic()
    gpu = plan.layout != "cpu"
    try:
        pgs = create_placement_groups(plan, UNPLACED_TIMEOUT_S) if gpu else []
    except PlacementError as e:
        return {"workers": [], "ok": False, "errors": [str(e)], "seconds": time.monotonic() - t0}
    gate = _gate_cls().remote()
    fn = ray.remote(_stand_in)
    refs = []
    for r in range(len(plan.of("actor"))):
        opts = actor_options(plan, pgs, r) if gpu else {"num_cpus": 1}
        refs.append(fn.options(**opts).remote(gate, "actor", r))
    engines = sorted({w.rank for w in plan.of("rollout")})
    for e in engines:
        opts, env = engine_launch(plan, pgs, e) if gpu else ({"num_cpus": 1}, {})
        refs.append(fn.options(**opts).remote(gate, "rollout", e, env))
    for i in range(len(plan.of("verifier"))):
        refs.append(fn.options(**verifier_options(plan, i)).remote(gate, "verifier", i))
    expected = len(plan.workers)
    deadline = time.monotonic() + UNPLACED_TIMEOUT_S
    seen = ray.get(gate.get.remote())
    while len(seen) < expected and time.monotonic() < deadline:
        time.sleep(0.2)
        seen = ray.get(gate.get.remote())
    ray.get(gate.release.remote())
    errors = []
    if len(seen) < expected:
        errors.append(f"{expected - len(seen)} of {expected} workers not placed within {UNPLACED_TIMEOUT_S:.0f} s")
        for ref in refs:
            ray.cancel(ref, force=True)
    else:
        ray.get(refs)
    remove_placement_groups(pgs)
    ray.kill(gate)
    seen.sort(key=lambda w: (w["group"], w["rank"], w["shard"]))
    errors += invariant_errors(plan, seen)
    return {"workers": seen, "ok": not errors, "errors": errors, "seconds": time.monotonic() - t0}


def invariant_errors(plan: Plan, seen: list[dict]) -> list[str]:
    """Each actor rank on its own GPU; an engine's T shards on T distinct GPUs of one node; colocated pairs share."""
    errors = []
    if plan.layout == "cpu":
        return [f"{w['group']} {w['rank']} holds GPUs {w['gpus']} in the CPU layout" for w in seen if w["gpus"]]
    actors = {w["rank"]: w for w in seen if w["group"] == "actor"}
    shards = {(w["rank"], w["shard"]): w for w in seen if w["group"] == "rollout"}

    def seat(w):
        return (w["node"], w["gpus"][0]) if len(w["gpus"]) == 1 else None

    for w in [*actors.values(), *shards.values()]:
        if len(w["gpus"]) != 1:
            errors.append(f"{w['group']} {w['rank']}/{w['shard']} sees GPUs {w['gpus']}, expected exactly one")
    taken: dict = {}
    for r, w in actors.items():
        if seat(w) and seat(w) in taken:
            errors.append(f"actor ranks {taken[seat(w)]} and {r} share GPU {seat(w)[1]} of node {w['node'][:12]}")
        taken[seat(w)] = r
    for e in sorted({k[0] for k in shards}):
        ws = [shards[k] for k in sorted(shards) if k[0] == e]
        if len(ws) != plan.tp or len({w["node"] for w in ws}) != 1 or len({seat(w) for w in ws}) != plan.tp:
            errors.append(f"engine {e}: shards on {[(w['node'][:12], w['gpus']) for w in ws]}, expected "
                          f"{plan.tp} distinct GPUs of one node")
    planned = {(p.group, p.rank, p.shard): (p.node, p.gpu) for p in plan.workers if p.gpu is not None}
    by_slot: dict = {}
    for key, w in [*((("actor", r, 0), w) for r, w in actors.items()), *((("rollout", *k), w) for k, w in shards.items())]:
        by_slot.setdefault(planned.get(key), []).append((key, seat(w)))
    for slot, members in by_slot.items():
        seats = {s for _, s in members}
        if plan.layout == "colocated" and len(seats) != 1:
            errors.append(f"colocated pair at planned slot {slot} landed on different GPUs: {members}")
        if plan.layout == "split" and len(members) > 1:
            errors.append(f"split layout: {members} share planned slot {slot}")
    if plan.layout == "split":
        a = {seat(w) for w in actors.values()}
        r = {seat(w) for w in shards.values()}
        if a & r:
            errors.append(f"split layout: actor and rollout share GPUs {sorted(a & r)}")
    return errors
