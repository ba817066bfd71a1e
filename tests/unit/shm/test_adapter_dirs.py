"""The LoRA adapter folders in /dev/shm: named by driver pid, driver address and node; a dead driver's
are found on every node by the next driver on its machine, and nobody else's are touched."""

import subprocess
import sys
from pathlib import Path

import pytest

from bandpo.shm import adapter_dirs


@pytest.fixture
def shm_root(tmp_path, monkeypatch):
    monkeypatch.setattr(adapter_dirs, "ADAPTER_PREFIX", str(tmp_path / "bandpo-adapter-"))
    return tmp_path


@pytest.fixture
def pids():
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(dead.stdout), 1  # pid 1 runs as long as the machine does


def test_a_drivers_folders_are_found(shm_root, pids):
    dead_pid, live_pid = pids
    prefix = adapter_dirs.ADAPTER_PREFIX
    for pid in (dead_pid, live_pid):
        for node in ("n1", "n2"):
            Path(adapter_dirs.node_adapter_dir(f"{prefix}{pid}-10.0.0.1", node)).mkdir()
    assert adapter_dirs.driver_adapter_dirs([dead_pid]) == [
        f"{prefix}{dead_pid}-10.0.0.1-n1",
        f"{prefix}{dead_pid}-10.0.0.1-n2",
    ]
    assert len(adapter_dirs.adapter_dir_names()) == 4


@pytest.mark.parametrize("local", [True, False])
def test_only_this_machines_dead_drivers_folders_are_stale(shm_root, pids, local):
    dead_pid, live_pid = pids
    base = Path(adapter_dirs.ADAPTER_PREFIX).name
    names = [
        f"{base}{dead_pid}-10.0.0.1-n2",  # this machine's driver, gone: stale on every node
        f"{base}{live_pid}-10.0.0.1-n2",  # this machine's driver, running
        f"{base}{dead_pid}-10.0.0.9-n2",  # another machine's driver: its pid means nothing here
        f"{base}{dead_pid}-n1",  # the older name, no driver address: judged on the driver's machine only
        f"{base}notapid-n1",  # not a driver's
        f"{base}{dead_pid}-a-b-c",  # not one of ours either
    ]
    stale = adapter_dirs.stale_adapter_dirs(names, "10.0.0.1", local=local)
    assert stale == [names[0], *([names[3]] if local else [])]
