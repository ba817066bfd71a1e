"""The reward verifier as Ray actors, so that grading uses every node's CPUs, not the driver's alone.

Each ``VerifierActor`` holds a ``bandpo.reward.RewardScorer`` (the killable process pool: per-item
timeout, crashed-worker retries, ``error`` / ``timeout`` / ``invalid_input`` statuses). Per call
``RayScorer.score`` splits the responses into contiguous chunks, one per actor, grades them in
parallel and concatenates the results in the input order.

A verifier actor that dies (its node lost, the OOM killer) is replaced with the same scheduling
options and its whole chunk is regraded on the replacement, so every item gets exactly the
statuses the pool would give it. A chunk whose actor dies ``MAX_ACTOR_DEATHS`` times, or a
replacement that cannot start within ``start_timeout`` seconds, raises ``VerifierFailure``:
rewards are never made up for items nobody graded.

Placement: ``verifier_actors`` actors (SPREAD over the cluster unless the caller passes one Ray
scheduling strategy per actor, e.g. the placement plan's CPU bundles) or ``"per_node"``: one on
every alive node that has CPUs (node affinity). Each reserves ``num_workers`` CPUs (its pool's
size); with ``num_workers=None`` the pool takes every CPU of its node and reserves one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from bandpo.errors import VerifierFailure
from bandpo.reward.checks import check_verifier_actors

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from bandpo.reward import RewardScheme, Score

MAX_ACTOR_DEATHS = 3


class VerifierActor:
    """One ``RewardScorer`` inside a Ray actor. ``scorer_kwargs`` go to ``RewardScorer``."""

    def __init__(self, scorer_kwargs: dict[str, Any]) -> None:
        from bandpo.run.worker_logs import redirect_group_output

        redirect_group_output("verifier")
        from bandpo.reward import RewardScorer

        self.scorer = RewardScorer(**scorer_kwargs)

    def ready(self) -> tuple[str, int]:
        """(Ray node id, process id) once started."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def score(self, responses: list, answers: list, response_lengths: list[int] | None) -> list[Score]:
        return self.scorer.score(responses, answers, response_lengths)

    def close(self) -> None:
        self.scorer.close()


def per_node_strategies() -> list:
    """One hard node-affinity strategy for every alive node with CPUs (``verifier_actors=per_node``)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]
    if not nodes:
        raise VerifierFailure("trainer.verifier_actors=per_node: the Ray cluster has no alive node with CPUs")
    return [NodeAffinitySchedulingStrategy(node, soft=False) for node in nodes]


def spawn_verifiers(
    strategies: Sequence[Any],
    scorer_kwargs: dict[str, Any],
    *,
    num_cpus: float = 1,
    start_timeout: float = 120.0,
) -> list[ActorHandle]:
    """Start one ``VerifierActor`` per scheduling strategy (``"SPREAD"``, a node-affinity or a
    placement-group strategy) and wait until every one is up; Ray must be initialised."""
    import ray

    remote = ray.remote(VerifierActor)
    actors = [
        remote.options(num_cpus=num_cpus, scheduling_strategy=s).remote(scorer_kwargs) for s in strategies
    ]
    ready, waiting = ray.wait(
        [a.ready.remote() for a in actors], num_returns=len(actors), timeout=start_timeout
    )
    if waiting:
        for a in actors:
            ray.kill(a)
        raise VerifierFailure(
            f"{len(waiting)} of {len(actors)} verifier actors did not start within "
            f"{start_timeout:.0f} s (each needs num_cpus={num_cpus}: trainer.verifier_workers)"
        )
    try:
        ray.get(ready)
    except Exception as e:
        for a in actors:
            ray.kill(a)
        raise VerifierFailure(f"a verifier actor failed to start: {e}") from e
    return actors


class RayScorer:
    """``RewardScorer``'s ``score`` / ``close`` interface over verifier actors (module docstring).

    Args:
        scheme, answer_format, num_workers, timeout: as for ``RewardScorer`` (per actor).
        actors: how many verifier actors (SPREAD), or ``"per_node"``.
        strategies: one Ray scheduling strategy per actor (overrides ``actors``' placement).
        start_timeout: seconds an actor (or its replacement) may take to start.
        memory_cap_gib: address-space cap of each grading process (``RewardScorer``); None = its default.
    """

    def __init__(
        self,
        scheme: RewardScheme | None = None,
        answer_format: str = "auto",
        num_workers: int | None = None,
        timeout: float = 5.0,
        *,
        actors: int | str = 1,
        strategies: Sequence[Any] | None = None,
        start_timeout: float = 120.0,
        memory_cap_gib: float | None = None,
    ) -> None:
        from bandpo.reward import RewardScheme

        if strategies is None:
            if actors == "per_node":
                strategies = per_node_strategies()
            else:
                check_verifier_actors(actors, "verifier actors")
                strategies = ["SPREAD"] * actors
        self.scheme = scheme if scheme is not None else RewardScheme()
        self.kwargs = dict(
            scheme=self.scheme, answer_format=answer_format, num_workers=num_workers, timeout=timeout
        )
        if memory_cap_gib is not None:
            self.kwargs["memory_cap_gib"] = memory_cap_gib
        self.strategies = list(strategies)
        self.num_cpus = num_workers or 1
        self.start_timeout = start_timeout
        self.replaced = 0  # verifier actors replaced after dying (for logs and tests)
        self.actors = spawn_verifiers(
            self.strategies, self.kwargs, num_cpus=self.num_cpus, start_timeout=start_timeout
        )

    def score(
        self, responses: Sequence, answers: Sequence, response_lengths: Sequence[int] | None = None
    ) -> list[Score]:
        """Grade ``responses[i]`` against ``answers[i]``; one ``Score`` per item, in order."""
        import ray
        from ray.exceptions import RayActorError

        from bandpo.reward.scheme import check_score_inputs
        from bandpo.split import split_evenly

        n = check_score_inputs(self.scheme, responses, answers, response_lengths)
        if self.actors is None:
            raise RuntimeError("RayScorer is closed")
        chunks = [(j, s, e) for j, (s, e) in enumerate(split_evenly(n, len(self.actors))) if s < e]
        lengths = None if response_lengths is None else [int(x) for x in response_lengths]

        def submit(j: int, s: int, e: int):
            return self.actors[j].score.remote(
                list(responses[s:e]), list(answers[s:e]), None if lengths is None else lengths[s:e]
            )

        pending = {submit(*c): c for c in chunks}
        results: dict[int, list[Score]] = {}
        deaths = dict.fromkeys(range(len(self.actors)), 0)
        while pending:
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            j, s, e = pending.pop(ref)
            try:
                results[j] = ray.get(ref)
            except RayActorError as err:
                deaths[j] += 1
                if deaths[j] >= MAX_ACTOR_DEATHS:
                    raise VerifierFailure(
                        f"verifier actor {j} died {deaths[j]} times grading items {s}..{e - 1}: {err}"
                    ) from err
                self._replace(j)
                pending[submit(j, s, e)] = (j, s, e)
        return [score for j, _, _ in chunks for score in results[j]]

    def _replace(self, j: int) -> None:
        import ray

        ray.kill(self.actors[j])
        self.actors[j] = spawn_verifiers(
            [self.strategies[j]], self.kwargs, num_cpus=self.num_cpus, start_timeout=self.start_timeout
        )[0]
        self.replaced += 1

    def close(self) -> None:
        """Stop the actors' pools, then the actors (a dead one is skipped). The scorer cannot be used afterwards."""
        import ray

        actors, self.actors = self.actors, None
        if not actors or not ray.is_initialized():
            return
        ray.wait([a.close.remote() for a in actors], num_returns=len(actors), timeout=15.0)
        for a in actors:
            ray.kill(a)
