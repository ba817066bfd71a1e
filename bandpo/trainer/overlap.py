"""Rollout/training overlap (``trainer.max_staleness``): the next step's stages 1-3 in the background.

With ``max_staleness=1`` step t starts one background stage, the engines generating and the
verifier grading batch t+1 with the weights they hold (the actor's after step t-1), while
the actor trains on batch t (which the weights after step t-2 generated); the stage is
joined before the weight sync that gives the engines the weights of step t. One
background thread on the driver runs the same ``Rollouts.draw`` as the synchronous loop:
it only waits on Ray calls (engines, verifier actors) and decodes, so the GIL is free for
the actor's Ray calls on the main thread.

Why one step and not more: the behaviour policy is then at most one update older than the
proximal policy, which the truncated importance weight corrects (``bandpo.algo.losses``;
``algorithm.tis_cap``, on by default here: ``STALE_TIS_CAP``).

Layouts: the split GPU layout (engines and actor ranks on disjoint GPUs) and CPU overlap;
the colocated GPU layout cannot (the engines sleep while the actor holds the GPUs) and is
refused before any worker starts (``check_layout``). On CPU the cores are divided between
the engines and the actor ranks while they overlap (``cpu_threads``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bandpo.errors import ConfigError

# w = min(pi_old / pi_rollout, C) under staleness when algorithm.tis_cap is null: C = 2 is the
# cap verl recommends for its rollout/training mismatch correction (``tis_imp_ratio_cap``).
STALE_TIS_CAP = 2.0
MAX_STALENESS = (0, 1)


def check_layout(max_staleness: int, layout: str) -> None:
    """Refuse overlap where the engines and the actor share the devices in time (``colocated``)."""
    if max_staleness > 0 and layout == "colocated":
        raise ConfigError(
            f"config error: trainer.max_staleness={max_staleness} needs the engines and the actor on separate "
            f"GPUs: the colocated layout time-shares them (the engines sleep during the update). Set actor.gpus "
            f"and rollout.gpus (split layout) or trainer.max_staleness=0")


def cpu_threads(cores: int, engines: int, ranks: int, max_staleness: int, engine_threads: int | None,
                actor_threads: int | None) -> tuple[int, int | None]:
    """(threads per engine, threads per actor rank or None for the rank's own default) on CPU.

    Synchronous, the engines and the actor take turns, so each side has every core
    (``rollout.cpu_threads`` / ``actor.cpu_threads`` null). Overlapped, they run at once:
    null gives the engines half the cores (at least one thread each) and the actor ranks the rest.
    """
    if not max_staleness:
        return engine_threads or max(1, cores // engines), actor_threads
    engine = engine_threads or max(1, (cores // 2) // engines)
    actor = actor_threads or max(1, (cores - engine * engines) // ranks)
    return engine, actor


@dataclass
class InFlight:
    """A batch drawn ahead of its step: which step trains on it and which weights generated it."""

    step: int  # the step that trains on it
    version: int  # the engines' weights: those after this step's update (0: the initial model)
    drawn: Any  # bandpo.trainer.dynamic_sampling.Drawn


class Background:
    """``fn()`` in a daemon thread from now on; ``join`` waits for its result (re-raising its error).

    Daemon: a run that stops (an error, Ctrl-C) while it waits on an engine exits without it
    (``Trainer.close`` shuts Ray down, which fails the pending call).
    """

    def __init__(self, fn: Callable[[], Any], name: str):
        self.started = time.perf_counter()
        self.ended: float | None = None
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._result = fn()
        except BaseException as e:  # handed to the joining thread
            self._error = e
        finally:
            self.ended = time.perf_counter()

    def join(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result

    @property
    def interval(self) -> tuple[float, float]:
        """(start, end) in ``time.perf_counter`` seconds (after ``join``)."""
        return self.started, self.ended if self.ended is not None else time.perf_counter()


def overlap_seconds(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Seconds two (start, end) intervals share."""
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))
