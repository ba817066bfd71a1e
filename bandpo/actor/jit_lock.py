"""A lock left by a killed build of DeepSpeed's CPU communication op must not hang a rank forever.

On CPU, ``deepspeed.init_distributed`` builds its ``deepspeed_shm_comm`` op just in time
(``torch.utils.cpp_extension``): the first process to get there creates ``lock`` in the op's build
folder, compiles, and removes it; every other process waits, without a timeout, for the file to go.
A build killed midway (a run stopped during its first start-up) leaves the file behind, and every
later rank then waits in ``Actor.__init__`` for ever. ``wait_for_build`` waits for such a lock
itself: another rank's build ends well within the limit, and a lock that outlives it is an error
naming the file.
"""

from __future__ import annotations

import time
from pathlib import Path

SHM_OP = "deepspeed_shm_comm"
BUILD_TIMEOUT_S = 900.0  # a build takes 1-3 min on 2 loaded cores


def build_lock(name: str = SHM_OP) -> Path:
    """The lock file of torch's extension build folder for ``name`` ($TORCH_EXTENSIONS_DIR or its default)."""
    # torch's own resolution of the folder (the Python / CUDA tags below the root), so the path is the one
    # its build waits on; private, but stable since torch 1.x
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False)) / "lock"


def wait_for_build(
    name: str = SHM_OP, timeout_s: float = BUILD_TIMEOUT_S, poll_s: float = 0.1, clock=time.monotonic
) -> None:
    """Return once no build of ``name`` holds its lock; a ``RuntimeError`` naming the lock file when the
    same lock (one file: its inode and time) has stayed ``timeout_s`` (a killed build's leftover:
    removing it lets the next start build). Builds of other processes one after another each make a
    new lock, so they restart the wait; ``poll_s`` is torch's own."""
    lock = build_lock(name)
    seen, start = None, clock()
    while True:
        try:
            st = lock.stat()
        except FileNotFoundError:
            return
        if (st.st_ino, st.st_mtime_ns) != seen:
            seen, start = (st.st_ino, st.st_mtime_ns), clock()
        elif clock() - start >= timeout_s:
            raise RuntimeError(
                f"{lock} has been there for {timeout_s:.0f} s: a build of DeepSpeed's {name} op that was "
                f"killed midway left it, and torch would wait for it for ever; remove it "
                f"(rm {lock}) and start again"
            )
        time.sleep(poll_s)
