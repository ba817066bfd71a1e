"""Actor -> rollout weight sync on any number of nodes: every engine loads a file on its own node.

/dev/shm is per machine, so one file on the driver's node reaches only the engines there.
Per sync (``NodeWeightSync.sync``):

1. publish  every actor rank runs ``publish_weights_shm`` (under ZeRO-3 each bucket's gather is
            a collective, so all ranks take part); the lowest rank on each node that holds actor
            ranks writes that node's file, after checking /dev/shm has room for it (and for the
            object store's copy when there is a relay: ``bandpo.shm.weight_files.check_shm_space``);
2. relay    each node with engines but no actor rank (split layouts) gets the bytes of rank 0's
            file through Ray's object store: a task pinned to rank 0's node maps the file into
            the store, and one rollout worker on each such node writes its node's file;
3. load     every engine loads the file of its own node.

One node: steps 1 and 3 only, with the file rewritten in place through rank 0's kept mapping,
exactly as before multi-node support (no extra copy). Files are named
``<prefix>-<node id>.bin`` (``node_shm_path``) and stay between syncs; ``close`` removes them on
every node. Nodes are Ray node ids (``ray.get_runtime_context().get_node_id()``), learnt once
at the first sync (Ray does not move a live actor).
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ray.actor import ActorHandle


def _file_bytes(path: str):
    """Ray task on the node holding ``path``: the file's bytes, mapped (the store copies them once)."""
    from bandpo.shm.weight_files import read_file_bytes

    return read_file_bytes(path)


def _remove_file(path: str) -> None:
    from bandpo.shm.weight_files import remove_shm

    remove_shm(path)


@cache
def _remote(fn):
    import ray

    return ray.remote(fn)


def _on_node(fn, node_id: str):
    """``fn`` as a zero-CPU Ray task that must run on ``node_id`` (it reads or deletes a node-local file)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return _remote(fn).options(num_cpus=0, scheduling_strategy=strategy)


def remove_on_nodes(paths: dict[str, str], remove) -> None:
    """``remove(path)`` on the node of each ``{node id: path}`` (best effort: nodes may be gone); only
    this machine's paths when Ray is down. ``remove`` must be a module-level function (a Ray task)."""
    import ray

    if not ray.is_initialized():  # only this machine's files can still be reached
        for path in paths.values():
            remove(path)
        return
    here = ray.get_runtime_context().get_node_id()
    refs = [_on_node(remove, node).remote(path) for node, path in paths.items() if node != here]
    if here in paths:
        remove(paths[here])
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=10.0)
    for ref in ready:
        try:
            ray.get(ref)
        except Exception:  # a node that went away took its /dev/shm with it
            pass


class NodeWeightSync:
    """Publishes actor weights to node-local shared-memory files and loads them into every engine.

    Args:
        actors: the actor ranks' handles, in rank order (``ActorGroup.workers``).
        engines: the rollout workers' handles (``RolloutWorker`` actors).
        prefix: file name prefix, e.g. ``/dev/shm/bandpo-weights-<driver pid>``.
    """

    adapter_only = False  # full weights: the checksums verify them (bandpo.weight_sync.checksums)

    def __init__(self, actors: list[ActorHandle], engines: list[ActorHandle], prefix: str) -> None:
        self.actors, self.engines, self.prefix = actors, engines, prefix
        self.actor_nodes: list[str] | None = None  # node of each rank
        self.engine_nodes: list[str] | None = None  # node of each engine
        self.last_loads: list[tuple[str, str]] = []  # (node, path) each engine reported at the last sync
        self.last_bytes = 0  # the weight file's tensor bytes at the last sync

    def _locate(self) -> None:
        import ray

        self.actor_nodes = ray.get([a.node_id.remote() for a in self.actors])
        self.engine_nodes = ray.get([e.node_id.remote() for e in self.engines])

    def path(self, node_id: str) -> str:
        from bandpo.shm.weight_files import node_shm_path

        return node_shm_path(self.prefix, node_id)

    def publishers(self) -> dict[int, str]:
        """The writing rank of each node with actor ranks (its lowest rank) -> that node's file."""
        out: dict[int, str] = {}
        seen: set[str] = set()
        for rank, node in enumerate(self.actor_nodes):
            if node not in seen:
                seen.add(node)
                out[rank] = self.path(node)
        return out

    def relay_nodes(self) -> dict[str, int]:
        """Nodes with engines but no actor rank -> the index of the engine there that writes the file."""
        out: dict[str, int] = {}
        for i, node in enumerate(self.engine_nodes):
            if node not in self.actor_nodes and node not in out:
                out[node] = i
        return out

    def sync(self) -> None:
        """Publish, relay and load (module docstring); returns when every engine has the new weights."""
        import ray

        if self.actor_nodes is None:
            self._locate()
        relay = self.relay_nodes()
        metas = ray.get([a.publish_weights_shm.remote(self.publishers(), bool(relay)) for a in self.actors])[
            0
        ]
        if relay:
            source = self.path(self.actor_nodes[0])
            blob = _on_node(_file_bytes, self.actor_nodes[0]).remote(source)
            written = ray.get(
                [
                    self.engines[i].write_weights_file.remote(self.path(node), [blob])
                    for node, i in relay.items()
                ]
            )
            del blob  # the object store may free the copy now
            for (node, _), (got_node, _) in zip(relay.items(), written):
                if got_node != node:
                    raise RuntimeError(f"rollout worker expected on node {node} wrote on {got_node}")
        loads = ray.get(
            [
                e.update_weights_from_shm.remote(self.path(node), metas)
                for e, node in zip(self.engines, self.engine_nodes)
            ]
        )
        for (got_node, path), node in zip(loads, self.engine_nodes):
            if got_node != node:  # an engine restarted elsewhere would read a file its node lacks
                raise RuntimeError(f"rollout worker expected on node {node} runs on {got_node} (read {path})")
        self.last_loads = loads
        self.last_bytes = sum(m.nbytes for m in metas)

    def close(self) -> None:
        """Remove the weight files on every node they were written on (best effort: nodes may be gone)."""
        if self.actor_nodes is None:
            return
        nodes = set(self.actor_nodes) | set(self.relay_nodes())
        remove_on_nodes({node: self.path(node) for node in nodes}, _remove_file)
