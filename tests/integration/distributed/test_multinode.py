"""What a run joining a 2-node cluster gives every node, on a simulated cluster (``ray.cluster_utils.Cluster``).

Simulated: both nodes are raylets on this machine, so they share one filesystem and one bandpo
install. What differs, as between two machines: the second node's raylet was started in another
working directory and before the driver exported its variables, so its workers have neither the
driver's environment nor its directory unless the job carries them.

- the variables users set (by prefix and name) reach workers on both nodes, a task's and an
  actor's with its own runtime_env (the actor ranks'), and the per-node ones (a node's caches and
  network interfaces, the GPUs Ray gives a worker) do not;
- the workers import the bandpo package the job shipped, not the one on the node's path;
- ``check_nodes`` passes for an absolute folder both nodes see, and names the second node when
  it sees another folder at the same path, and the same for a local model folder (``model.path``).
  The second cases use ``/proc/self/cwd/...``: an absolute path each process resolves against its own
  working directory, so the second node's tasks look into another directory, as a machine without
  the shared mount would.
"""

import os
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SET = {
    "HF_TOKEN": "hf_secret",
    "HF_ENDPOINT": "https://mirror.example",
    "NCCL_DEBUG": "INFO",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "VLLM_ATTENTION_BACKEND": "FLASH_ATTN",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "CUDA_LAUNCH_BLOCKING": "1",
    "WANDB_PROJECT": "p",
    "TRANSFORMERS_VERBOSITY": "error",
}
# each node's own: set before its `ray start`, never the driver's
PER_NODE = {
    "VLLM_HOST_IP": "10.9.9.9",
    "HF_HOME": "/driver/hf",
    "NCCL_SOCKET_IFNAME": "eth9",
    "NCCL_IB_HCA": "mlx5_9",
    "GLOO_SOCKET_IFNAME": "eth9",
}
PER_WORKER = {"CUDA_VISIBLE_DEVICES": "7"}  # Ray sets it for each worker


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import ray
    from ray.cluster_utils import Cluster

    from bandpo.distributed import init_ray

    # This module's remote functions travel by value: the workers have bandpo (shipped by the job)
    # but not the tests package, which only the driver's own sys.path holds.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    driver_dir, other_dir = tmp_path_factory.mktemp("driver"), tmp_path_factory.mktemp("other-node")
    cwd, saved = os.getcwd(), dict(os.environ)
    os.chdir(driver_dir)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        os.chdir(other_dir)  # the second raylet, and the workers it forks, start here
        c.add_node(num_cpus=1, resources={"other_node": 1})
        os.chdir(driver_dir)
        c.wait_for_nodes()
        os.environ.update(
            {**SET, **PER_NODE, **PER_WORKER}
        )  # after the raylets started: only the job can carry them
        assert init_ray(c.address, "cpu") == "cpu"
        nodes = {("other" if n["Resources"].get("other_node") else "head"): n["NodeID"] for n in ray.nodes()}
        yield nodes, driver_dir, other_dir
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        ray.shutdown()
        c.shutdown()
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(saved)


def _on(node_id):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


def _seen(names):
    import bandpo

    return {k: os.environ.get(k) for k in names}, bandpo.__file__


def test_the_variables_users_set_reach_both_nodes_and_the_per_node_ones_do_not(cluster):
    import ray

    nodes, _, _ = cluster
    names = [*SET, *PER_NODE, *PER_WORKER, "RANK_OWN"]
    seen = ray.get([ray.remote(_seen).options(**_on(nodes[n])).remote(names) for n in ("head", "other")])

    @ray.remote
    class Rank:  # as an actor rank: its own runtime_env (bandpo.actor.group) on top of the job's
        def seen(self):
            return _seen(names)

    rank = Rank.options(**_on(nodes["other"]), runtime_env={"env_vars": {"RANK_OWN": "1"}}).remote()
    seen.append(ray.get(rank.seen.remote()))
    repo = Path(__file__).resolve().parents[3]
    for env, package in seen:
        assert {k: env[k] for k in SET} == SET
        assert {k: env[k] for k in PER_NODE} == dict.fromkeys(PER_NODE)  # the raylets started without them
        assert env["CUDA_VISIBLE_DEVICES"] != PER_WORKER["CUDA_VISIBLE_DEVICES"]
        # the package Ray unpacked from the job (py_modules), ahead of the worktree on PYTHONPATH
        assert not Path(package).resolve().is_relative_to(repo), package
    assert [env["RANK_OWN"] for env, _ in seen] == [None, None, "1"]


def test_a_folder_every_node_sees_passes_the_check(cluster, tmp_path):
    from bandpo.distributed.nodes import MARKER_PREFIX, check_nodes

    nodes, _, _ = cluster
    assert check_nodes(str(tmp_path)) == [nodes["other"]]  # the driver's own node needs no task
    assert not [p for p in os.listdir(tmp_path) if p.startswith(MARKER_PREFIX)]  # the marker is removed


def test_a_node_that_sees_another_folder_is_named(cluster):
    from bandpo.distributed.nodes import check_nodes
    from bandpo.errors import ConfigError

    nodes, driver_dir, other_dir = cluster
    (driver_dir / "run").mkdir()
    (other_dir / "run").mkdir()  # the same path on the other node is another, empty, folder
    with pytest.raises(ConfigError) as e:
        check_nodes("/proc/self/cwd/run")
    msg = str(e.value)
    assert "trainer.output_dir=/proc/self/cwd/run" in msg and "1 node(s)" in msg
    assert nodes["other"][:12] in msg and nodes["head"][:12] not in msg
    assert "every node mounts at the same path" in msg
    assert os.listdir(driver_dir / "run") == os.listdir(other_dir / "run") == []


def test_a_local_model_every_node_sees_passes_and_one_a_node_lacks_is_named(cluster, tmp_path):
    from bandpo.distributed.nodes import check_nodes
    from bandpo.errors import ConfigError

    nodes, driver_dir, other_dir = cluster
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    assert check_nodes(str(tmp_path), model_path=str(tmp_path / "model")) == [nodes["other"]]
    assert check_nodes(str(tmp_path), model_path="Qwen/Qwen2.5-7B-Instruct") == [nodes["other"]]  # a hub id
    (driver_dir / "model").mkdir()
    (driver_dir / "model" / "config.json").write_text("{}")
    (other_dir / "model").mkdir()  # the same path on the other node: a folder without the model
    with pytest.raises(ConfigError) as e:
        check_nodes(str(tmp_path), model_path="/proc/self/cwd/model")
    msg = str(e.value)
    assert msg.startswith(
        "config error: model.path=/proc/self/cwd/model is a folder on the driver that 1 node(s)"
    )
    assert nodes["other"][:12] in msg and nodes["head"][:12] not in msg
