"""The verifier's settings and its error share, each checked once: by the reward pool
(``bandpo.reward.pool``), the Ray scorer (``bandpo.reward.ray_scorer``) and the trainer where
they take them, and by config validation before any worker starts (``bandpo.config.rules``,
which names the config key).

Imports nothing but ``bandpo.errors``: config validation must run where the verifier's own
dependencies (pebble, math-verify) are not installed, e.g. a GPU machine that only trains.
"""

from __future__ import annotations

from collections.abc import Sequence

from bandpo.errors import VerifierUnavailable, check_number


def check_verifier_actors(actors, name: str = "actors") -> None:
    """How many verifier actors: an integer >= 1, or ``per_node`` (one on every node with CPUs)."""
    if actors != "per_node" and (not isinstance(actors, int) or isinstance(actors, bool) or actors < 1):
        raise ValueError(f"{name} must be an integer >= 1 or per_node, got {actors!r}")


def check_verifier_workers(num_workers, name: str = "num_workers") -> None:
    """Grading processes of one pool: None (the node's CPUs) or an integer >= 1."""
    if num_workers is not None:
        check_number(num_workers, name, low=1, integer=True)


def check_memory_cap(memory_cap_gib, name: str = "memory_cap_gib") -> None:
    """Address-space cap of each grading process, in GiB: None (no cap) or a number > 0."""
    if memory_cap_gib is not None:
        check_number(memory_cap_gib, name, low=0, strict_low=True)


def check_error_share(statuses: Sequence[str], max_error_share: float, what: str = "a batch") -> None:
    """Raise ``VerifierUnavailable`` when more than ``max_error_share`` of ``statuses`` are ``error``.

    One response may break the grader (``error``); most of a batch failing means the
    verifier itself is broken, and training on those rewards would learn nothing.
    """
    errors = sum(s == "error" for s in statuses)
    if statuses and errors > max_error_share * len(statuses):
        raise VerifierUnavailable(
            f"the verifier (math-verify reward pool) failed on {errors} of {len(statuses)} responses of {what} "
            f"(status 'error'; more than trainer.max_error_share={max_error_share}); see the warnings above "
            f"and <run>/logs/verifier.log"
        )
