"""The environment every worker gets (``bandpo.distributed.forwarded_env``), an actor rank's on top of it
(``bandpo.actor.group.rank_env``), and the job's runtime_env, alone and under Ray's Jobs API: pure
functions of a given environment, no Ray started (the merge is Ray's own function)."""

import json
import os

import pytest

from bandpo.actor.group import rank_device, rank_env
from bandpo.distributed import forwarded_env, job_runtime_env, ray_init_options, without_job_keys


def test_forwards_by_prefix_and_name_and_never_the_per_node_variables():
    environ = {
        "HF_TOKEN": "t",
        "HF_ENDPOINT": "e",
        "HUGGING_FACE_HUB_TOKEN": "t",
        "NCCL_DEBUG": "INFO",
        "TORCH_NCCL_BLOCKING_WAIT": "1",
        "VLLM_ATTENTION_BACKEND": "x",
        "WANDB_API_KEY": "k",
        "TRANSFORMERS_OFFLINE": "1",
        "DS_SKIP_CUDA_CHECK": "1",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "CUDA_LAUNCH_BLOCKING": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
        # per node: its caches, its network interfaces and adapters, its threads and paths
        "HF_HOME": "/driver/hf",
        "HF_HUB_CACHE": "/driver/hf/hub",
        "NCCL_SOCKET_IFNAME": "ib0",
        "NCCL_IB_HCA": "mlx5",
        "GLOO_SOCKET_IFNAME": "eth0",
        "OMP_NUM_THREADS": "4",
        "PYTHONPATH": "/driver/src",
        # per rank: the driver's DeepSpeed accelerator (train.sh's cpu on a head without GPUs)
        "DS_ACCELERATOR": "cpu",
        # per node or per process: Ray sets each worker's GPUs, vLLM's host IP is its node's own
        "CUDA_VISIBLE_DEVICES": "0,1",
        "VLLM_HOST_IP": "10.0.0.1",
        "VLLM_DP_RANK": "0",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "10.0.0.1",
        "RAY_ADDRESS": "auto",
        "HOME": "/root",
        "PATH": "/bin",
        "HFX": "no prefix match",
        "NCCL": "no prefix match",
    }
    want = {
        "HF_TOKEN",
        "HF_ENDPOINT",
        "HUGGING_FACE_HUB_TOKEN",
        "NCCL_DEBUG",
        "TORCH_NCCL_BLOCKING_WAIT",
        "VLLM_ATTENTION_BACKEND",
        "WANDB_API_KEY",
        "TRANSFORMERS_OFFLINE",
        "DS_SKIP_CUDA_CHECK",
        "PYTORCH_CUDA_ALLOC_CONF",
        "CUDA_LAUNCH_BLOCKING",
        "TOKENIZERS_PARALLELISM",
        "TORCH_DISTRIBUTED_DEBUG",
    }
    assert set(forwarded_env(environ)) == want
    assert forwarded_env(environ)["HF_TOKEN"] == "t"


@pytest.mark.parametrize("num_gpus,device", [(0.5, "cuda"), (1.0, "cuda"), (0, "cpu")])
def test_a_rank_gets_its_plans_accelerator_never_the_drivers(num_gpus, device):
    # train.sh on a head without GPUs: DS_ACCELERATOR=cpu in the driver's shell
    driver = {"DS_ACCELERATOR": "cpu", "HF_TOKEN": "t", "NCCL_SOCKET_IFNAME": "eth0"}
    options = {"num_cpus": 1, "num_gpus": num_gpus}  # bandpo.distributed.placement.actor_options' keys
    assert rank_device(options) == device
    assert rank_env(rank_device(options), driver) == {"DS_ACCELERATOR": device, "HF_TOKEN": "t"}


def test_the_job_ships_the_package_only_when_it_joins_a_cluster():
    import bandpo

    assert "py_modules" not in ray_init_options()["runtime_env"]
    env = ray_init_options(ship_code=True)["runtime_env"]
    assert env["py_modules"] == [os.path.dirname(os.path.abspath(bandpo.__file__))]
    assert "__pycache__" in env["excludes"]


def _job(monkeypatch, runtime_env: dict) -> None:
    """This process as Ray's job supervisor starts an entrypoint: the job's runtime_env as JSON, and its
    variables in the environment (ray/dashboard/modules/job/job_supervisor.py)."""
    config = {"runtime_env": runtime_env, "metadata": {}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(config))
    for k, v in runtime_env.get("env_vars", {}).items():
        monkeypatch.setenv(k, v)


def test_under_the_jobs_api_ray_merges_the_job_env_with_ours(monkeypatch, tmp_path):
    from ray.runtime_env.runtime_env import _merge_runtime_env  # what ray.init calls (ray/_private/worker.py)

    job = {
        "working_dir": "gcs://_ray_pkg_0123.zip",
        "excludes": ["*.ckpt"],
        "env_vars": {"HF_TOKEN": "job-token", "VLLM_LOGGING_LEVEL": "INFO"},
    }
    _job(monkeypatch, job)
    monkeypatch.setenv("WANDB_PROJECT", "p")  # the driver's own, not the job's
    assert job_runtime_env() == job
    ours = ray_init_options(tmp_path / "logs", ship_code=True)["runtime_env"]
    merged = _merge_runtime_env(job, ours)  # None: Ray's "Failed to merge the Job's runtime env"
    assert merged is not None
    assert merged["env_vars"]["HF_TOKEN"] == "job-token" and merged["env_vars"]["WANDB_PROJECT"] == "p"
    assert merged["excludes"] == ["*.ckpt"] and merged["working_dir"] == job["working_dir"]
    assert merged["py_modules"] == ours["py_modules"] and "worker_process_setup_hook" in merged
    # what ray.init was given before: the job's variables and fields again, which Ray refuses
    unfiltered = dict(ours, excludes=["__pycache__", "*.pyc"], env_vars={**ours["env_vars"], "HF_TOKEN": "t"})
    assert _merge_runtime_env(job, unfiltered) is None


def test_without_job_keys_drops_only_what_the_job_sets():
    ours = {"py_modules": ["/b"], "excludes": ["x"], "env_vars": {"A": "1", "B": "2"}}
    kept, dropped = without_job_keys(ours, {"py_modules": ["/j"], "env_vars": {"B": "9"}})
    assert kept == {"excludes": ["x"], "env_vars": {"A": "1"}}
    assert dropped == ["py_modules", "B"]
    assert without_job_keys(ours, {}) == (ours, [])
    assert job_runtime_env({}) is None
