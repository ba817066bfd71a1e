"""The rollout engines as one group of Ray actors, as ``bandpo.actor.ActorGroup`` is the actor ranks.

Generation is data-parallel over the engines (``generate_on_workers``: contiguous prompt
chunks, seeds offset so the result equals one engine's). In the colocated GPU layout the
engines sleep while the actor computes (vLLM sleep level 1: weights to host memory, KV
cache freed; level 2, ``rollout.sleep_level``: weights dropped) and wake in two steps around
the weight sync. At level 2 an engine wakes with its weight memory uninitialised, so every wake
must load the actor's weights, even after a step that left them unchanged (``drops_weights``).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from bandpo.distributed.startup import DEFAULT_STARTUP_TIMEOUT_S, ENGINE_HINT, wait_started
from bandpo.rollout.worker import generate_on_workers, spawn_rollout_workers
from bandpo.types import RolloutBatch, SamplingParams


class RolloutGroup:
    """``k`` rollout engines (``bandpo.rollout.worker.RolloutWorker``), one Ray actor each.

    Construction starts them in the background (``wait_ready`` blocks until every engine is
    up, for at most ``startup_timeout_s`` from construction: ``trainer.startup_timeout``); ``sleeps`` says whether ``sleep`` / ``wake`` really sleep the engines (vLLM's sleep
    mode in the colocated GPU layout) or only run the weight load. The other arguments are
    ``spawn_rollout_workers``'s. ``workers`` are the actor handles (the weight sync loads into them).
    ``drops_weights``: the engines sleep at level 2 (``sleep_level`` in the engine kwargs), so every
    ``wake`` needs a weight load.
    """

    drops_weights = False

    def __init__(
        self,
        k: int,
        backend: str,
        model_path: str,
        *,
        sleeps: bool = False,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        **spawn_kwargs: Any,
    ):
        self.sleeps = sleeps
        self.drops_weights = sleeps and spawn_kwargs.get("sleep_level", 1) == 2
        self.workers = spawn_rollout_workers(k, backend, model_path, wait=False, **spawn_kwargs)
        self._ready = [w.ready.remote() for w in self.workers]
        self._started, self.startup_timeout_s = time.monotonic(), startup_timeout_s

    def wait_ready(self) -> None:
        """Block until every engine is built; raises the first constructor error (Ray's ``RayActorError``),
        and ``StartupTimeout`` naming the engines still starting ``startup_timeout_s`` after construction."""
        if self._ready:
            names = [f"rollout engine {i}" for i in range(len(self._ready))]
            wait_started(
                self._ready, names, self._started, self.startup_timeout_s, "the rollout engines", ENGINE_HINT
            )
            self._ready = []

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        """Sample ``sampling.n`` responses per prompt over all engines (a ``RolloutEngine`` for evaluation too)."""
        return generate_on_workers(self.workers, prompt_token_ids, sampling)

    def call(self, method: str, *args) -> list:
        """``method(*args)`` on every engine at once; results in worker order."""
        import ray

        return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    def sleep(self) -> None:
        """Free the GPUs for the actor's stages (sleep mode only; otherwise nothing to do)."""
        if self.sleeps:
            self.call("sleep")

    def wake_weights(self, load: bool) -> None:
        """Stage 7's first call: the engines' weights back on the GPU (sleep mode only), before the actor's
        are loaded into them (``load``). Engines that dropped their weights (sleep level 2) refuse to
        wake without a load."""
        if self.drops_weights and not load:
            raise ValueError(
                "RolloutGroup.wake_weights: the engines sleep at level 2 (rollout.sleep_level=2) and hold "
                "no weights; wake them with the actor's weights (load=True)"
            )
        if self.sleeps:
            self.call("wake_up", ["weights"])

    def wake_kv_cache(self) -> None:
        """Stage 7's last call: the KV cache back (sleep mode only), once the sync's buffers are gone
        (verl / OpenRLHF order)."""
        if self.sleeps:
            self.call("wake_up", ["kv_cache"])

    def stop(self, timeout_s: float = 10.0) -> None:
        """Shut the engines down before Ray kills their processes.

        vLLM removes its shared-memory message queue (a /dev/shm file per engine) only in its own
        shutdown; a process killed by ``ray.shutdown`` leaves it behind. Best effort: a dead or
        busy worker (Ctrl-C mid-rollout) must not hold up the exit for more than ``timeout_s``.
        """
        import ray

        refs = [w.shutdown.remote() for w in self.workers]  # a dead actor's call fails at ray.get, below
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:  # died earlier: the failure was reported then
                pass
            except Exception as e:  # reported, not raised: the run's result stands
                print(
                    f"[bandpo] a rollout engine failed to shut down cleanly: {e}", file=sys.stderr, flush=True
                )
