"""/dev/shm hygiene: only entries recorded by this project's runs whose processes are gone go."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from bandpo.shm import vllm_leftovers


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_leftovers, "INDEX_DIR", tmp_path / "index")
    folder = tmp_path / "shm"
    folder.mkdir()
    return folder


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_alive_tells_running_from_finished_processes():
    assert vllm_leftovers.alive(os.getpid())
    assert not vllm_leftovers.alive(_dead_pid())


def test_records_only_new_entries_held_by_the_runs_processes(shm_dir, tmp_path):
    (shm_dir / "psm_old").write_bytes(b"x")
    before = vllm_leftovers.snapshot(shm_dir)
    for name in ("psm_ours", "sem.mp-ours", "psm_someone_elses", "unrelated_file"):
        (shm_dir / name).write_bytes(b"x")
    # A stand-in engine: a process of ours that keeps two of the new entries open.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; fs = [open(p) for p in sys.argv[1:]]; "
            "print('open', flush=True); time.sleep(60)",
            str(shm_dir / "psm_ours"),
            str(shm_dir / "sem.mp-ours"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        owned = vllm_leftovers.record_new_entries(tmp_path / "run", before, shm_dir, pids=[holder.pid])
    finally:
        holder.kill()
        holder.wait()
    assert owned == {str(shm_dir / "psm_ours"): [holder.pid], str(shm_dir / "sem.mp-ours"): [holder.pid]}
    assert json.loads((tmp_path / "run" / "logs" / "shm.json").read_text())["entries"] == owned


def test_removes_recorded_entries_of_dead_runs_only(shm_dir, tmp_path):
    dead, alive = _dead_pid(), subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for name in ("psm_dead_run", "sem.mp-dead_run", "psm_live_run", "psm_never_recorded"):
            (shm_dir / name).write_bytes(b"x")
        vllm_leftovers.INDEX_DIR.mkdir(parents=True)
        (vllm_leftovers.INDEX_DIR / "1.json").write_text(
            json.dumps(
                {
                    "entries": {
                        str(shm_dir / "psm_dead_run"): [dead],
                        str(shm_dir / "sem.mp-dead_run"): [dead],
                        str(shm_dir / "psm_gone_already"): [dead],
                    }
                }
            )
        )
        (vllm_leftovers.INDEX_DIR / "2.json").write_text(
            json.dumps({"entries": {str(shm_dir / "psm_live_run"): [alive.pid]}})
        )
        removed = vllm_leftovers.remove_dead_entries(tmp_path / "run")
        assert sorted(removed) == [str(shm_dir / "psm_dead_run"), str(shm_dir / "sem.mp-dead_run")]
        assert sorted(p.name for p in shm_dir.iterdir()) == ["psm_live_run", "psm_never_recorded"]
        # the dead run's record is done
        assert [p.name for p in vllm_leftovers.INDEX_DIR.iterdir()] == ["2.json"]
    finally:
        alive.kill()
        alive.wait()
    time.sleep(0.01)
    assert vllm_leftovers.remove_dead_entries() == [str(shm_dir / "psm_live_run")]  # its run is dead now


def test_an_entry_still_held_by_any_process_is_kept(shm_dir, tmp_path):
    target = shm_dir / "psm_reused"
    target.write_bytes(b"x")
    vllm_leftovers.INDEX_DIR.mkdir(parents=True)
    (vllm_leftovers.INDEX_DIR / "1.json").write_text(json.dumps({"entries": {str(target): [_dead_pid()]}}))
    with open(target):  # someone (this test) still has it open: not garbage
        assert vllm_leftovers.remove_dead_entries() == []
    assert target.exists()
