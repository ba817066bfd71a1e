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

On other nodes: the driver resolves the folder to an absolute path (a raylet started by ``ray
start`` elsewhere has another working directory) and each worker creates it on its own node.
Where that folder cannot be made or opened there (another user's home, a read-only mount), the
worker writes to ``<node temp dir>/bandpo-logs/<run>/`` instead and says so in its first line
and on its original stderr (Ray's own worker log on that node): a log folder is worth a
warning, not every worker of a node, which is what a failing setup hook costs (Ray drains the
worker, vLLM's own workers included).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

LOG_ENV = "BANDPO_WORKER_LOG"
GROUPS = ("rollout", "actor", "verifier")
SETUP_HOOK = "bandpo.run.worker_logs.redirect_worker_output"


def setup_run_logs(run_dir: Path, verbose: bool) -> Path | None:
    """Create ``<run>/logs`` (absolute) and say where the worker output goes; None when it stays on the console."""
    if verbose:
        return None
    logs = Path(run_dir).resolve() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(
        f"[bandpo] worker logs: {logs}/ on every node (where a node cannot write there: "
        f"{fallback_dir(logs)}/; trainer.verbose=true shows them on the console)",
        flush=True,
    )
    return logs


def worker_log_env(logs_dir: str | os.PathLike) -> dict[str, str]:
    """The Ray workers' environment for ``logs_dir``: ``$BANDPO_WORKER_LOG``, absolute (resolved here, on the driver)."""
    return {LOG_ENV: os.path.join(os.path.abspath(logs_dir), "ray-workers.log")}


def fallback_dir(logs_dir: str | os.PathLike) -> str:
    """Where a node that cannot write ``logs_dir`` keeps its workers' logs: its temp dir, per run (``<run>/logs``)."""
    run = os.path.basename(os.path.dirname(os.path.abspath(logs_dir))) or "run"
    return os.path.join(tempfile.gettempdir(), "bandpo-logs", run)


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


def _redirect_to_log(path: str) -> None:
    """``redirect_output(path)``, creating its folder; on failure the node's ``fallback_dir``, with a warning.

    Never raises: in Ray's setup hook an exception would take the worker down. When not even the
    fallback can be opened the output stays where Ray puts it (its own per-worker log files).
    """
    folder, name = os.path.split(path)
    try:
        os.makedirs(folder, exist_ok=True)
        redirect_output(path)
        return
    except OSError as e:
        reason = f"{type(e).__name__}: {e}"
    fallback = os.path.join(fallback_dir(folder), name)
    warning = (
        f"[bandpo] WARNING: cannot write the worker log {path} on this node ({reason}); "
        f"this worker's output goes to {fallback}"
    )
    print(warning, file=sys.stderr, flush=True)  # Ray's own worker log on this node
    try:
        os.makedirs(os.path.dirname(fallback), exist_ok=True)
        redirect_output(fallback)
    except OSError as e:
        print(
            f"[bandpo] WARNING: cannot write {fallback} either ({e}); output stays in Ray's worker logs",
            file=sys.stderr,
            flush=True,
        )
        return
    os.environ[LOG_ENV] = os.path.join(os.path.dirname(fallback), "ray-workers.log")  # group files follow
    print(warning, file=sys.stderr, flush=True)


def redirect_worker_output() -> None:
    """Ray's ``worker_process_setup_hook``: send the worker's output to ``$BANDPO_WORKER_LOG``."""
    path = os.environ.get(LOG_ENV)
    if path:
        _redirect_to_log(path)


def redirect_group_output(group: str) -> None:
    """In a Ray worker started by ``init_ray``: send its output to ``<logs>/<group>.log``.

    A no-op outside such a worker (no ``$BANDPO_WORKER_LOG``), e.g. an engine made in-process.
    """
    if group not in GROUPS:
        raise ValueError(f"log group must be one of {GROUPS}, got {group!r}")
    path = os.environ.get(LOG_ENV)
    if path:
        _redirect_to_log(os.path.join(os.path.dirname(path), f"{group}.log"))
