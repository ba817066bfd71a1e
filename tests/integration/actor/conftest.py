"""Fixtures shared by the actor's integration tests."""

import pytest


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance with 2 CPUs (one per actor rank), for the module's multi-rank tests."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
