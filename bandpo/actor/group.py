"""Data-parallel actor ranks as Ray actors, and how a batch is split between them.

Sharding is strided (rank r takes rows r, r + W, r + 2W, ...): then the k-th local
mini-batch of every rank holds exactly the rows of the k-th global mini-batch, so n ranks
take the same optimizer steps as one rank on the whole batch.

``old_logprobs`` and ``update`` are the trainer's stages 5 and 6. With ``reuse_old_logprobs``
the policy before the first optimizer step is the one of that step's own forward, so the
old-logprob pass covers only the later mini-batches' rows (none with one optimizer step per
rollout) and the update's first forward fills the first mini-batch's rows (ratio 1 there). With
``old_from_rollout`` (``actor.old_logprobs=rollout``) no old-logprob pass runs: pi_old is the
engines' sampling log-probs for every row, and the update's first forward is kept only as the
actor's side of the step's rollout/actor metrics.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch

from bandpo.algo.options import LossOptions
from bandpo.distributed import forwarded_env
from bandpo.distributed.startup import ACTOR_HINT, DEFAULT_STARTUP_TIMEOUT_S, wait_started
from bandpo.errors import RankDeviceError, WorkerFailure
from bandpo.types import RolloutBatch, TrainBatch


def shard_batch(batch: RolloutBatch, rank: int, world_size: int) -> TrainBatch:
    """Rows ``rank::world_size`` of ``batch`` (same column widths); a RolloutBatch becomes a TrainBatch."""
    if not 0 <= rank < world_size:
        raise ValueError(f"shard_batch: rank={rank} not in [0, world_size={world_size})")
    if batch.size % world_size:
        raise ValueError(f"shard_batch: {batch.size} rows do not split evenly over world_size={world_size}")
    if not isinstance(batch, TrainBatch):
        batch = TrainBatch.from_rollout(batch)
    return batch.select(torch.arange(rank, batch.size, world_size))


def unshard_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of ``shard_batch`` for per-row tensors: parts[r] holds rows r::W -> [N, ...]."""
    world = len(parts)
    out = parts[0].new_empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]))
    for rank, part in enumerate(parts):
        out[rank::world] = part
    return out


class UpdateResult(NamedTuple):
    """What ``ActorGroup.update`` returns."""

    # the last pass's (rank 0's, globally reduced), but optimizer_steps and nonfinite_steps: all epochs'
    metrics: dict[str, float]
    nonfinite_steps: int  # optimizer steps discarded for a NaN/inf loss or gradient, all epochs
    optimizer_steps: int  # all epochs
    # [N, R] pi_old's entropy, complete: with reuse_old_logprobs its first mini-batch's rows come from the
    # update's first forward; None only when there was none to return (reuse, and no epoch ran). With
    # old_from_rollout [first, R]: the entropy of the update's first forward, its first mini-batch's rows.
    entropy: torch.Tensor | None
    # With old_from_rollout [first, R]: the log-probs of that forward, the actor's side of the step's
    # rollout/actor metrics (pi_old being the engines'); None otherwise.
    actor_logprobs: torch.Tensor | None = None


def _merge_first_rows(first_rows: torch.Tensor, later: torch.Tensor | None, first: int) -> torch.Tensor:
    """[N, R]: ``later`` (written in place) with rows ``0..first`` from ``first_rows`` (the update's
    first forward); ``first_rows`` itself when there are no later rows."""
    if later is None:
        return first_rows
    later[:first] = first_rows[:first]
    return later


def rank_device(options: dict[str, Any]) -> str:
    """The device a rank's Ray ``options`` seat it on: ``cuda`` with a share of a GPU, else ``cpu``."""
    return "cuda" if options.get("num_gpus") else "cpu"


def rank_env(device: str, environ=None) -> dict[str, str]:
    """A rank's runtime_env variables: the forwarded ones (``bandpo.distributed.forwarded_env``) and
    DeepSpeed's accelerator for ``device``, whatever the driver's (a head without GPUs has ``cpu``)."""
    return {**forwarded_env(environ), "DS_ACCELERATOR": device}


def device_error_line(ray_error: str) -> str | None:
    """The one line of a ``RankDeviceError`` inside Ray's text of a failed constructor, else None."""
    tag = f"{RankDeviceError.__name__}: "
    for line in ray_error.splitlines():
        if tag in line:
            return line.split(tag, 1)[1].strip()
    return None


def report_lines(reports: list[dict]) -> list[str]:
    """One console line per node: its ranks, DeepSpeed's accelerator, their torch devices and dtypes."""
    by_node: dict[str, list[dict]] = {}
    for r in reports:
        by_node.setdefault(r["node"], []).append(r)
    lines = []
    for node, rs in by_node.items():
        kinds = sorted({f"DeepSpeed accelerator {r['accelerator']}, {r['precision']}" for r in rs})
        lines.append(
            f"[bandpo] actor ranks {','.join(str(r['rank']) for r in rs)} on {node}: "
            f"devices {','.join(r['device'] for r in rs)}; {'; '.join(kinds)}"
        )
    return lines


def _rendezvous() -> tuple[str, int]:
    """Run on rank 0's node: its address and a free port for torch.distributed."""
    import ray

    from bandpo.distributed.ports import free_port

    return ray.util.get_node_ip_address(), free_port()


class ActorGroup:
    """``world_size`` Ray actors running ``bandpo.actor.Actor``, one rank each.

    Ranks are gang-scheduled in a placement group (one bundle per rank); rank 0's node
    publishes the rendezvous address before the ranks start. Needs ``ray.init()`` first.

    ``options_per_rank[r]`` (Ray ``.options`` with a placement-group ``scheduling_strategy``, e.g.
    from ``bandpo.distributed.placement.actor_options``) seats rank r in a group the caller owns;
    then no group of its own is made and ``num_*_per_rank`` are unused. With ``wait=False``
    the ranks build in the background until ``wait_ready()`` (the trainer starts the rollout
    engines and the verifier meanwhile), for at most ``startup_timeout_s`` from construction
    (``trainer.startup_timeout``). ``reuse_old_logprobs``, ``old_from_rollout``: see the module
    docstring (not both).
    ``offloads``: the ranks were built with ``offload_during_rollout`` (``offload`` / ``reload``).
    """

    def __init__(
        self,
        model_path: str,
        world_size: int,
        *,
        num_cpus_per_rank: float = 1,
        num_gpus_per_rank: float = 0,
        options_per_rank: list[dict[str, Any]] | None = None,
        wait: bool = True,
        reuse_old_logprobs: bool = False,
        old_from_rollout: bool = False,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        **actor_kwargs: Any,
    ):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from bandpo.actor.worker import Actor

        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if reuse_old_logprobs and old_from_rollout:
            raise ValueError("ActorGroup: reuse_old_logprobs and old_from_rollout exclude each other")
        self.world_size = world_size
        self.reuse_old = reuse_old_logprobs
        self.old_from_rollout = old_from_rollout
        self.offloads = bool(actor_kwargs.get("offload_during_rollout"))
        self.first_rows = actor_kwargs.get("mini_batch_size")  # rows of the first optimizer step
        if options_per_rank is not None:
            if len(options_per_rank) != world_size:
                raise ValueError(
                    f"ActorGroup: options_per_rank has {len(options_per_rank)} entries for "
                    f"world_size={world_size}"
                )
            self.pg = None  # the caller's placement groups
            opts = [dict(o) for o in options_per_rank]
        else:
            bundle = {"CPU": num_cpus_per_rank, **({"GPU": num_gpus_per_rank} if num_gpus_per_rank else {})}
            self.pg = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
            ray.get(self.pg.ready())
            opts = [
                {
                    "num_cpus": num_cpus_per_rank,
                    "num_gpus": num_gpus_per_rank,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        self.pg, placement_group_bundle_index=r
                    ),
                }
                for r in range(world_size)
            ]

        addr, port = ray.get(
            ray.remote(_rendezvous)
            .options(num_cpus=0, scheduling_strategy=opts[0]["scheduling_strategy"])
            .remote()
        )
        self.devices = [rank_device(o) for o in opts]
        remote_cls = ray.remote(Actor)
        self.workers = [
            remote_cls.options(
                **opts[rank],
                runtime_env={"env_vars": rank_env(self.devices[rank])},
            ).remote(
                model_path,
                rank=rank,
                world_size=world_size,
                master_addr=addr,
                master_port=port,
                expected_device=self.devices[rank],
                **actor_kwargs,
            )
            for rank in range(world_size)
        ]
        self._ready = [w.info.remote() for w in self.workers]
        self._started, self.startup_timeout_s = time.monotonic(), startup_timeout_s
        self.reports: list[dict] = []  # each rank's ``info()`` once built (device, precision, node)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until every rank is built, then print where each computes and in what precision.

        A rank on another device than its plan's (``bandpo.actor.setup.check_rank_device``) is a
        ``WorkerFailure`` with that rank's one line, naming its node; any other constructor error
        is raised as Ray gives it (``RayActorError``). Ranks still building ``startup_timeout_s`` after
        they were started: ``StartupTimeout`` naming them, with the NCCL hint
        (``bandpo.distributed.startup``).
        """
        from ray.exceptions import RayActorError

        if not self._ready:
            return
        names = [f"rank {r}" for r in range(len(self._ready))]
        try:
            self.reports = wait_started(
                self._ready, names, self._started, self.startup_timeout_s, "the actor ranks", ACTOR_HINT
            )
        except RayActorError as e:
            line = device_error_line(str(e))
            if line is None:
                raise
            raise WorkerFailure(line) from e
        self._ready = []
        for line in report_lines(self.reports):
            print(line, flush=True)

    def call(self, method: str, *args, **kwargs) -> list:
        """Run ``method`` on every rank with the same arguments; results in rank order."""
        import ray

        return ray.get([getattr(w, method).remote(*args, **kwargs) for w in self.workers])

    def offload(self) -> None:
        """Before the engines wake: every rank's states to host memory (``bandpo.actor.offload``)."""
        self.call("offload")

    def offload_weights(self) -> None:
        """Once the weight sync has read them: the bf16 weights too (ZeRO-2; ``bandpo.actor.offload``)."""
        self.call("offload_weights")

    def reload(self) -> None:
        """Once the engines sleep: every rank's states back on its GPU, before stage 5."""
        self.call("reload")

    def old_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        """Stage 5: ``batch.old_logprobs`` [N, R] = log pi_old; returns pi_old's entropy [N, R].

        With ``reuse_old_logprobs`` only the rows after the first mini-batch are computed: the
        first mini-batch's rows hold 0.0 in both until ``update`` fills them, and a batch of one
        mini-batch gets neither (``batch.old_logprobs`` stays None, None is returned).

        With ``old_from_rollout`` no pass runs: ``batch.old_logprobs`` is a copy of
        ``batch.rollout_logprobs`` (every row) and None is returned.
        """
        if self.old_from_rollout:
            batch.old_logprobs = batch.rollout_logprobs.clone()  # [N, R]
            return None
        if not self.reuse_old:
            batch.old_logprobs, entropy = self.compute_logprobs(batch, with_entropy=True)  # [N, R] x2
            return entropy
        first = self.first_rows
        if first >= batch.size:
            return None
        # lp, ent: [N - first, R]
        lp, ent = self.compute_logprobs(batch.select(slice(first, None)), with_entropy=True)
        pad = torch.zeros(first, lp.shape[1], dtype=lp.dtype)
        batch.old_logprobs = torch.cat([pad, lp])  # [N, R]
        return torch.cat([pad, ent])  # [N, R]

    def update(
        self, batch: TrainBatch, options: LossOptions, epochs: int, entropy: torch.Tensor | None
    ) -> UpdateResult:
        """Stage 6: ``epochs`` passes of mini-batched optimizer steps over ``batch``.

        With ``reuse_old_logprobs`` the first epoch's first step takes the first mini-batch's old
        log-probs (and entropy) from its own forward: they are written into ``batch.old_logprobs``
        and into ``entropy`` (``old_logprobs``'s return; completed in place). The result carries
        the complete entropy either way, for the step's metrics.

        With ``old_from_rollout`` ``batch.old_logprobs`` (the engines') is left as it is for every
        row; the first step's forward comes back in the result instead (``actor_logprobs`` and
        ``entropy``, its first mini-batch's rows), the actor's side of the step's metrics.
        """
        update: dict = {}
        bad = total = 0
        complete = None if self.reuse_old else entropy
        actor_logprobs = None
        for epoch in range(epochs):
            if epoch == 0 and (self.reuse_old or self.old_from_rollout):
                update, first_lp, first_entropy = self.update_on_policy(batch, options)
                if self.reuse_old:  # old_logprobs: [N, R]
                    batch.old_logprobs = _merge_first_rows(first_lp, batch.old_logprobs, self.first_rows)
                    complete = _merge_first_rows(first_entropy, entropy, self.first_rows)  # [N, R]
                else:  # [first, R] each
                    actor_logprobs, complete = first_lp[: self.first_rows], first_entropy[: self.first_rows]
            else:
                update = self.update_epoch(batch, options)
            bad += int(update["nonfinite_steps"])
            total += int(update["optimizer_steps"])
        # the step's actor/optimizer_steps and actor/nonfinite_steps count every epoch, not the last
        update = {**update, "optimizer_steps": float(total), "nonfinite_steps": float(bad)}
        return UpdateResult(update, bad, total, complete, actor_logprobs)

    def update_epoch(self, batch: TrainBatch, options: LossOptions) -> dict[str, float]:
        """One pass: shard ``batch`` over the ranks and update; returns the (globally reduced) metrics of rank 0."""
        import ray

        refs = [
            w.update.remote(shard_batch(batch, r, self.world_size), options)
            for r, w in enumerate(self.workers)
        ]
        return ray.get(refs)[0]

    def update_on_policy(self, batch: TrainBatch, options: LossOptions):
        """``Actor.update_on_policy`` over the ranks: (rank 0's metrics, the first step's log-probs [N, R],
        entropy [N, R]) in the batch's row order; the log-probs are that step's old ones unless
        ``old_from_rollout``. Rank r's first mini-batch is its shard's first rows, batch rows
        r, r + W, ...: together the batch's first ``mini_batch_size`` rows, the ones filled."""
        import ray

        parts = ray.get(
            [
                w.update_on_policy.remote(
                    shard_batch(batch, r, self.world_size), options, not self.old_from_rollout
                )
                for r, w in enumerate(self.workers)
            ]
        )
        return parts[0][0], unshard_rows([p[1] for p in parts]), unshard_rows([p[2] for p in parts])

    def compute_logprobs(self, batch: RolloutBatch, with_entropy: bool = False, ref: bool = False):
        """``Actor.compute_logprobs`` over the ranks, reassembled in the batch's row order."""
        import ray

        parts = ray.get(
            [
                w.compute_logprobs.remote(shard_batch(batch, r, self.world_size), with_entropy, ref)
                for r, w in enumerate(self.workers)
            ]
        )
        logprobs = unshard_rows([p[0] for p in parts])
        entropy = unshard_rows([p[1] for p in parts]) if with_entropy else None
        return logprobs, entropy

    def shutdown(self) -> None:
        """Kill the rank actors and free their placement group (if this group made it)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for w in self.workers:
            ray.kill(w)
        if self.pg is not None:
            remove_placement_group(self.pg)
        self.workers = []
