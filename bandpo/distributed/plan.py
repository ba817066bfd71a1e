"""The placement plan: which GPU of which node every worker gets, computed once from the config.

Pure python (no Ray import), so it can be printed, checked and tested before anything starts::

    python -m bandpo.distributed [--nodes N --gpus-per-node G] [--check] [--json] OVERRIDES...

(the command is ``bandpo.distributed.__main__``; this module takes a composed config and
never composes one itself).

Layouts (``layout_of``):
- ``colocated`` (GPU default): one bundle per GPU ``{GPU: 1, CPU: 2}``; actor rank i and
  rollout-engine shard i share bundle i (Ray splits the bundle's GPU between them, so both
  see the same device). An engine with tensor_parallel_size=T spans T consecutive bundles of
  one node. vLLM sleeps (level 1) while the actor computes logprobs and updates.
- ``split``: ``actor.gpus`` and ``rollout.gpus`` set: the actor ranks take the first
  ``actor.gpus`` GPUs, the engines the next ``rollout.gpus``; no sleep.
- ``cpu``: no placement groups beyond the actor's own (today's CPU behaviour).

Bundles live in one placement group per node (STRICT_PACK), as verl's resource pools do: a
single PACK group may scatter an engine's T bundles over two nodes; a per-node group cannot.
The verifier actors (``trainer.verifier_actors``, each ``trainer.verifier_workers`` CPUs) are
planned as CPU-only workers spread over the nodes.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bandpo.errors import ConfigError, check

if TYPE_CHECKING:
    from bandpo.config.schema import TrainConfig

# How a bundle's one GPU is shared in the colocated layout (Ray fractions; vLLM's own memory
# share is rollout.gpu_memory_utilization). The two add up to the bundle's 1 GPU.
ENGINE_GPU_SHARE = 0.5
ACTOR_GPU_SHARE = 0.5
CPUS_PER_COLOCATED_BUNDLE = 2  # the actor rank's process + the engine actor's process


@dataclass(frozen=True)
class Placement:
    """One worker's planned seat: ``gpu`` is the node-local GPU = bundle index in that node's group."""

    group: str  # "actor" | "rollout" | "verifier"
    rank: int  # actor rank, engine index, or verifier index
    shard: int  # TP shard within the engine (0 for actor / verifier)
    node: int
    gpu: int | None  # None: CPU-only worker

    @property
    def slot(self) -> int | None:
        return None if self.gpu is None else self.node * 10_000 + self.gpu


@dataclass
class Plan:
    layout: str  # "colocated" | "split" | "cpu"
    nodes: int
    gpus_per_node: int
    tp: int
    bundles: list[list[dict]]  # per node: the bundles of that node's placement group
    workers: list[Placement]
    verifier_cpus: int
    notes: list[str] = field(default_factory=list)

    def of(self, group: str) -> list[Placement]:
        return [w for w in self.workers if w.group == group]

    def engine_shards(self, engine: int) -> list[Placement]:
        return [w for w in self.workers if w.group == "rollout" and w.rank == engine]

    @property
    def sleeps(self) -> bool:
        """Colocated engines sleep during the actor's stages."""
        return self.layout == "colocated"


@dataclass(frozen=True)
class ClusterShape:
    nodes: int
    gpus_per_node: int
    cpus_per_node: int | None = None  # None: not known / not checked
    gpu_gib: float | None = None  # memory of one GPU; None: not known


def layout_of(cfg: TrainConfig, device: str) -> str:
    """``cpu`` on CPU; ``split`` when ``actor.gpus`` and ``rollout.gpus`` are set; else ``colocated``."""
    if device == "cpu":
        return "cpu"
    a, r = cfg.actor.gpus, cfg.rollout.gpus
    if (a is None) != (r is None):
        raise ConfigError(
            f"config error: actor.gpus and rollout.gpus go together (split layout), got "
            f"actor.gpus={a!r}, rollout.gpus={r!r}; leave both null for the colocated layout"
        )
    return "split" if a is not None else "colocated"


def make_plan(cfg: TrainConfig, shape: ClusterShape, device: str) -> Plan:
    """The plan for ``cfg`` on a cluster of ``shape``; ``ConfigError`` naming keys and numbers if it cannot fit."""
    layout = layout_of(cfg, device)
    ranks, engines = int(cfg.actor.num_workers), int(cfg.rollout.num_workers)
    tp = int(cfg.rollout.tensor_parallel_size or 1)
    G, N = shape.gpus_per_node, shape.nodes
    verifiers = cfg.trainer.verifier_actors
    verifiers = N if verifiers == "per_node" else int(verifiers or 0)  # per_node: one on every node
    # verifier_workers null: the pool takes its node's CPUs and the actor reserves one (bandpo.reward.ray_scorer)
    vcpus = int(cfg.trainer.verifier_workers or 1)
    verifier_seats = [Placement("verifier", i, 0, i % max(N, 1), None) for i in range(verifiers)]
    if layout == "cpu":
        workers = [Placement("actor", r, 0, 0, None) for r in range(ranks)]
        workers += [Placement("rollout", e, 0, 0, None) for e in range(engines)]
        return Plan("cpu", N, G, 1, [], workers + verifier_seats, vcpus)

    actor_gpus, rollout_gpus, rollout_offset = gpu_counts(cfg, layout)
    total = rollout_offset + rollout_gpus
    asked = (
        "actor.gpus + rollout.gpus"
        if layout == "split"
        else "actor.num_workers (= rollout.num_workers x rollout.tensor_parallel_size)"
    )
    check(
        G >= 1,
        "trainer.gpus_per_node",
        f"must be >= 1 for the {layout} GPU layout: {asked} = {total} GPUs "
        f"asked, 0 found (no GPU on this machine / cluster; trainer.device=cpu runs on CPU)",
        G,
    )
    check(
        tp <= G and G % tp == 0,
        "rollout.tensor_parallel_size",
        f"must divide the GPUs of a node (gpus_per_node={G}) so no engine spans two nodes",
        tp,
    )
    check(
        total <= N * G,
        asked,
        f"must fit in the cluster: {total} GPUs asked, {N * G} found "
        f"({N} node(s) x {G} GPUs; trainer.nnodes / trainer.gpus_per_node or --nodes / --gpus-per-node)",
        total,
    )

    def seat(g: int) -> tuple[int, int]:
        return divmod(g, G)

    workers = [Placement("actor", r, 0, *seat(r)) for r in range(ranks)]
    for e in range(engines):
        first = rollout_offset + e * tp
        nodes = {seat(first + s)[0] for s in range(tp)}
        check(
            len(nodes) == 1,
            "actor.gpus",
            f"must leave the engines' first GPU at a multiple of "
            f"rollout.tensor_parallel_size={tp} so engine {e} stays on one node",
            actor_gpus,
        )
        workers += [Placement("rollout", e, s, *seat(first + s)) for s in range(tp)]
    used = [0] * N
    for w in workers:
        used[w.node] = max(used[w.node], w.gpu + 1)
    cpus = CPUS_PER_COLOCATED_BUNDLE if layout == "colocated" else 1
    bundles = [[{"GPU": 1.0, "CPU": float(cpus)} for _ in range(u)] for u in used if u]
    notes = []
    if total < N * G:
        notes.append(
            f"{N * G - total} of {N * G} GPUs unused (raise actor.num_workers / rollout.num_workers "
            f"to use them)"
        )
    if shape.cpus_per_node is not None:
        need = max(len(b) for b in bundles) * cpus + math.ceil(verifiers / N) * vcpus
        check(
            need <= shape.cpus_per_node,
            "trainer.verifier_workers",
            f"leave room on a node of {shape.cpus_per_node} CPUs: its bundles and verifier actors need {need}",
            vcpus,
        )
    return Plan(layout, N, G, tp, bundles, workers + verifier_seats, vcpus, notes)


def gpu_counts(cfg: TrainConfig, layout: str) -> tuple[int, int, int]:
    """``(actor GPUs, rollout GPUs, first rollout GPU)`` of a GPU layout; ``ConfigError`` if the counts disagree."""
    ranks, engines = int(cfg.actor.num_workers), int(cfg.rollout.num_workers)
    tp = int(cfg.rollout.tensor_parallel_size or 1)
    if layout == "colocated":
        check(
            engines * tp == ranks,
            "rollout.num_workers x rollout.tensor_parallel_size",
            f"must equal actor.num_workers={ranks} in the colocated layout (one engine shard per actor GPU)",
            f"{engines} x {tp} = {engines * tp}",
        )
        return ranks, ranks, 0
    actor_gpus, rollout_gpus = int(cfg.actor.gpus), int(cfg.rollout.gpus)
    check(
        ranks == actor_gpus,
        "actor.num_workers",
        f"must equal actor.gpus={actor_gpus} (one GPU per rank)",
        ranks,
    )
    check(
        engines * tp == rollout_gpus,
        "rollout.num_workers x rollout.tensor_parallel_size",
        f"must equal rollout.gpus={rollout_gpus}",
        f"{engines} x {tp} = {engines * tp}",
    )
    return actor_gpus, rollout_gpus, actor_gpus


# ----------------------------------------------------------------------------- printing
def table(plan: Plan) -> str:
    """One line per GPU (node, GPU, actor rank, engine/TP shard), then the CPU-only workers."""
    lines = [
        f"layout: {plan.layout}   cluster: {plan.nodes} node(s) x {plan.gpus_per_node} GPU   "
        f"TP: {plan.tp}   placement groups: {len(plan.bundles)} (one per node, STRICT_PACK)"
    ]
    if plan.layout != "cpu":
        lines.append(f"{'node':>4} {'gpu':>3}  {'actor rank':<10}  {'engine/shard':<12}")
        seats = sorted({(w.node, w.gpu) for w in plan.workers if w.gpu is not None})
        for node, gpu in seats:
            a = [w for w in plan.of("actor") if (w.node, w.gpu) == (node, gpu)]
            r = [w for w in plan.of("rollout") if (w.node, w.gpu) == (node, gpu)]
            lines.append(
                f"{node:>4} {gpu:>3}  {(str(a[0].rank) if a else '-'):<10}  "
                f"{(f'{r[0].rank}/{r[0].shard}' if r else '-'):<12}"
            )
    else:
        lines.append(
            f"actor ranks: {len(plan.of('actor'))}   rollout engines: {len(plan.of('rollout'))} (CPU)"
        )
    v = plan.of("verifier")
    lines.append(f"verifier actors: {len(v)} x {plan.verifier_cpus} CPUs (CPU-only, spread over nodes)")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def planned_json(plan: Plan) -> list[dict]:
    return [
        {
            "group": w.group,
            "rank": w.rank,
            "shard": w.shard,
            "node": f"node{w.node}",
            "gpus": [] if w.gpu is None else [w.gpu],
        }
        for w in plan.workers
    ]


# ----------------------------------------------------------------------------- cluster shape
def shape_from_config(cfg: TrainConfig) -> ClusterShape | None:
    """``trainer.nnodes`` x ``trainer.gpus_per_node`` when the config gives them (verl-style)."""
    n, g = cfg.trainer.nnodes, cfg.trainer.gpus_per_node
    if n is None and g is None:
        return None
    return ClusterShape(int(n or 1), int(g or 0))


def detect_shape(address: str | None) -> ClusterShape:
    """The cluster this run would use: the Ray cluster at ``address`` / ``$RAY_ADDRESS``, else this machine."""
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        import ray

        ray.init(address=address, log_to_driver=False)
        try:
            nodes = [n for n in ray.nodes() if n.get("Alive")]
            gpus = [int(n["Resources"].get("GPU", 0)) for n in nodes]
            cpus = [int(n["Resources"].get("CPU", 0)) for n in nodes]
        finally:
            ray.shutdown()
        gpu_nodes = [g for g in gpus if g] or [0]
        return ClusterShape(len(gpu_nodes), min(gpu_nodes), min(cpus) if cpus else None)
    gib = None
    try:
        import torch

        g = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if g:
            gib = torch.cuda.get_device_properties(0).total_memory / (1 << 30)
    except Exception:  # a broken CUDA install counts as no GPU
        g = 0
    return ClusterShape(1, g, os.cpu_count(), gib)


def decide_device(requested: str, gpus: int) -> str:
    """What ``trainer.device=requested`` means with ``gpus`` GPUs: ``auto`` -> ``cuda`` if there are any, else ``cpu``.

    The one place ``auto`` is decided; each caller counts the GPUs its own way (the config's
    ``trainer.gpus_per_node``, the cluster shape of a plan, the driver's visible CUDA devices).
    """
    if requested != "auto":
        return requested
    return "cuda" if gpus else "cpu"
