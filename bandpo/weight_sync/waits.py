"""Bounded waits of the weight sync (ipc, nccl, the LoRA adapter): each ends in an error naming its stage.

A misconfigured fabric (NCCL on the wrong network interface, a firewalled port) or an engine
that died mid-sync would otherwise leave ``ray.get`` or a NCCL call waiting forever. ``get_within``
bounds a wait on Ray objects (and on this process's own side of the stage, ``alongside``);
``InThread`` / ``run_within`` bound a blocking call of this process by running it in a thread (a
NCCL call cannot be interrupted: on timeout the thread is left behind, and the run ends with the
error, which takes the process with it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from bandpo.errors import WeightSyncTimeout

DEFAULT_TIMEOUT_S = 300.0  # rollout.weight_sync_timeout's default
NCCL_HINT = (
    "check that the engines' nodes reach {address}:{port} and that NCCL_SOCKET_IFNAME / NCCL_IB_HCA, "
    "set on each node before its `ray start`, name the network the nodes share (NCCL_DEBUG=INFO shows "
    "what NCCL picked); "
    "rollout.weight_sync_timeout sets the limit"
)
POLL_S = 0.5  # how often a wait on engines looks at this process's own side running alongside
ENGINE_HINT = (
    "an engine is stuck or gone: see the run's logs/rollout.log; rollout.weight_sync_timeout sets the limit"
)
ACTOR_HINT = (
    "an actor rank is stuck or gone: see the run's logs/actor.log; rollout.weight_sync_timeout sets the limit"
)


def timeout_error(what: str, timeout_s: float, hint: str = "") -> WeightSyncTimeout:
    return WeightSyncTimeout(
        f"weight sync: {what} did not finish within {timeout_s:g} s" + (f" ({hint})" if hint else "")
    )


def get_within(
    refs: list,
    timeout_s: float,
    what: str,
    hint: str = "",
    *,
    alongside: InThread | None = None,
    names: list[str] | None = None,
) -> list:
    """``ray.get(refs)``, or ``WeightSyncTimeout`` naming ``what`` when it takes over ``timeout_s``.

    The first failure among ``refs`` (an engine's error or death) is raised at once, not once the
    others are done: they may be waiting for the one that failed. ``alongside``: this process's own
    side of the stage, running meanwhile; its failure ends the wait too, and its result is waited
    for within the same limit (returned after the refs' values). ``names`` (one per ref, e.g.
    "rollout engine 1"): the timeout names those that had not answered.
    """
    import ray

    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending or (alongside is not None and not alongside.done()):
        left = deadline - time.monotonic()
        if left <= 0:
            if names is not None and pending:
                late = [n for n, r in zip(names, refs) if r in pending]
                what = f"{what} ({', '.join(late)} had not answered)"
            raise timeout_error(what, timeout_s, hint)
        if alongside is not None and alongside.done():
            alongside.result()  # raises its failure
        poll = left if alongside is None else min(left, POLL_S)
        if pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=poll)
            for ref in ready:
                ray.get(ref)  # raises the failure
        else:
            alongside.wait(poll)
    values = ray.get(list(refs))
    return values if alongside is None else [*values, alongside.result()]


class InThread:
    """``fn()`` running in a daemon thread from construction on; ``result`` waits for it, bounded."""

    def __init__(self, fn: Callable[[], Any], what: str) -> None:
        self.what, self.box = what, {}

        def target() -> None:
            try:
                self.box["value"] = fn()
            except BaseException as e:  # handed to the caller's thread, re-raised there
                self.box["error"] = e

        self.thread = threading.Thread(target=target, name=f"weight sync: {what}", daemon=True)
        self.thread.start()

    def done(self) -> bool:
        return not self.thread.is_alive()

    def wait(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)

    def result(self, timeout_s: float = 0.0, hint: str = "") -> Any:
        """Its value or its exception; ``WeightSyncTimeout`` naming it when it runs past ``timeout_s``."""
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise timeout_error(self.what, timeout_s, hint)
        if "error" in self.box:
            raise self.box["error"]
        return self.box.get("value")


def run_within(fn: Callable[[], Any], timeout_s: float, what: str, hint: str = "") -> Any:
    """``fn()`` in a daemon thread: its result, its exception, or ``WeightSyncTimeout`` naming ``what``."""
    return InThread(fn, what).result(timeout_s, hint)
