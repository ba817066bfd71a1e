"""The node-local LoRA adapter folders of ``rollout.lora_sync=adapter`` (``bandpo.weight_sync.lora_adapter``).

Each is ``ADAPTER_PREFIX`` + driver pid + ``-`` + the driver's node address + ``-`` + the folder's
Ray node id, a folder in /dev/shm (RAM) holding the adapter's two PEFT files (a node without actor
ranks gets them as bytes: ``read_adapter_files`` on rank 0's node, ``write_adapter_files`` on its
own). Those of a driver that no longer runs are removed at the next run's first sync on every node
it syncs to (``stale_adapter_dirs``): a pid tells whether its driver still runs only on the driver's
own machine, so the name carries that machine's address, and the next driver there judges them all.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from bandpo.checkpoint.lora_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from bandpo.shm import weight_files
from bandpo.shm.vllm_leftovers import alive

ADAPTER_PREFIX = "/dev/shm/bandpo-adapter-"


def node_adapter_dir(prefix: str, node_id: str) -> str:
    """The adapter folder of one Ray node: ``<prefix>-<node id>`` (nodes sharing a /dev/shm stay apart)."""
    return f"{prefix}-{node_id}"


def remove_adapter_dir(path: str) -> None:
    """Delete an adapter folder (frees its RAM); a missing one is fine."""
    shutil.rmtree(path, ignore_errors=True)


def read_adapter_files(folder: str) -> dict[str, bytes]:
    """The folder's two files as bytes (another node's copy is written from them: ``write_adapter_files``)."""
    out = {}
    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = f.read()
    return out


def check_adapter_space(folder: str, nbytes: int) -> None:
    """Raise ``SharedMemoryFull`` naming ``folder`` unless its file system takes ``nbytes`` of adapter
    files (those already in the folder are replaced: they count as used). The weight file's check
    (``bandpo.shm.weight_files.check_space``): a full tmpfs would otherwise be a bare OSError mid-write
    (Docker's default 64 MB against a ~240 MB rank-64 Qwen2.5-3B adapter)."""
    existing = 0
    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        try:
            existing += os.path.getsize(os.path.join(folder, name))
        except OSError:
            pass
    weight_files.check_space(
        folder if os.path.isdir(folder) else os.path.dirname(folder) or ".",
        nbytes,
        existing=existing,
        what=f"the LoRA adapter folder {folder}",
        parts=f"{nbytes} for the adapter's files",
        alternative="set rollout.lora_sync=merged (the weights then go through rollout.weight_sync)",
    )


def write_adapter_files(folder: str, files: dict[str, bytes]) -> int:
    """Write ``read_adapter_files``' result into ``folder`` after ``check_adapter_space``; returns the bytes
    written."""
    for name in files:
        if name not in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
            raise ValueError(f"write_adapter_files: unexpected file {name!r}")
    check_adapter_space(folder, sum(len(d) for d in files.values()))
    os.makedirs(folder, exist_ok=True)
    for name, data in files.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    return sum(len(d) for d in files.values())


def adapter_dir_names() -> list[str]:
    """The names of this machine's adapter folders (run on each node the driver syncs to)."""
    base = Path(ADAPTER_PREFIX)
    return sorted(p.name for p in base.parent.glob(base.name + "*") if p.is_dir())


def stale_adapter_dirs(names: list[str], driver_ip: str, local: bool, alive_pid=alive) -> list[str]:
    """The folders among ``names`` whose driver ran on the machine at ``driver_ip`` (this driver's) and
    no longer does (``alive_pid(pid)`` False, asked on that machine). A driver on another machine is
    that machine's to judge. ``local``: ``names`` were listed on the driver's machine, where a name
    without the driver's address (bandpo before it carried one) is judged by its pid alone."""
    base = Path(ADAPTER_PREFIX).name
    stale = []
    for name in names:
        parts = name[len(base) :].split("-") if name.startswith(base) else []
        if len(parts) not in (2, 3) or not parts[0].isdigit():
            continue  # not a driver's
        ours = parts[1] == driver_ip if len(parts) == 3 else local
        if ours and not alive_pid(int(parts[0])):
            stale.append(name)
    return stale


def driver_adapter_dirs(pids: list[int]) -> list[str]:
    """This machine's adapter folders of the drivers ``pids`` (the fault test: none may outlive a killed one)."""
    return sorted(
        str(p)
        for pid in pids
        for p in Path(ADAPTER_PREFIX).parent.glob(f"{Path(ADAPTER_PREFIX).name}{pid}-*")
    )
