"""Bounded start-up of the worker groups: the actor ranks and the rollout engines are built in the
background (``ActorGroup`` / ``RolloutGroup``) and waited for within ``trainer.startup_timeout``.

The wait that used to be a bare ``ray.get`` is where a multi-node run without its NCCL variables
hangs: DeepSpeed's first collective is the broadcast in ``deepspeed.initialize``, inside every actor
rank's constructor, and NCCL on a network the nodes do not share waits for
``actor.collective_timeout_min`` (an hour) before failing. NCCL_SOCKET_IFNAME / NCCL_IB_HCA are each
node's own (``bandpo.distributed.PER_NODE``: never forwarded), so they must be exported before that
node's ``ray start``. On timeout the error names the workers that had not answered, and those that had.
"""

from __future__ import annotations

import time

from bandpo.errors import StartupTimeout

DEFAULT_STARTUP_TIMEOUT_S = 1800.0  # trainer.startup_timeout's default
KEY = "trainer.startup_timeout"
NCCL_HINT = (
    "NCCL_SOCKET_IFNAME / NCCL_IB_HCA must be exported on each node before its `ray start` (each node's "
    "own: bandpo does not forward them), naming the network the nodes share; NCCL_DEBUG=INFO shows what "
    "NCCL picked"
)
ACTOR_HINT = (
    "DeepSpeed's first collective, the broadcast in deepspeed.initialize, waits for every rank: when the "
    f"ranks span nodes, {NCCL_HINT}. See the run's logs/actor.log; {KEY} sets the limit"
)
ENGINE_HINT = (
    "an engine loads its model, compiles and captures CUDA graphs at start: see the run's logs/rollout.log. "
    f"An engine over several GPUs (rollout.tensor_parallel_size > 1) also needs NCCL: {NCCL_HINT}; "
    f"{KEY} sets the limit"
)


def wait_started(
    refs: list, names: list[str], started: float, timeout_s: float, what: str, hint: str
) -> list:
    """``ray.get(refs)`` within ``timeout_s`` of ``started`` (``time.monotonic()`` when the workers were
    started); the first failure among them is raised at once (the others may be waiting for it).

    Past the limit, ``StartupTimeout``: ``what`` (e.g. "the actor ranks"), the ``names`` (one per ref)
    that had not answered and those that had, and ``hint``.
    """
    import ray

    deadline = started + timeout_s
    pending = list(refs)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            late = [n for n, r in zip(names, refs) if r in pending]
            done = [n for n, r in zip(names, refs) if r not in pending]
            raise StartupTimeout(
                f"start-up: {', '.join(late)} of {what} did not answer within {timeout_s:g} s of their start "
                f"({'; '.join(done) + ' did' if done else 'none did'}): {hint}"
            )
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in ready:
            ray.get(ref)  # raises a constructor's failure
    return ray.get(list(refs))
