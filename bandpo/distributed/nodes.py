"""Start-up checks of a multi-node cluster: every node runs bandpo's code and sees the run folder.

The actor ranks write the checkpoints and the HF export into ``trainer.output_dir`` on their own
nodes, and the driver reads them back (resume, the run's summary): the folder must be one
filesystem that every node mounts at the same path. ``check_nodes`` writes a marker file with a
random token into the folder and runs one tiny task on every other node (pinned there with
``NodeAffinitySchedulingStrategy``) that reads it back. The task is a function of this module,
so a node where bandpo does not import fails it, and the error names that node too.

A node the driver shares a machine with needs no check; a local Ray instance has only that one.
"""

from __future__ import annotations

import os
import secrets
from functools import cache

from bandpo.errors import ConfigError, WorkerFailure

MARKER_PREFIX = ".bandpo-shared-check-"
# a node that cannot start a worker (no CPU to spare is no reason: the task takes none)
CHECK_TIMEOUT_S = 120.0


def read_marker(path: str) -> tuple[str, str | None]:
    """Run on each node: (its host name, the marker's token, or None when it sees no such file)."""
    import socket

    try:
        with open(path) as f:
            return socket.gethostname(), f.read()
    except OSError:
        return socket.gethostname(), None


@cache
def _remote_read_marker():
    import ray

    return ray.remote(read_marker)


def _node_name(node: dict) -> str:
    return f"{node.get('NodeManagerAddress', '?')} (node id {node['NodeID'][:12]})"


def check_nodes(output_dir: str, timeout_s: float = CHECK_TIMEOUT_S) -> list[str]:
    """Check that every alive node but the driver's imports bandpo and sees ``output_dir`` (absolute,
    existing); returns the node ids checked.

    Raises ``WorkerFailure`` naming the nodes whose task failed (bandpo does not import there) or
    did not answer within ``timeout_s``, and ``ConfigError`` naming ``trainer.output_dir`` and the
    nodes that see another folder at that path.
    """
    import ray
    from ray.exceptions import GetTimeoutError, RayError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not os.path.isabs(output_dir):
        raise ValueError(f"check_nodes: output_dir must be absolute (the driver's), got {output_dir!r}")
    here = ray.get_runtime_context().get_node_id()
    others = [n for n in ray.nodes() if n.get("Alive") and n["NodeID"] != here]
    if not others:
        return []
    token = secrets.token_hex(16)
    marker = os.path.join(output_dir, MARKER_PREFIX + token)
    with open(marker, "w") as f:
        f.write(token)
        f.flush()
        os.fsync(f.fileno())  # a network filesystem shows other clients what reached its server
    try:
        refs = [
            _remote_read_marker()
            .options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
            .remote(marker)
            for n in others
        ]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        done = set(ready)
        broken, unseen = [], []
        for node, ref in zip(others, refs):
            if ref not in done:
                broken.append(f"{_node_name(node)}: no answer within {timeout_s:g} s")
                ray.cancel(ref, force=True)
                continue
            try:
                host, seen = ray.get(ref, timeout=0)
            except (RayError, GetTimeoutError) as e:
                first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                broken.append(f"{_node_name(node)}: {first}")
                continue
            if seen != token:
                unseen.append(f"{_node_name(node)}, host {host}")
    finally:
        os.remove(marker)
    if broken:
        raise WorkerFailure(
            f"start-up check of the cluster's nodes failed on {len(broken)} node(s): "
            + "; ".join(broken)
            + ". Every node must import bandpo (the job ships the driver's package when it joins a cluster "
            "through trainer.ray_address or RAY_ADDRESS) and start Ray workers"
        )
    if unseen:
        raise ConfigError(
            f"config error: trainer.output_dir={output_dir} is not the same folder on every node: "
            f"{len(unseen)} node(s) do not see the marker file the driver wrote there ({'; '.join(unseen)}). "
            "The actor ranks write checkpoints and the HF export there and the driver reads them: put "
            "trainer.output_dir on a filesystem every node mounts at the same path (NFS, a cluster "
            "filesystem), or run on one node"
        )
    return [n["NodeID"] for n in others]
