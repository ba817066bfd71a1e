"""Where the workers' output goes: ``<run>/logs/`` by default, the console with ``trainer.verbose=true``.

The console of a run is bandpo's own lines (config summary, plan, per-step line, eval table,
summary) and warnings that need action. Everything the workers print (vLLM's and Ray's
start-up chatter, DeepSpeed, tracebacks of a dying worker) is kept, one file per group:

- ``ray-workers.log``: every Ray worker process (vLLM rollout engines, DeepSpeed actor
  ranks): Ray runs ``redirect_worker_output`` in each worker before anything else
  (``worker_process_setup_hook``) and stops streaming worker output to the driver;
- ``verifier.log``: the reward pool's worker processes (``bandpo.reward.pool``).
"""

from __future__ import annotations

import os
from pathlib import Path

LOG_ENV = "BANDPO_WORKER_LOG"
SETUP_HOOK = "bandpo.run_logs.redirect_worker_output"


def setup_run_logs(run_dir: Path, verbose: bool) -> Path | None:
    """Create ``<run>/logs`` and say where the worker output goes; None when it stays on the console."""
    if verbose:
        return None
    logs = Path(run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"[bandpo] worker logs: {logs}/ (trainer.verbose=true shows them on the console)", flush=True)
    return logs


def redirect_output(path: str | os.PathLike) -> None:
    """Point this process's stdout and stderr (the file descriptors: C and child output too) at ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)


def redirect_worker_output() -> None:
    """Ray's ``worker_process_setup_hook``: send the worker's output to ``$BANDPO_WORKER_LOG``."""
    path = os.environ.get(LOG_ENV)
    if path:
        redirect_output(path)
