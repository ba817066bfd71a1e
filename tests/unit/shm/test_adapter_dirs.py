"""The LoRA adapter folders in /dev/shm: named by driver pid and node, removed when their driver is gone."""

import subprocess
import sys
from pathlib import Path

import pytest

from bandpo.shm import adapter_dirs


@pytest.fixture
def shm_root(tmp_path, monkeypatch):
    monkeypatch.setattr(adapter_dirs, "ADAPTER_PREFIX", str(tmp_path / "bandpo-adapter-"))
    return tmp_path


def test_stale_folders_go_and_a_drivers_folders_are_found(shm_root):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid, live_pid = int(dead.stdout), 1  # pid 1 runs as long as the machine does
    prefix = adapter_dirs.ADAPTER_PREFIX
    for pid in (dead_pid, live_pid):
        for node in ("n1", "n2"):
            Path(adapter_dirs.node_adapter_dir(f"{prefix}{pid}", node)).mkdir()
    (shm_root / "bandpo-adapter-notapid-n1").mkdir()  # not a driver's: never touched

    assert adapter_dirs.driver_adapter_dirs([dead_pid]) == [
        f"{prefix}{dead_pid}-n1",
        f"{prefix}{dead_pid}-n2",
    ]
    assert sorted(adapter_dirs.remove_stale_adapter_dirs()) == [
        f"{prefix}{dead_pid}-n1",
        f"{prefix}{dead_pid}-n2",
    ]
    assert adapter_dirs.driver_adapter_dirs([dead_pid]) == []
    assert (
        len(adapter_dirs.driver_adapter_dirs([live_pid])) == 2
        and (shm_root / "bandpo-adapter-notapid-n1").is_dir()
    )
