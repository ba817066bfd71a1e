"""The node-local LoRA adapter folders of ``rollout.lora_sync=adapter`` (``bandpo.weight_sync.lora_adapter``).

Each is ``ADAPTER_PREFIX`` + driver pid + ``-`` + Ray node id, a folder in /dev/shm (RAM) holding
the adapter's two PEFT files; those of a driver that no longer runs are removed at the next sync's
start (``remove_stale_adapter_dirs``), as the weight files' are (``bandpo.shm.weight_files``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from bandpo.shm.vllm_leftovers import alive

ADAPTER_PREFIX = "/dev/shm/bandpo-adapter-"


def node_adapter_dir(prefix: str, node_id: str) -> str:
    """The adapter folder of one Ray node: ``<prefix>-<node id>`` (nodes sharing a /dev/shm stay apart)."""
    return f"{prefix}-{node_id}"


def remove_adapter_dir(path: str) -> None:
    """Delete an adapter folder (frees its RAM); a missing one is fine."""
    shutil.rmtree(path, ignore_errors=True)


def remove_stale_adapter_dirs() -> list[str]:
    """Delete this machine's adapter folders of drivers that no longer run; returns their paths."""
    removed = []
    for path in Path(ADAPTER_PREFIX).parent.glob(Path(ADAPTER_PREFIX).name + "*"):
        pid = path.name[len(Path(ADAPTER_PREFIX).name) :].split("-")[0]
        if path.is_dir() and pid.isdigit() and not alive(int(pid)):
            remove_adapter_dir(str(path))
            removed.append(str(path))
    return removed


def driver_adapter_dirs(pids: list[int]) -> list[str]:
    """This machine's adapter folders of the drivers ``pids`` (the fault test: none may outlive a killed one)."""
    return sorted(
        str(p)
        for pid in pids
        for p in Path(ADAPTER_PREFIX).parent.glob(f"{Path(ADAPTER_PREFIX).name}{pid}-*")
    )
