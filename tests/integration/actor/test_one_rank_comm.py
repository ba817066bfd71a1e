"""One CPU actor rank joins its process group without DeepSpeed's shared-memory all-reduce op: it has
no peer to reduce with, and the op's just-in-time build is most of a fresh machine's start-up."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

CHILD = """
import torch.distributed as dist
import deepspeed.comm.comm as ds_comm
from bandpo.actor.setup import init_distributed
from bandpo.actor.jit_lock import build_lock
init_distributed(0, {world}, 0, "127.0.0.1", None if {world} == 1 else {port}, "gloo")
print("RESULT", dist.get_world_size(), ds_comm.cdb.shm_comm_op is None, sorted(p.name for p in build_lock().parent.iterdir()))
"""


def _run(world: int, tmp_path) -> str:
    env = dict(os.environ, DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    code = CHILD.format(world=world, port=29591)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return next(line for line in out.stdout.splitlines() if line.startswith("RESULT"))


def test_one_cpu_rank_builds_no_shm_op(tmp_path):
    # an empty extensions folder: a build would have left its files (build.ninja, the .so) in the
    # op's folder, which torch's folder lookup creates empty
    assert _run(1, tmp_path) == "RESULT 1 True []"
