"""Joining a Ray cluster from a driver without GPUs, with a second node started in another directory.

The simulated cluster (``ray.cluster_utils.Cluster``): a head node with 8 fake GPUs and a
CPU-only second node whose raylet (and so every worker it starts) runs in another working
directory, as a ``ray start`` on another machine does. The driver (this process) sees no GPU.

- ``trainer.device=auto`` is decided by the cluster's GPUs (``cuda``), not the driver's;
- the worker log folder, given relative to the driver's directory, is where the second node's
  workers write (the driver passes it absolute);
- an actor rank's device index comes from the GPU Ray assigned to it;
- a real actor rank seated on a GPU share gets DeepSpeed's CUDA accelerator whatever the driver's
  ``DS_ACCELERATOR`` (``cpu`` here, as train.sh exports on a head without GPUs), and, finding no GPU
  (the GPUs are fake), stops with one line naming the rank and its node before it builds anything.
"""

import os

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import ray
    from ray.cluster_utils import Cluster

    from bandpo.distributed import init_ray

    driver_dir, other_dir = tmp_path_factory.mktemp("driver"), tmp_path_factory.mktemp("other-node")
    cwd = os.getcwd()
    os.chdir(driver_dir)
    c = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 8, "include_dashboard": False}
    )
    try:
        os.chdir(other_dir)  # the second raylet, and the workers it forks, start here
        c.add_node(num_cpus=2, num_gpus=0, resources={"other_node": 1})
        os.chdir(driver_dir)
        c.wait_for_nodes()
        os.makedirs("runs/r/logs")
        # relative, as output_dir=runs/... gives it
        device = init_ray(c.address, "auto", logs_dir="runs/r/logs")
        yield device, driver_dir, other_dir
    finally:
        ray.shutdown()
        c.shutdown()
        os.chdir(cwd)


def test_auto_device_follows_the_clusters_gpus_not_the_drivers(cluster):
    import torch

    device, _, _ = cluster
    assert not torch.cuda.is_available()
    assert device == "cuda"


def test_worker_on_another_node_writes_the_run_log(cluster):
    import ray

    _, driver_dir, other_dir = cluster

    @ray.remote(num_cpus=1, resources={"other_node": 1})
    def hello():
        from bandpo.run.worker_logs import redirect_group_output

        redirect_group_output("verifier")
        print("hello from the other node", flush=True)
        return os.getcwd()

    assert os.path.realpath(ray.get(hello.remote())) == os.path.realpath(other_dir)
    log = driver_dir / "runs" / "r" / "logs" / "verifier.log"
    assert "hello from the other node" in log.read_text()
    assert not (other_dir / "runs").exists()


@pytest.mark.parametrize("noset", [False, True])
def test_actor_rank_device_index_is_the_gpu_ray_assigned(cluster, noset):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = placement_group([{"GPU": 1, "CPU": 0.1}] * 4, strategy="STRICT_PACK")
    ray.get(pg.ready())

    @ray.remote
    def seat(rank):
        from bandpo.actor.setup import assigned_gpu

        return ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"), assigned_gpu(rank, 8)

    env = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}} if noset else {}
    try:
        seen = ray.get(
            [
                seat.options(
                    num_cpus=0.1,
                    num_gpus=0.5,
                    runtime_env=env,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b),
                ).remote(b)
                for b in range(3, -1, -1)
            ]
        )  # rank r = bundle r; ranks no guide to the GPU ids
    finally:
        remove_placement_group(pg)
    for ids, visible, index in seen:
        assert len(ids) == 1
        # Ray narrows CUDA_VISIBLE_DEVICES to the assigned GPU (index 0); with NOSET all stay visible
        assert (visible, index) == ((None, int(ids[0])) if noset else (str(ids[0]), 0))


def test_a_rank_on_a_gpu_share_checks_its_device_against_the_plan(cluster, monkeypatch):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from bandpo.actor import ActorGroup
    from bandpo.errors import WorkerFailure

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # the driver's: a head without GPUs
    pg = placement_group([{"GPU": 1, "CPU": 1}], strategy="STRICT_PACK")
    ray.get(pg.ready())
    seat = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
    group = None
    try:
        with pytest.raises(WorkerFailure) as e:
            # bandpo.distributed.placement.actor_options' keys; the model is never read
            group = ActorGroup(
                "/no/model",
                1,
                options_per_rank=[{"num_cpus": 1, "num_gpus": 0.5, "scheduling_strategy": seat}],
                mini_batch_size=1,
                micro_batch_size=1,
            )
    finally:
        if group is not None:
            group.shutdown()
        remove_placement_group(pg)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("actor rank 0 on node "), msg
    assert "the plan puts it on cuda but torch sees no CUDA device" in msg and "DS_ACCELERATOR=cuda" in msg
