"""Worker output routing (bandpo.run.worker_logs): one file per worker group, nothing in-process."""

import os
import subprocess
import sys

import pytest

from bandpo.run import worker_logs


def test_group_output_goes_to_the_groups_file(tmp_path):
    # A child process stands in for a Ray worker: it has $BANDPO_WORKER_LOG (set for Ray workers
    # only), prints before and after naming its group, and starts a grandchild after (as vLLM
    # starts its engine core), whose output must follow into the group's file.
    code = (
        "import subprocess, sys\n"
        "from bandpo.run import worker_logs\n"
        "worker_logs.redirect_worker_output()\n"
        "print('before-group', flush=True)\n"
        "worker_logs.redirect_group_output('rollout')\n"
        "print('after-group', flush=True)\n"
        "subprocess.run([sys.executable, '-c', 'print(\"grandchild\")'], check=True)\n"
    )
    env = {**os.environ, worker_logs.LOG_ENV: str(tmp_path / "ray-workers.log")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert proc.stdout == proc.stderr == ""
    assert (tmp_path / "ray-workers.log").read_text() == "before-group\n"
    assert (tmp_path / "rollout.log").read_text() == "after-group\ngrandchild\n"


def test_group_output_is_a_no_op_outside_a_ray_worker(monkeypatch, capfd):
    monkeypatch.delenv(worker_logs.LOG_ENV, raising=False)
    worker_logs.redirect_group_output("actor")
    print("still on the console")
    assert capfd.readouterr().out == "still on the console\n"


def test_unknown_group_is_refused():
    with pytest.raises(ValueError, match="rollout"):
        worker_logs.redirect_group_output("learner")


def test_env_is_absolute_and_an_unwritable_folder_falls_back_to_the_nodes_temp_dir(tmp_path, monkeypatch):
    # The driver resolves the folder: a worker on a node with another working directory opens the same path.
    monkeypatch.chdir(tmp_path)
    assert worker_logs.worker_log_env("runs/r/logs") == {
        worker_logs.LOG_ENV: str(tmp_path / "runs/r/logs/ray-workers.log")
    }
    # A node where that folder cannot be made (here: a file sits where a folder must go): the worker
    # keeps running, writes to <temp>/bandpo-logs/<run>/ and says so there and on its original stderr.
    (tmp_path / "runs").write_text("not a folder")
    code = (
        "from bandpo.run import worker_logs\n"
        "worker_logs.redirect_worker_output()\n"
        "print('before-group', flush=True)\n"
        "worker_logs.redirect_group_output('actor')\n"
        "print('after-group', flush=True)\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), **worker_logs.worker_log_env("runs/r/logs")}
    (tmp_path / "tmp").mkdir()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    fallback = tmp_path / "tmp" / "bandpo-logs" / "r"
    assert "cannot write the worker log" in proc.stderr and str(fallback / "ray-workers.log") in proc.stderr
    worker = (fallback / "ray-workers.log").read_text()
    assert worker.startswith("[bandpo] WARNING: cannot write the worker log") and worker.endswith(
        "before-group\n"
    )
    assert (fallback / "actor.log").read_text() == "after-group\n"
