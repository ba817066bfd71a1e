"""Where the workers' output goes: ``<run>/logs/`` by default, the console with ``trainer.verbose=true``.

The console of a run is bandpo's own lines (config summary, plan, per-step line, eval table,
summary) and warnings that need action. Everything the workers print (vLLM's and Ray's
start-up chatter, DeepSpeed, tracebacks of a dying worker) is kept, one file per worker group:

- ``rollout.log``: the vLLM rollout engines (``bandpo.rollout.vllm_engine``) and the
  processes they start (vLLM's engine core);
- ``actor.log``: the DeepSpeed actor ranks (``bandpo.actor.worker``);
- ``verifier.log``: the reward pool's worker processes (``bandpo.reward.pool``) and the Ray
  verifier actors that hold them (``bandpo.reward.ray_scorer``);
- ``ray-workers.log``: everything else a Ray worker prints: its own start-up before it
  knows its group, and workers that are not one of ours (e.g. the extra ranks of a
  tensor-parallel vLLM engine, which vLLM starts itself).

How: Ray runs ``redirect_worker_output`` in every worker before anything else
(``worker_process_setup_hook``; the driver stops streaming worker output), which points the
process at ``ray-workers.log``; the first line of each group's actor ``__init__`` calls
``redirect_group_output(group)``, which re-points it, and the children it starts later, at
the group's file. The hook's environment variable only exists in Ray workers, so the same
classes used in-process (tests, evaluation) leave the console alone.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

LOG_ENV = "BANDPO_WORKER_LOG"
GROUPS = ("rollout", "actor", "verifier")
SETUP_HOOK = "bandpo.run.worker_logs.redirect_worker_output"


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
    sys.stdout.flush()
    sys.stderr.flush()
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


def redirect_group_output(group: str) -> None:
    """In a Ray worker started by ``init_ray``: send its output to ``<logs>/<group>.log``.

    A no-op outside such a worker (no ``$BANDPO_WORKER_LOG``), e.g. an engine made in-process.
    """
    if group not in GROUPS:
        raise ValueError(f"log group must be one of {GROUPS}, got {group!r}")
    path = os.environ.get(LOG_ENV)
    if path:
        redirect_output(os.path.join(os.path.dirname(path), f"{group}.log"))
