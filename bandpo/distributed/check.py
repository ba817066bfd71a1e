"""Check a ``Plan`` on a simulated Ray cluster: stand-ins placed with the real workers' options.

Every worker of the plan is started as a light stand-in with exactly the options
``bandpo.distributed.placement`` gives the real one (same placement groups, bundle indices,
GPU shares, env). A TP engine's stand-in reads ``VLLM_RAY_BUNDLE_INDICES`` /
``VLLM_RAY_PER_WORKER_GPUS`` and starts its shard stand-ins the way the installed vLLM's Ray
executor does (``vllm_ray_executor``: ``RayExecutorV2`` unless ``VLLM_USE_RAY_V2_EXECUTOR_BACKEND``
says otherwise, read from ``vllm.envs``): one worker per listed bundle of the current placement
group, ``num_cpus=0``, with ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` so Ray leaves every
GPU of the node visible. Such a worker computes on the GPU vLLM picks by local rank
(``vllm_worker_devices``), which is the one Ray assigned to it only when Ray's GPU ids grow with
the bundle order; the check reports both and holds the invariants (colocated pairs, distinct
shards) on the GPU actually used. Each stand-in
reports its node id, ``ray.get_gpu_ids()`` and ``CUDA_VISIBLE_DEVICES``, then holds its seat
until all have reported, so the check sees the whole layout at once.

The stand-ins are Ray tasks, not actors: the scheduling options and hence the GPU each gets
are the same, but finished tasks leave their worker processes for the next plan, so one
simulated cluster checks many plans cheaply (an actor costs a fresh process each time).
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter, defaultdict
from contextlib import contextmanager

from bandpo.distributed.plan import Plan
from bandpo.errors import PlacementError

# Only a plan that cannot be placed waits this long; a placeable one is done once its workers have
# started. Dozens of Ray worker processes start in well over a minute on a loaded 2-core machine.
UNPLACED_TIMEOUT_S = 180.0
# vLLM's CUDA platform (vllm/platforms/cuda.py, ray_noset_device_env_vars): set in the runtime_env of
# its Ray workers by both Ray executors; a CPU build of vLLM cannot import that platform to read it.
NOSET_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def vllm_ray_executor() -> str:
    """The executor the installed vLLM builds for ``distributed_executor_backend="ray"``.

    Read from ``vllm.envs`` (the environment, else vLLM's default), as ``Executor.get_class``
    decides: ``RayExecutorV2`` when ``VLLM_USE_RAY_V2_EXECUTOR_BACKEND`` is on, else
    ``RayDistributedExecutor`` (also for a vLLM that predates the switch); ``unknown`` without vLLM.
    """
    try:
        import vllm.envs as envs
    except ImportError:
        return "unknown"
    return (
        "RayExecutorV2"
        if getattr(envs, "VLLM_USE_RAY_V2_EXECUTOR_BACKEND", False)
        else "RayDistributedExecutor"
    )


def vllm_worker_devices(executor: str, driver_node: str, workers: list[dict]) -> list[int]:
    """The GPU each of one engine's Ray workers computes on, as vLLM's Ray executors choose it.

    ``workers``: in creation order (= ``VLLM_RAY_BUNDLE_INDICES`` order), each with ``node``,
    ``ip`` and ``gpus`` (its Ray-assigned GPU ids). Both executors keep every GPU of the node
    visible (``NOSET_ENV``), rank the workers, give each the local rank = its position among
    its node's workers in rank order, and compute on ``sorted(GPU ids of the node's workers)
    [local_rank]``. ``RayExecutorV2`` ranks in creation order; ``RayDistributedExecutor`` first
    re-ranks: the driver's node first, then nodes with fewer workers, then by IP. So a worker
    uses the GPU Ray gave it only when Ray's GPU ids grow with the bundle order.
    """
    order = list(range(len(workers)))  # order[rank] = creation index
    if executor == "RayDistributedExecutor":
        per_ip = Counter(w["ip"] for w in workers)
        order.sort(
            key=lambda i: (workers[i]["node"] != driver_node, per_ip[workers[i]["ip"]], workers[i]["ip"])
        )
    ranks_on: dict = defaultdict(list)
    ids_on: dict = defaultdict(list)
    for i in order:
        ranks_on[workers[i]["node"]].append(i)
        ids_on[workers[i]["node"]] += [int(g) for g in workers[i]["gpus"]]
    devices = [-1] * len(workers)
    for node, created in ranks_on.items():
        ids = sorted(ids_on[node])
        for local_rank, i in enumerate(created):
            devices[i] = ids[local_rank]
    return devices


@contextmanager
def simulated_cluster(nodes: int, gpus_per_node: int, cpus_per_node: int):
    """A local Ray cluster of ``nodes`` x (``gpus_per_node`` fake GPUs, ``cpus_per_node`` CPUs)."""
    import ray

    if nodes <= 1:
        # address="local": a new instance, never another Ray already running on this machine.
        ray.init(
            address="local",
            num_cpus=cpus_per_node,
            num_gpus=gpus_per_node,
            include_dashboard=False,
            log_to_driver=False,
        )
        try:
            yield
        finally:
            ray.shutdown()
        return
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": cpus_per_node, "num_gpus": gpus_per_node, "include_dashboard": False},
    )
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

    gpus = [int(g) for g in ray.get_gpu_ids()]
    # A worker whose CUDA_VISIBLE_DEVICES Ray narrowed computes on its one GPU (bandpo.actor's
    # local_gpu_index, vLLM's uni-process executor at TP = 1); vLLM's Ray workers are set later.
    return {
        "group": group,
        "rank": rank,
        "shard": shard,
        "node": ray.get_runtime_context().get_node_id(),
        "ip": ray.util.get_node_ip_address(),
        "gpus": gpus,
        "device": gpus[0] if len(gpus) == 1 else None,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def _stand_in(gate, group: str, rank: int, env: dict | None = None, executor: str = "RayExecutorV2") -> None:
    """A worker's seat: report, start vLLM-style TP shards if the env asks for them, hold until released."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    os.environ.update(env or {})  # as RolloutWorker does before building the engine
    bundles = os.environ.get("VLLM_RAY_BUNDLE_INDICES", "") if group == "rollout" else ""
    if not bundles:
        ray.get(gate.report.remote(_seen(group, rank, 0)))
        ray.get(gate.hold.remote())
        return
    # What the installed vLLM's Ray executor does with these two variables (v1/executor/ray_executor*.py):
    # both put one worker in each listed bundle of the current group; only the legacy one captures child tasks.
    pg = ray.util.get_current_placement_group()
    per_worker = float(os.environ.get("VLLM_RAY_PER_WORKER_GPUS", "1.0"))
    driver_node = ray.get_runtime_context().get_node_id()
    shard = ray.remote(_shard)
    refs = [
        shard.options(
            num_cpus=0,
            num_gpus=per_worker,
            runtime_env={"env_vars": {NOSET_ENV: "1"}},
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg,
                placement_group_bundle_index=int(b),
                placement_group_capture_child_tasks=executor == "RayDistributedExecutor",
            ),
        ).remote(gate, rank, s, driver_node)
        for s, b in enumerate(bundles.split(","))
    ]
    ray.get(refs)


def _shard(gate, engine: int, shard: int, driver_node: str) -> None:
    import ray

    ray.get(gate.report.remote({**_seen("rollout", engine, shard), "driver_node": driver_node}))
    ray.get(gate.hold.remote())


def check_plan(plan: Plan, cpus_per_node: int | None = None, reuse: bool = False) -> dict:
    """Place ``plan`` on a simulated cluster of its shape (or, with ``reuse``, the running one); the report.

    Returns ``{"workers": [...], "ok": bool, "errors": [...], "seconds": float, "executor": str}``;
    each worker as seen: group, rank, shard, node id, GPU ids Ray assigned, ``device`` (the GPU
    it computes on), CUDA_VISIBLE_DEVICES; ``executor``: vLLM's Ray executor that was modelled.
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
    executor = (
        vllm_ray_executor() if gpu and plan.tp > 1 else "none (TP = 1: vLLM's executor runs in the engine)"
    )
    try:
        pgs = create_placement_groups(plan, UNPLACED_TIMEOUT_S) if gpu else []
    except PlacementError as e:
        return {
            "workers": [],
            "ok": False,
            "errors": [str(e)],
            "seconds": time.monotonic() - t0,
            "executor": executor,
        }
    gate = _gate_cls().remote()
    fn = ray.remote(_stand_in)
    refs = []
    for r in range(len(plan.of("actor"))):
        opts = actor_options(plan, pgs, r) if gpu else {"num_cpus": 1}
        refs.append(fn.options(**opts).remote(gate, "actor", r))
    engines = sorted({w.rank for w in plan.of("rollout")})
    for e in engines:
        opts, env = engine_launch(plan, pgs, e) if gpu else ({"num_cpus": 1}, {})
        refs.append(fn.options(**opts).remote(gate, "rollout", e, env, executor))
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
        errors.append(
            f"{expected - len(seen)} of {expected} workers not placed within {UNPLACED_TIMEOUT_S:.0f} s"
        )
        for ref in refs:
            ray.cancel(ref, force=True)
    else:
        ray.get(refs)
    remove_placement_groups(pgs)
    ray.kill(gate)
    seen.sort(key=lambda w: (w["group"], w["rank"], w["shard"]))
    for e in {w["rank"] for w in seen if "driver_node" in w}:
        shards = [w for w in seen if w["group"] == "rollout" and w["rank"] == e]
        for w, device in zip(shards, vllm_worker_devices(executor, shards[0]["driver_node"], shards)):
            w["device"] = device
    errors += invariant_errors(plan, seen)
    return {
        "workers": seen,
        "ok": not errors,
        "errors": errors,
        "seconds": time.monotonic() - t0,
        "executor": executor,
    }


def invariant_errors(plan: Plan, seen: list[dict]) -> list[str]:
    """Each actor rank on its own GPU; an engine's T shards on T distinct GPUs of one node; colocated pairs share.

    A worker's GPU is the one it computes on (``device``), not only the one Ray assigned.
    """
    errors = []
    if plan.layout == "cpu":
        return [
            f"{w['group']} {w['rank']} holds GPUs {w['gpus']} in the CPU layout" for w in seen if w["gpus"]
        ]
    actors = {w["rank"]: w for w in seen if w["group"] == "actor"}
    shards = {(w["rank"], w["shard"]): w for w in seen if w["group"] == "rollout"}

    def seat(w):
        return (w["node"], w["device"]) if len(w["gpus"]) == 1 and w.get("device") is not None else None

    for w in [*actors.values(), *shards.values()]:
        if len(w["gpus"]) != 1:
            errors.append(
                f"{w['group']} {w['rank']}/{w['shard']} sees GPUs {w['gpus']}, expected exactly one"
            )
    taken: dict = {}
    for r, w in actors.items():
        if seat(w) and seat(w) in taken:
            errors.append(
                f"actor ranks {taken[seat(w)]} and {r} share GPU {seat(w)[1]} of node {w['node'][:12]}"
            )
        taken[seat(w)] = r
    for e in sorted({k[0] for k in shards}):
        ws = [shards[k] for k in sorted(shards) if k[0] == e]
        if len(ws) != plan.tp or len({w["node"] for w in ws}) != 1 or len({seat(w) for w in ws}) != plan.tp:
            errors.append(
                f"engine {e}: shards on {[(w['node'][:12], w['gpus']) for w in ws]}, expected "
                f"{plan.tp} distinct GPUs of one node"
            )
    planned = {(p.group, p.rank, p.shard): (p.node, p.gpu) for p in plan.workers if p.gpu is not None}
    by_slot: dict = {}
    for key, w in [
        *((("actor", r, 0), w) for r, w in actors.items()),
        *((("rollout", *k), w) for k, w in shards.items()),
    ]:
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
