"""Bounded start-up waits on real Ray actors (a local instance): an actor rank or engine whose constructor
never returns (a rank left in DeepSpeed's first broadcast) ends ``wait_ready`` in an error naming it and
the NCCL variables to export before `ray start`, after a tiny limit; a constructor that fails ends it at
once. The groups are built around stand-in workers (the wait, not the model, is under test). No timed
assertions: the limits are what end the tests, the pytest timeout what ends the old unbounded wait."""

from __future__ import annotations

import threading
import time

import pytest

from bandpo.actor.group import ActorGroup
from bandpo.errors import StartupTimeout
from bandpo.rollout.group import RolloutGroup

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


class _Worker:
    """A rank or engine: ``hang`` never leaves its constructor, ``fail`` raises there."""

    def __init__(self, name: str, how: str = "ok"):
        self.name = name
        if how == "hang":
            threading.Event().wait()
        if how == "fail":
            raise RuntimeError(f"{name} could not load its model")

    def info(self):
        return {"rank": self.name, "node": "n", "accelerator": "cpu", "precision": "fp32", "device": "cpu"}

    def ready(self):
        return True


def _workers(ray, hows):
    return [ray.remote(_Worker).options(num_cpus=0).remote(str(i), how) for i, how in enumerate(hows)]


def _started_now(ray, group, hows, timeout_s):
    """The limit runs from here, once the workers meant to start have (Ray starts a worker process
    in seconds on a loaded machine: the limit must not race it)."""
    ray.get([r for r, how in zip(group._ready, hows) if how == "ok"])
    group._started, group.startup_timeout_s = time.monotonic(), timeout_s


def _actor_group(ray, hows, timeout_s) -> ActorGroup:
    group = object.__new__(ActorGroup)  # the constructor's Ray actors are DeepSpeed ranks: stand-ins here
    group.workers = _workers(ray, hows)
    group._ready, group.reports = [w.info.remote() for w in group.workers], []
    _started_now(ray, group, hows, timeout_s)
    return group


def _rollout_group(ray, hows, timeout_s) -> RolloutGroup:
    group = object.__new__(RolloutGroup)
    group.workers = _workers(ray, hows)
    group._ready = [w.ready.remote() for w in group.workers]
    _started_now(ray, group, hows, timeout_s)
    return group


def test_an_actor_rank_that_never_starts_is_named_with_the_nccl_hint(ray_local):
    group = _actor_group(ray_local, ["ok", "hang", "ok"], 1.0)
    with pytest.raises(StartupTimeout) as e:
        group.wait_ready()
    msg = str(e.value)
    assert msg.startswith(
        "start-up: rank 1 of the actor ranks did not answer within 1 s of their start (rank 0; rank 2 did)"
    )
    assert "NCCL_SOCKET_IFNAME / NCCL_IB_HCA must be exported on each node before its `ray start`" in msg
    assert "trainer.startup_timeout sets the limit" in msg
    for w in group.workers:
        ray_local.kill(w)


def test_an_engine_that_never_starts_is_named(ray_local):
    group = _rollout_group(ray_local, ["hang", "hang"], 1.0)
    with pytest.raises(
        StartupTimeout,
        match=r"rollout engine 0, rollout engine 1 of the rollout engines did not answer within 1 s of their "
        r"start \(none did\): .*logs/rollout\.log",
    ):
        group.wait_ready()
    for w in group.workers:
        ray_local.kill(w)


def test_a_constructor_that_fails_ends_the_wait_at_once(ray_local):
    from ray.exceptions import RayActorError

    group = _actor_group(ray_local, ["hang", "fail"], 600.0)  # the pytest timeout would end a full wait
    with pytest.raises(RayActorError, match="1 could not load its model"):
        group.wait_ready()
    engines = _rollout_group(ray_local, ["ok"], 600.0)
    engines.wait_ready()  # started in time: nothing raised, nothing left to wait for
    assert engines._ready == []
    for w in [*group.workers, *engines.workers]:
        ray_local.kill(w)
