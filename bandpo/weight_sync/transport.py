"""Which transport carries the actor's weights to the engines (``rollout.weight_sync``), and its driver.

    auto  ipc on GPU when the engines share the actor's GPUs (colocated), nccl when they run
          on GPUs of their own (split, one node or many), shm on CPU or with the HF engine
    ipc   CUDA IPC handles, bucket by bucket: each engine worker maps the bucket its own GPU's
          actor rank packed (``bandpo.weight_sync.ipc``); no byte goes through host memory
    nccl  NCCL broadcast from actor rank 0 to every engine worker, through vLLM's weight-transfer
          engine (``bandpo.weight_sync.nccl``); no byte goes through host memory
    shm   a flat file in each node's /dev/shm (``bandpo.shm.weight_files`` / ``node``): the only
          transport on CPU, and the one an engine without CUDA-side loading (HF) takes

An explicit choice the layout cannot carry is a ``ConfigError`` naming ``rollout.weight_sync``:
ipc needs an actor rank on every engine GPU (colocated); nccl needs the engines on GPUs the
actor does not use (NCCL refuses two ranks of one communicator on one GPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bandpo.errors import ConfigError, check_choice
from bandpo.weight_sync.waits import DEFAULT_TIMEOUT_S, get_within

if TYPE_CHECKING:
    from ray.actor import ActorHandle

TRANSPORTS = ("auto", "ipc", "nccl", "shm")
RANKS_GRACE_S = 60.0  # the driver's wait for the ranks past rollout.weight_sync_timeout (DeviceWeightSync)
KEY = "rollout.weight_sync"


def choose_transport(choice: str, layout: str, backend: str = "vllm") -> str:
    """The transport for ``choice`` in ``layout`` ("cpu" | "colocated" | "split") with ``backend``'s engines."""
    try:
        check_choice(choice, TRANSPORTS, KEY)
    except ValueError as e:
        raise ConfigError(f"config error: {e}") from None
    if choice == "auto":
        if layout == "cpu" or backend != "vllm":
            return "shm"
        return "ipc" if layout == "colocated" else "nccl"
    if choice == "shm":
        return "shm"
    if layout == "cpu":
        raise ConfigError(
            f"config error: {KEY}={choice} moves CUDA tensors and the run is on CPU; "
            f"use shm or auto, got {choice!r}"
        )
    if backend != "vllm":
        raise ConfigError(
            f"config error: {KEY}={choice} needs rollout.backend=vllm (the {backend} engine "
            f"loads weights from /dev/shm only); use shm or auto, got {choice!r}"
        )
    if choice == "ipc" and layout != "colocated":
        raise ConfigError(
            f"config error: {KEY}=ipc needs the engines on the actor's GPUs (the colocated "
            f"layout: actor.gpus and rollout.gpus null); the {layout} layout takes nccl or shm, "
            f"got {choice!r}"
        )
    if choice == "nccl" and layout != "split":
        raise ConfigError(
            f"config error: {KEY}=nccl needs the engines on GPUs of their own (the split layout: "
            f"actor.gpus and rollout.gpus set); the {layout} layout takes ipc or shm, got {choice!r}"
        )
    return choice


def make_weight_sync(
    transport: str,
    actors: list[ActorHandle],
    engines: list[ActorHandle],
    *,
    prefix: str,
    engine_tp: int = 1,
    timeout_s: float = DEFAULT_TIMEOUT_S,
):
    """The sync object of a resolved ``transport``: ``sync()`` loads the actor's weights into every
    engine, ``close()`` removes what it left (shm: the node files named ``<prefix>-<node id>.bin``),
    ``last_bytes`` is what the last sync moved to each engine node. ``timeout_s`` bounds each wait of
    the ipc, nccl and adapter syncs. ``adapter``: the LoRA adapter alone (``rollout.lora_sync``,
    ``bandpo.weight_sync.lora_adapter``), in folders named after the driver's pid and node."""
    if transport == "adapter":
        import os

        import ray

        from bandpo.shm.adapter_dirs import ADAPTER_PREFIX
        from bandpo.weight_sync.lora_adapter import AdapterWeightSync

        driver = f"{os.getpid()}-{ray.util.get_node_ip_address()}"  # whose pid it is (stale_adapter_dirs)
        return AdapterWeightSync(actors, engines, f"{ADAPTER_PREFIX}{driver}", timeout_s)
    if transport == "shm":
        from bandpo.weight_sync.node import NodeWeightSync

        return NodeWeightSync(actors, engines, prefix)
    return DeviceWeightSync(transport, actors, engines, engine_tp, timeout_s)


class DeviceWeightSync:
    """ipc / nccl: every actor rank runs ``send_weights`` (ZeRO-3's per-bucket gathers are
    collectives); rank 0 drives the engines' side of each bucket. Returns when all engines hold
    the new weights.

    Args:
        transport: "ipc" or "nccl".
        actors: the actor ranks' handles in rank order; engines: the rollout workers' handles.
        engine_tp: GPUs per engine (nccl: engine i's workers take ranks 1 + i * tp ...).
        timeout_s: the longest any one wait inside a rank may take (``rollout.weight_sync_timeout``);
            the ranks name the stage that ran out (``bandpo.weight_sync.waits``). The driver waits
            ``timeout_s + RANKS_GRACE_S`` for the whole sync (``limit_s``), so a rank's own error
            arrives first; its own limit ends a sync only for a rank stuck where no wait of ours is
            (a collective), or one whose many waits add up past it. nccl's first sync adds one
            ``timeout_s``: its NCCL rendezvous is a wait of its own, which may take most of its
            limit on a slow fabric before the broadcast's waits begin.
    """

    adapter_only = False  # full weights: the checksums verify them (bandpo.weight_sync.checksums)

    def __init__(
        self,
        transport: str,
        actors: list[ActorHandle],
        engines: list[ActorHandle],
        engine_tp: int = 1,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        if transport not in ("ipc", "nccl"):
            raise ValueError(f"DeviceWeightSync: transport must be ipc or nccl, got {transport!r}")
        self.transport, self.actors, self.engines, self.engine_tp = transport, actors, engines, engine_tp
        self.timeout_s = timeout_s
        self.last_bytes = 0

    def limit_s(self) -> float:
        """The driver's wait for this sync's ranks (the class docstring)."""
        rendezvous = self.transport == "nccl" and not self.last_bytes  # set once the first sync is done
        return self.timeout_s * (2 if rendezvous else 1) + RANKS_GRACE_S

    def sync(self) -> None:
        limit = self.limit_s()
        refs = [
            a.send_weights.remote(self.transport, self.engines, self.engine_tp, self.timeout_s)
            for a in self.actors
        ]
        get_within(
            refs,
            limit,
            f"{self.transport} sync (the actor ranks)",
            "a rank is stuck in a collective with the others: see the run's logs/actor.log; "
            "rollout.weight_sync_timeout sets the limit",
        )
        if not self.last_bytes:  # the tensors' sizes never change; asked once the ranks are free
            specs = get_within(
                [self.actors[0].weight_specs.remote()],
                self.timeout_s + RANKS_GRACE_S,
                "the weights' sizes (actor rank 0)",
                "see the run's logs/actor.log",
            )[0]
            from bandpo.flat_buffer import plan_layout

            self.last_bytes = sum(m.nbytes for m in plan_layout(specs)[0])  # as the shm sync counts

    def close(self) -> None:
        """Nothing to remove: the buckets live only during a sync, the NCCL group dies with its processes."""
