"""Reward-pool worker start-up, and telling a broken verifier from a bad response.

``init_worker`` is what every pool worker runs first (output to the run's log, an
address-space cap, the parser warm-up). ``check_workers_start`` runs it in one worker
started by hand and turns any failure into ``VerifierUnavailable`` carrying the worker's
cause; ``check_error_share`` is the training loop's guard against a batch graded mostly
``error``. See ``bandpo.reward.pool`` for when the scorer calls them.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback

from bandpo.errors import VerifierUnavailable
from bandpo.reward.verify import verify_one

STARTUP_TIMEOUT_S = 120.0  # a fresh fork server imports sympy and math-verify (~2 s; slow shared nodes)
DEFAULT_MEMORY_CAP_GIB = 4.0  # a worker uses ~0.1-0.5 GiB of address space (sympy, ANTLR, math-verify)


def init_worker(memory_cap_bytes: int | None = None, log_path: str | None = None) -> str:
    """Worker start-up: send output to ``log_path``, make SIGTERM immediate, cap memory, warm the parser.

    Runs before the worker takes its first task, so the ~0.3 s parser warm-up never
    counts against an item's timeout. Returns the warm-up's grade (``correct`` when the
    grader works).
    """
    if log_path:
        from bandpo.run.worker_logs import redirect_output

        redirect_output(log_path)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if memory_cap_bytes:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        cap = memory_cap_bytes if hard == resource.RLIM_INFINITY else min(memory_cap_bytes, hard)
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    return verify_one("Answer: $\\frac{1}{2}$", "0.5", "auto")[0]


def _startup_check(conn, memory_cap_bytes: int | None, log_path: str | None) -> None:
    """Run in one hand-started worker: its start-up and one grade, reported through ``conn``."""
    try:
        conn.send(("ok", init_worker(memory_cap_bytes, log_path)))
    except BaseException:
        conn.send(("failed", traceback.format_exc()))


def check_workers_start(
    ctx, memory_cap_bytes: int | None, log_path: str | None = None, timeout: float = STARTUP_TIMEOUT_S
) -> None:
    """Start one worker as the pool would; raise ``VerifierUnavailable`` with its cause if it fails.

    A check worker killed by a signal is tried once more: a signal can come from outside
    (an OOM kill of the whole pool, an operator) and says nothing about the next start.
    """
    try:
        _check_once(ctx, memory_cap_bytes, log_path, timeout)
    except _KilledCheck:
        try:
            _check_once(ctx, memory_cap_bytes, log_path, timeout)
        except _KilledCheck as e:
            raise VerifierUnavailable(str(e)) from None


class _KilledCheck(VerifierUnavailable):
    """The check worker ended by a signal before reporting."""


def _check_once(ctx, memory_cap_bytes: int | None, log_path: str | None, timeout: float) -> None:
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_startup_check, args=(sender, memory_cap_bytes, log_path), daemon=True)
    try:
        proc.start()
    except Exception as e:
        raise VerifierUnavailable(f"reward pool: cannot start a worker process: {e!r}") from e
    sender.close()
    report, waited_out = None, False
    try:
        if receiver.poll(timeout):  # also True when the worker died (end of file)
            report = receiver.recv()
        else:
            waited_out = True
    except (EOFError, OSError):
        pass
    finally:
        receiver.close()
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if report is None:
        how = (
            f"did not finish its start-up in {timeout:.0f} s"
            if waited_out
            else f"exited with code {proc.exitcode} before finishing its start-up"
        )
        where = log_path or "above"
        error = (
            _KilledCheck
            if proc.exitcode is not None and proc.exitcode < 0 and not waited_out
            else VerifierUnavailable
        )
        raise error(
            f"reward pool: a worker process {how} (its error output, {where}, has the cause){_main_hint()}"
        )
    kind, detail = report
    if kind == "failed":
        raise VerifierUnavailable(f"reward pool: a worker failed at start-up:\n{detail}")
    if detail != "correct":
        raise VerifierUnavailable(
            f"reward pool: a worker's start-up check graded a known-correct answer "
            f"{detail!r} (memory_cap_gib too low, or the grader is broken)"
        )


def _main_hint() -> str:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path and not os.path.exists(path):
        return f"; workers import the program's __main__, and {path!r} is no file they can import"
    return ""
